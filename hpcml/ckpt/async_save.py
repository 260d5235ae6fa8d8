"""Saves whose file writing overlaps training (:class:`AsyncSaver`): the plan and commit are
:mod:`hpcml.ckpt.writer`'s, the shard is written by a long-lived process per rank
(:mod:`hpcml.ckpt.async_writer`) from a staging buffer this module fills."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Collection

import numpy as np
import torch

from hpcml.ckpt import codec, format as fmt
from hpcml.ckpt.async_writer import ShardWriter, layout as staging_layout
from hpcml.ckpt.chunks import ChunkMeta, assign_owners
from hpcml.ckpt.pipeline import Pending, SaveResult, agree, finish, local_pieces, prepare


class AsyncSaver:
    """Saves whose file writing overlaps training: one in flight at a time.

    ``save()`` blocks for the plan (one allgather) and one copy of this rank's pieces into a
    reused staging buffer; a long-lived writer process per rank
    (:mod:`hpcml.ckpt.async_writer`) writes the shard from it while training goes on. With
    ``overlap=True`` even the copy runs in a background thread (torch's copy releases the
    GIL), alongside the next forward and backward: the caller then calls
    :meth:`wait_staged` before anything changes the saved tensors -- the next optimizer
    step (``CheckpointHook`` registers that as an optimizer step pre-hook). The next
    ``save()``, and ``wait()`` (call it before exit), collect the writer's status and
    commit (collective), so host memory holds one staging buffer of this rank's shard at
    most. ``close()`` also stops the writer process.
    """

    def __init__(self, comm=None) -> None:
        from mpi4py import MPI

        self.comm = comm or MPI.COMM_WORLD
        self._writer = ShardWriter()
        self._inflight: Pending | None = None
        self._staging: threading.Thread | None = None
        self._staging_error: BaseException | None = None

    def save(self, root: str | os.PathLike, step: int, tensors: dict[str, torch.Tensor], *,
             extra: dict | None = None, layout: dict | None = None, keep: int | fmt.Keep | None = None,
             tensor_attrs: dict[str, dict] | None = None, overlap: bool = False, copy_now: Collection[str] = (),
             key=None) -> float:
        """Start a save; returns the seconds training was blocked (previous save's commit
        included). ``overlap``: copy in the background; call :meth:`wait_staged` before the
        tensors change -- except those named in ``copy_now``, copied before this returns
        (tensors that may change before the caller's guard, such as a sample source's)."""
        t0 = time.perf_counter()
        self.wait()
        pending = prepare(root, step, tensors, self.comm, extra, layout, keep, tensor_attrs, snapshot=False, key=key)
        self._inflight = pending
        if pending.mine:
            now = set(copy_now)
            try:
                items, buf = self._plan_staging(pending)
                if overlap:
                    self._copy(pending, items, buf, lambda c: c.name in now)
            except Exception as e:  # noqa: BLE001 -- reported on every rank at the commit
                self._staging_error = e
                return time.perf_counter() - t0
            if overlap:
                self._staging = threading.Thread(target=self._stage, args=(pending, items, buf, now),
                                                 name="hpcml-ckpt-stage", daemon=True)
                self._staging.start()
            else:
                self._stage(pending, items, buf)
        return time.perf_counter() - t0

    def wait_staged(self) -> None:
        """Return once the save in flight has its snapshot (the tensors may change after)."""
        if self._staging is not None:
            self._staging.join()
            self._staging = None

    def _plan_staging(self, p: Pending) -> tuple[list[dict], object]:
        tensors = [p.arrays[c.key] for c in p.mine]
        offsets, total = staging_layout([t.numel() * t.element_size() for t in tensors])
        buf = self._writer.staging(total)
        items = [{"dataset": c.dataset, "offset": list(c.offset), "shape": list(t.shape),
                  "dtype": np.dtype(codec.storage(t.dtype)[0]).str, "at": at}
                 for c, t, at in zip(p.mine, tensors, offsets)]
        return items, buf

    def _stage(self, p: Pending, items: list[dict], buf, done: Collection[str] = ()) -> None:
        """Copy this rank's pieces (but those of the tensors named in ``done``) into the staging
        buffer, then hand the job to the writer."""
        try:
            self._copy(p, items, buf, lambda c: c.name not in done)
            p.arrays = {}  # the staging buffer holds the snapshot now
            name = fmt.shard_name(p.rank)
            self._writer.submit(p.tmp / name, items, p.shard_attrs, p.mac_key(name))
        except BaseException as e:  # noqa: BLE001 -- reported on every rank at the commit
            self._staging_error = e

    @staticmethod
    def _copy(p: Pending, items: list[dict], buf, which: Callable[[ChunkMeta], bool]) -> None:
        """torch's copy: parallel on CPU, straight from device memory on a GPU."""
        for c, it in zip(p.mine, items):
            t = p.arrays[c.key]
            if which(c) and t.numel():
                torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=it["at"]).view(t.shape).copy_(t)

    def reserve(self, tensors: dict[str, torch.Tensor], *, tensor_attrs: dict[str, dict] | None = None) -> int:
        """Optional, collective (one allgather): size this rank's staging buffer for saves of
        ``tensors`` and allocate it in the background, so the first save blocks only for its
        copy. Returns the bytes reserved on this rank."""
        metas, per_rank = agree(self.comm, lambda: local_pieces(tensors, tensor_attrs)[0],
                                 "reserving the async save buffer")
        owner, rank = assign_owners(per_rank), self.comm.Get_rank()
        need = staging_layout([c.nbytes for c in metas if owner[c.key] == rank])[1]
        self._writer.reserve(need)
        return need

    def wait(self) -> SaveResult | None:
        """Collect the save in flight, if any, and commit it (collective)."""
        if self._inflight is None:
            return None
        self.wait_staged()
        pending, self._inflight = self._inflight, None
        status: tuple = ("ok", 0, "", {})
        write_s = 0.0
        if self._staging_error is not None:
            e, self._staging_error = self._staging_error, None
            status = ("error", f"rank {pending.rank}: staging failed: {type(e).__name__}: {e}", "", {})
        elif pending.mine:
            r = self._writer.result()
            if r["ok"]:
                status = ("ok", r["bytes"], fmt.shard_name(pending.rank),
                          {"meta_sha256": r["meta_sha256"], "tables": dict(zip((c.key for c in pending.mine),
                                                                                r["datasets"]))})
                write_s = float(r["seconds"])  # the write itself, not the wait for this call
            else:
                status = ("error", f"rank {pending.rank}: {r['error']}", "", {})
        return finish(pending, status, write_s)

    def close(self) -> None:
        """Commit the save in flight (collective) and stop the writer process."""
        try:
            self.wait()
        finally:
            self._writer.close()
