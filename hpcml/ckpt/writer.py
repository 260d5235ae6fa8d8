"""Save: every rank writes its own pieces to ``rank_NNNNN.h5``; rank 0 writes ``index.h5``,
whose virtual datasets present each global tensor whole; the directory is committed by rename.

Crash safety: everything goes to ``step_N.tmp/``; shards and index are fsynced, the
directory is renamed to ``step_N/`` and only then is ``latest`` replaced (write + rename).
Integrity: every HDF5 data chunk carries a Fletcher-32 checksum that HDF5 verifies on every
read, HDF5 metadata is checksummed (``libver="latest"``), and the index records each
shard's size, so truncation, bit rot and a replaced shard are all caught on load.
A save killed at any moment leaves ``latest`` on the previous complete checkpoint.
Three collectives per save: an allgather of what each rank holds, a gather of the shard
checksums, a broadcast of the outcome (so a failure raises on every rank).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import torch

from hpcml import __version__, log
from hpcml.ckpt import format as fmt
from hpcml.ckpt.async_writer import ShardWriter, layout as staging_layout
from hpcml.ckpt.plan import ChunkMeta, assign_owners, check_fused, fused_boxes, fused_spec
from hpcml.ckpt.shard import fsync_path, write_shard
from hpcml.ckpt.state import fused_shards, local_piece, placement_str
from hpcml.errors import CheckpointError

logger = log.get_logger(__name__)


@dataclass(frozen=True)
class SaveResult:
    path: Path
    bytes_written: int
    seconds: float


def _pieces(tensors: dict[str, torch.Tensor], tensor_attrs: dict[str, dict] | None = None,
            ) -> tuple[list[ChunkMeta], dict[tuple, torch.Tensor], dict[str, str]]:
    """This rank's chunks. A fused tensor (``fused_widths`` in its ``tensor_attrs``) held as
    tensor-parallel shards ``[wq_r; wk_r; wv_r]`` becomes one chunk per sub-parameter slice,
    each at its offset in the logical ``[wq; wk; wv]`` (:func:`hpcml.ckpt.plan.fused_runs`).
    Raises CheckpointError when a declaration does not fit its tensor."""
    metas, locals_, placements = [], {}, {}
    for name, t in tensors.items():
        local, gshape, offset = local_piece(t)
        placements[name] = placement_str(t)
        spec = fused_spec((tensor_attrs or {}).get(name))
        parts = [(local, offset)]
        if spec is not None:
            widths, dim = spec
            n = fused_shards(t, dim) if isinstance(dim, int) and 0 <= dim < len(gshape) else 1
            why = check_fused(name, widths, dim, gshape, n)
            if why:
                raise CheckpointError(why)
            parts = [(local.narrow(dim, lo, shp[dim]), off)
                     for lo, off, shp in fused_boxes(widths, dim, n, offset, tuple(local.shape))]
        if local.numel() == 0:
            continue
        for piece, off in parts:
            if piece.dim() == 0:  # scalars are stored as shape (1,) with an attribute saying so
                piece, gshape, off = piece.reshape(1), (1,), (0,)
            m = ChunkMeta(name, gshape, off, tuple(piece.shape), fmt.storage(piece.dtype)[1],
                          piece.numel() * piece.element_size())
            metas.append(m)
            locals_[m.key] = piece
    return metas, locals_, placements


def _write_shard(path: Path, chunks: list[ChunkMeta], arrays: dict[tuple, np.ndarray]) -> dict[tuple, tuple]:
    """Write this rank's owned chunks; returns the HDF5 chunk shape of each (for read accounting)."""
    return dict(zip((c.key for c in chunks), write_shard(path, [(c.dataset, c.offset, arrays[c.key]) for c in chunks])))


def _write_index(path: Path, per_rank: list[list[ChunkMeta]], owner: dict[tuple, int], storage: dict[tuple, tuple],
                 attrs: dict, tensor_attrs: dict[str, dict], placements: dict[str, str], scalars: set[str],
                 single_file: bool = False) -> None:
    by_name: dict[str, list[ChunkMeta]] = {}
    seen: set[tuple] = set()
    for chunks in per_rank:
        for c in chunks:
            if c.key not in seen:
                seen.add(c.key)
                by_name.setdefault(c.name, []).append(c)
    if single_file:  # one whole dataset per tensor in SINGLE_FILE: one piece covering it
        by_name = {n: [ChunkMeta(n, cs[0].global_shape, (0,) * len(cs[0].global_shape), cs[0].global_shape,
                                 cs[0].dtype, 0)] for n, cs in by_name.items()}

    def source(c: ChunkMeta) -> tuple[str, str]:
        return (SINGLE_FILE, c.name) if single_file else (fmt.shard_name(owner[c.key]), c.dataset)
    with h5py.File(path, "w", libver="latest") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for name in sorted(by_name):
            chunks = by_name[name]
            first = chunks[0]
            np_dtype = fmt.storage(getattr(torch, first.dtype))[0]
            layout = h5py.VirtualLayout(shape=first.global_shape, dtype=np_dtype)
            for c in chunks:
                src = h5py.VirtualSource(f"./{source(c)[0]}", source(c)[1], shape=c.shape, dtype=np_dtype)
                layout[tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))] = src
            ds = f.create_virtual_dataset(name, layout)
            ds.attrs["dtype"] = first.dtype
            ds.attrs["global_shape"] = np.asarray([] if name in scalars else first.global_shape, dtype=np.int64)
            ds.attrs["partition"] = placements.get(name, "")
            ds.attrs["chunks"] = fmt.dumps([{"offset": list(c.offset), "shape": list(c.shape),
                                             "file": source(c)[0],
                                             # contiguous (single-file) data is read element-exact
                                             "storage_chunk": [1] * len(c.shape) if single_file
                                             else list(storage.get(c.key) or c.shape)} for c in chunks])
            for k, v in tensor_attrs.get(name, {}).items():
                ds.attrs[k] = v
    fsync_path(path)


SINGLE_FILE = "shared.h5"


def _write_single(p: _Pending) -> tuple:
    """Collective single-file mode: all ranks write their hyperslabs of full-size datasets
    into one file through h5py's ``mpio`` driver (contiguous, no per-chunk checksums)."""
    tensors = {c.name: c for chunks in p.per_rank for c in chunks}
    p.tmp.mkdir(parents=True, exist_ok=True)
    path = p.tmp / SINGLE_FILE
    with h5py.File(path, "w", driver="mpio", comm=p.comm, libver="latest") as f:
        for name in sorted(tensors):  # dataset creation is collective: same order everywhere
            c = tensors[name]
            f.create_dataset(name, shape=c.global_shape, dtype=fmt.storage(getattr(torch, c.dtype))[0])
        for c in p.mine:
            f[c.name][tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))] = p.arrays[c.key]
    if p.rank == 0:
        fsync_path(path)
        return ("ok", path.stat().st_size, SINGLE_FILE, {})
    return ("ok", 0, SINGLE_FILE, {})


def _commit(root: Path, tmp: Path, final: Path, keep: int | None) -> None:
    fsync_path(tmp)
    if final.exists():  # re-saving a step: move the old one aside first, delete after the new one is in place
        old = root / (final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_path(root)
    latest_tmp = root / (fmt.LATEST + ".tmp")
    latest_tmp.write_text(final.name + "\n")
    fsync_path(latest_tmp)
    latest_tmp.rename(root / fmt.LATEST)
    fsync_path(root)
    if keep:
        steps = sorted(p for p in root.iterdir() if fmt.STEP_RE.match(p.name) and p != final)
        for old in steps[: max(0, len(steps) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)


@dataclass
class _Pending:
    """A save between its plan (collective) and its commit (collective)."""

    rank: int
    comm: object
    root: Path
    final: Path
    tmp: Path
    step: int
    per_rank: list
    owner: dict
    mine: list
    arrays: dict
    placements: dict
    scalars: set
    attrs: dict
    tensor_attrs: dict
    keep: int | None
    t0: float
    single_file: bool = False


def _normalized(attrs: dict) -> dict:
    """Tensor attributes as written: a fused declaration with ``fused_dim`` made explicit."""
    spec = fused_spec(attrs)
    out = {k: v for k, v in attrs.items() if k not in ("fused_widths", "fused_dim")}
    if spec is not None:
        out["fused_widths"], out["fused_dim"] = spec
    return out


def _agree(comm, local: Callable[[], Any], what: str, share: Callable[[Any], Any] = lambda r: r) -> tuple[Any, list]:
    """This rank's part of a plan, then one allgather of ``share(part)``: every rank gets
    every part, or every rank raises the first failure -- whatever fails before a collective
    (a declaration that does not fit, a directory that cannot be made) must not leave the
    other ranks waiting in it for ever."""
    try:
        mine, error = local(), None
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        mine, error = None, str(e) if isinstance(e, CheckpointError) else f"rank {comm.Get_rank()}: {type(e).__name__}: {e}"
    parts, errors = zip(*comm.allgather((None if error else share(mine), error)))
    errors = [e for e in errors if e]
    if errors:
        raise CheckpointError(f"{what} failed: {errors[0]}")
    return mine, list(parts)


def _prepare(root, step, tensors, comm, extra, layout, keep, tensor_attrs, snapshot: bool = True) -> _Pending:
    """Agree on who writes what (one allgather); with ``snapshot``, this rank's pieces as host
    arrays (a view on CPU), else the tensors themselves (the async saver stages them)."""
    rank = comm.Get_rank()
    t0 = time.perf_counter()
    root = Path(root)
    final = root / fmt.step_dir(step)
    tmp = root / (final.name + ".tmp")

    def plan():
        pieces = _pieces(tensors, tensor_attrs)
        if rank == 0:  # nobody writes into tmp until rank 0 has cleared a stale one
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        return pieces, {n for n, t in tensors.items() if t.dim() == 0}

    ((metas, locals_, placements), _), parts = _agree(comm, plan, f"saving {final}",
                                                      share=lambda r: (r[0][0], r[1]))
    per_rank, all_scalars = zip(*parts)
    owner = assign_owners(list(per_rank))
    mine = [c for c in metas if owner[c.key] == rank]
    tensor_attrs = {n: _normalized(a) for n, a in (tensor_attrs or {}).items()}
    fused = any("fused_widths" in tensor_attrs.get(c.name, {}) for cs in per_rank for c in cs)
    attrs = {"format_version": fmt.FORMAT_VERSION if fused else fmt.BASE_FORMAT_VERSION, "hpcml_version": __version__,
             "step": step, "world_size": comm.Get_size(), "layout": fmt.dumps(layout or {}),
             "extra": fmt.dumps(extra or {})}
    # only what this rank writes (a device-to-host copy on GPUs; a view on CPU)
    arrays = {c.key: fmt.to_numpy(locals_[c.key]) if snapshot else locals_[c.key].detach() for c in mine}
    return _Pending(rank, comm, root, final, tmp, step, list(per_rank), owner, mine, arrays, placements,
                    set().union(*all_scalars), attrs, tensor_attrs, keep, t0)


def _write_local(p: _Pending) -> tuple:
    """This rank's shard; the status that :func:`_finish` gathers. Touches no MPI (runs in a writer process)."""
    rank = p.rank
    try:
        p.tmp.mkdir(parents=True, exist_ok=True)
        if p.mine:
            shard = p.tmp / fmt.shard_name(rank)
            storage = _write_shard(shard, p.mine, p.arrays)
            return ("ok", shard.stat().st_size, shard.name, storage)
    except Exception as e:  # noqa: BLE001 -- reported on every rank by _finish
        return ("error", f"rank {rank}: {type(e).__name__}: {e}", "", {})
    return ("ok", 0, "", {})


def _finish(p: _Pending, status: tuple) -> SaveResult:
    """Gather shard statuses, rank 0 writes the index and commits, everyone learns the outcome."""
    comm, rank = p.comm, p.rank
    statuses = comm.gather(status, root=0)
    outcome: str | None = None
    if rank == 0:
        errors = [s[1] for s in statuses if s[0] == "error"]
        if errors:
            outcome = "; ".join(errors)
        else:
            try:
                storage = {k: v for s in statuses for k, v in s[3].items()}
                shards = [{"file": s[2], "bytes": s[1]} for s in statuses if s[1]]
                attrs = {**p.attrs, "shards": fmt.dumps(shards), "created": time.time()}
                _write_index(p.tmp / fmt.INDEX, p.per_rank, p.owner, storage, attrs, p.tensor_attrs, p.placements,
                             p.scalars, single_file=p.single_file)
                _commit(p.root, p.tmp, p.final, p.keep)
            except Exception as e:  # noqa: BLE001
                outcome = f"rank 0: {type(e).__name__}: {e}"
    outcome = comm.bcast(outcome, root=0)
    if outcome is not None:
        raise CheckpointError(f"saving {p.final} failed: {outcome}")
    written = sum(c.nbytes for c in p.mine)
    dt = time.perf_counter() - p.t0
    logger.info("saved %s (%.1f MB from this rank) in %.2f s", p.final, written / 1e6, dt)
    return SaveResult(p.final, written, dt)


def save(root: str | os.PathLike, step: int, tensors: dict[str, torch.Tensor], *, comm=None,
         extra: dict | None = None, layout: dict | None = None, keep: int | None = None,
         tensor_attrs: dict[str, dict] | None = None, single_file: bool = False) -> SaveResult:
    """Write ``tensors`` (name -> DTensor or tensor; all ranks pass the names they hold) as
    checkpoint ``root/step_N``. ``extra`` is JSON-able non-tensor state (config, data
    positions, ...). ``keep`` prunes to the newest K checkpoints. ``single_file``: all
    ranks write one ``shared.h5`` collectively (MPI-IO) instead of a file each; the index
    and the reader are the same. Collective over ``comm``.
    """
    from mpi4py import MPI

    pending = _prepare(root, step, tensors, comm or MPI.COMM_WORLD, extra, layout, keep, tensor_attrs)
    pending.single_file = single_file
    if single_file:
        import h5py as _h5py

        if not _h5py.get_config().mpi:
            raise CheckpointError("single_file=True needs h5py built with MPI (parallel HDF5); rebuild with HDF5_MPI=ON")
        return _finish(pending, _write_single(pending))
    return _finish(pending, _write_local(pending))


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
        self._inflight: _Pending | None = None
        self._staging: threading.Thread | None = None
        self._staging_error: BaseException | None = None

    def save(self, root: str | os.PathLike, step: int, tensors: dict[str, torch.Tensor], *,
             extra: dict | None = None, layout: dict | None = None, keep: int | None = None,
             tensor_attrs: dict[str, dict] | None = None, overlap: bool = False) -> float:
        """Start a save; returns the seconds training was blocked (previous save's commit
        included). ``overlap``: copy in the background; call :meth:`wait_staged` before the
        tensors change."""
        t0 = time.perf_counter()
        self.wait()
        pending = _prepare(root, step, tensors, self.comm, extra, layout, keep, tensor_attrs, snapshot=False)
        self._inflight = pending
        if pending.mine:
            try:
                items, buf = self._plan_staging(pending)
            except Exception as e:  # noqa: BLE001 -- reported on every rank at the commit
                self._staging_error = e
                return time.perf_counter() - t0
            if overlap:
                self._staging = threading.Thread(target=self._stage, args=(pending, items, buf),
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

    def _plan_staging(self, p: _Pending) -> tuple[list[dict], object]:
        tensors = [p.arrays[c.key] for c in p.mine]
        offsets, total = staging_layout([t.numel() * t.element_size() for t in tensors])
        buf = self._writer.staging(total)
        items = [{"dataset": c.dataset, "offset": list(c.offset), "shape": list(t.shape),
                  "dtype": np.dtype(fmt.storage(t.dtype)[0]).str, "at": at}
                 for c, t, at in zip(p.mine, tensors, offsets)]
        return items, buf

    def _stage(self, p: _Pending, items: list[dict], buf) -> None:
        """Copy this rank's pieces into the staging buffer (torch's copy: parallel on CPU,
        straight from device memory on a GPU), then hand the job to the writer."""
        try:
            for c, it in zip(p.mine, items):
                t = p.arrays[c.key]
                if t.numel():
                    torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=it["at"]).view(t.shape).copy_(t)
            p.arrays = {}  # the staging buffer holds the snapshot now
            self._writer.submit(p.tmp / fmt.shard_name(p.rank), items)
        except BaseException as e:  # noqa: BLE001 -- reported on every rank at the commit
            self._staging_error = e

    def reserve(self, tensors: dict[str, torch.Tensor], *, tensor_attrs: dict[str, dict] | None = None) -> int:
        """Optional, collective (one allgather): size this rank's staging buffer for saves of
        ``tensors`` and allocate it in the background, so the first save blocks only for its
        copy. Returns the bytes reserved on this rank."""
        metas, per_rank = _agree(self.comm, lambda: _pieces(tensors, tensor_attrs)[0],
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
        if self._staging_error is not None:
            e, self._staging_error = self._staging_error, None
            status = ("error", f"rank {pending.rank}: staging failed: {type(e).__name__}: {e}", "", {})
        elif pending.mine:
            r = self._writer.result()
            if r["ok"]:
                status = ("ok", r["bytes"], fmt.shard_name(pending.rank),
                          {c.key: tuple(ch) if ch else None for c, ch in zip(pending.mine, r["chunks"])})
            else:
                status = ("error", f"rank {pending.rank}: {r['error']}", "", {})
        return _finish(pending, status)

    def close(self) -> None:
        """Commit the save in flight (collective) and stop the writer process."""
        try:
            self.wait()
        finally:
            self._writer.close()
