"""The phases of a save that the blocking writer (:mod:`hpcml.ckpt.writer`) and the async
saver (:mod:`hpcml.ckpt.async_save`) share: plan (one allgather: who writes what), write
this rank's shard (no MPI: it also runs in a writer process), finish (a gather of the
statuses, rank 0's index and commit, a broadcast of the outcome). A :class:`Pending` is a
save between its plan and its commit, complete when built.
"""

from __future__ import annotations

import errno
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hpcml import __version__, log, waiting
from hpcml.ckpt import chunkmac, codec, format as fmt, keys as keyring_, lock, rollback
from hpcml.ckpt.index import commit, finish_manifest, write_index
from hpcml.ckpt.chunks import ChunkMeta, assign_owners, check_fused, fused_boxes, fused_spec
from hpcml.ckpt.shard import write_shard
from hpcml.ckpt.state import fused_shards, local_piece, placement_str
from hpcml.errors import CheckpointError, HpcmlError
from hpcml.numeric import is_int

logger = log.get_logger("hpcml.ckpt.writer")  # the save's lines under the writer's name, as before


@dataclass(frozen=True)
class SaveResult:
    """``seconds``: from the request to the commit (an async save's includes the training
    that ran meanwhile); ``write_seconds``: this rank's shard write alone (timed by the
    writer process for an async save), so a slow disk shows apart from a long wait."""

    path: Path
    bytes_written: int
    seconds: float
    write_seconds: float = 0.0


def local_pieces(tensors: dict[str, torch.Tensor], tensor_attrs: dict[str, dict] | None = None,
            ) -> tuple[list[ChunkMeta], dict[tuple, torch.Tensor], dict[str, str]]:
    """This rank's chunks. A fused tensor (``fused_widths`` in its ``tensor_attrs``) held as
    tensor-parallel shards ``[wq_r; wk_r; wv_r]`` becomes one chunk per sub-parameter slice,
    each at its offset in the logical ``[wq; wk; wv]`` (:func:`hpcml.ckpt.chunks.fused_runs`).
    Raises CheckpointError when a declaration does not fit its tensor."""
    metas, locals_, placements = [], {}, {}
    names = set(tensors)
    for name, t in tensors.items():
        why = fmt.name_problem(name)  # the reader's rule: a save it would refuse is never committed
        if why:
            raise CheckpointError(f"{why}; rename it before saving")
        group = next((name[:i] for i in range(len(name)) if name[i] == "/" and name[:i] in names), None)
        if group is not None:
            raise CheckpointError(f"tensor names {group!r} and {name!r}: HDF5 cannot hold {group!r} both as a "
                                  f"tensor and as the group of {name!r}; rename one")
        if not isinstance(t, torch.Tensor):  # a DTensor is one too
            raise CheckpointError(f"{name!r} is a {type(t).__name__}: expected a torch.Tensor or DTensor (a "
                                  f"non-tensor value goes in extra=, a JSON-able dict)")
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
            m = ChunkMeta(name, gshape, off, tuple(piece.shape), codec.storage(piece.dtype, name)[1],
                          piece.numel() * piece.element_size())
            metas.append(m)
            locals_[m.key] = piece
    return metas, locals_, placements


def _write_shard(path: Path, chunks: list[ChunkMeta], arrays: dict[tuple, np.ndarray], attrs: dict,
                 mac: chunkmac.ChunkMac | None = None) -> dict:
    """Write this rank's owned chunks; returns the shard's manifest entry and each chunk's table."""
    info = write_shard(path, [(c.dataset, c.offset, arrays[c.key]) for c in chunks], attrs=attrs, mac=mac)
    return {"meta_sha256": info["meta_sha256"], "tables": dict(zip((c.key for c in chunks), info["datasets"]))}


def failure(rank: int, e: BaseException, path: Path | None = None) -> str:
    """One line for a failed write; a full disk says so first."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"rank {rank}: no space left on device writing {path or e.filename}"
    return f"rank {rank}: {type(e).__name__}: {e}"


@dataclass
class Pending:
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
    keep: int | fmt.Keep | None
    t0: float
    single_file: bool = False
    keys: keyring_.Keyring | None = None
    unlock: bool = False
    """Rank 0 took the directory's lock for this save alone: give it up at the commit."""

    @property
    def shard_attrs(self) -> dict:
        """What binds each shard file to this save."""
        return {"hpcml_step": self.step, "hpcml_save_id": self.attrs["save_id"]}

    def mac_key(self, file: str) -> bytes | None:
        """In a signed save, the key of ``file``'s chunk digests (:mod:`hpcml.ckpt.chunkmac`;
        the save's random id is its salt), else None."""
        return chunkmac.file_key(self.keys.keys[0], self.attrs["save_id"], file) if self.keys is not None else None

    def mac(self, file: str) -> chunkmac.ChunkMac | None:
        key = self.mac_key(file)
        return chunkmac.ChunkMac(key) if key is not None else None


def normalized(attrs: dict) -> dict:
    """Tensor attributes as written: a fused declaration with ``fused_dim`` made explicit."""
    spec = fused_spec(attrs)
    out = {k: v for k, v in attrs.items() if k not in ("fused_widths", "fused_dim")}
    if spec is not None:
        out["fused_widths"], out["fused_dim"] = spec
    return out


def agree(comm, local: Callable[[], Any], what: str, share: Callable[[Any], Any] = lambda r: r) -> tuple[Any, list]:
    """This rank's part of a plan, then one allgather of ``share(part)``: every rank gets
    every part, or every rank raises the first failure -- whatever fails before a collective
    (a declaration that does not fit, a directory that cannot be made) must not leave the
    other ranks waiting in it for ever (nor spinning: ranks prepare at their own pace)."""
    try:
        mine, error = local(), None
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        mine, error = None, str(e) if isinstance(e, HpcmlError) else f"rank {comm.Get_rank()}: {type(e).__name__}: {e}"
    parts, errors = zip(*waiting.allgather(comm, (None if error else share(mine), error)))
    errors = [e for e in errors if e]
    if errors:
        raise CheckpointError(f"{what} failed: {errors[0]}")
    return mine, list(parts)


def prepare(root, step, tensors, comm, extra, layout, keep, tensor_attrs, snapshot: bool = True,
            key=None, single_file: bool = False) -> Pending:
    """Agree on who writes what (one allgather); with ``snapshot``, this rank's pieces as host
    arrays (a view on CPU), else the tensors themselves (the async saver stages them). Rank 0
    takes the directory's lock (:mod:`hpcml.ckpt.lock`); every rank reads the signing key, so
    a missing key file fails on all of them before anything is written."""
    rank = comm.Get_rank()
    t0 = time.perf_counter()
    root = Path(root)
    final = root / fmt.step_dir(step)
    tmp = root / (final.name + ".tmp")

    if not is_int(step) or step < 0:
        raise CheckpointError(f"step {step!r}: expected an integer >= 0")

    def plan():
        why = fmt.extra_problem(extra)  # on every rank: a manifest the reader would refuse is never written
        if not why and isinstance(extra, dict) and "step" in extra and extra["step"] != step:
            why = (f"extra['step'] is {str(extra['step'])[:40]}, not the step saved ({step}): a reader takes it for an "
                   f"edit and refuses the checkpoint")
        if why:
            raise CheckpointError(why)
        pieces = local_pieces(tensors, tensor_attrs)
        keys = keyring_.keyring(key)
        if rank == 0:  # nobody writes into tmp until rank 0 owns the directory and has cleared a stale one
            root.mkdir(parents=True, exist_ok=True)
            taken.append(lock.hold(root))
            shutil.rmtree(tmp, ignore_errors=True)
        return pieces, {n for n, t in tensors.items() if t.dim() == 0}, uuid.uuid4().hex if rank == 0 else None, keys

    taken: list[bool] = []
    try:
        (pieces, _, _, keys), parts = agree(comm, plan, f"saving {final}", share=lambda r: (r[0][0], r[1], r[2]))
    except CheckpointError:
        if any(taken):  # refused on another rank: the directory is not this save's
            lock.release(root)
        raise
    taken = any(taken)
    return plan_pending(rank, comm.Get_size(), comm, root, step, pieces, parts, extra=extra, layout=layout, keep=keep,
                        tensor_attrs=tensor_attrs, snapshot=snapshot, t0=t0, keys=keys, unlock=taken,
                        single_file=single_file)


def plan_pending(rank: int, world: int, comm, root: Path, step: int, pieces: tuple, parts: list, *, extra, layout,
                 keep, tensor_attrs, snapshot: bool, t0: float, keys: keyring_.Keyring | None = None,
                 unlock: bool = False, single_file: bool = False) -> Pending:
    """The rest of the plan once every rank's ``(chunks, scalar names)`` part is known -- no
    MPI: who writes what, the index attributes, this rank's pieces (``pieces``: its :func:`local_pieces`)."""
    metas, locals_, placements = pieces
    final = root / fmt.step_dir(step)
    tmp = root / (final.name + ".tmp")
    per_rank, all_scalars, ids = zip(*parts)
    owner = assign_owners(list(per_rank))
    mine = [c for c in metas if owner[c.key] == rank]
    tensor_attrs = {n: normalized(a) for n, a in (tensor_attrs or {}).items()}
    attrs = {"format_version": fmt.FORMAT_VERSION, "hpcml_version": __version__, "save_id": ids[0], "step": step,
             "world_size": world, "layout": layout or {}, "extra": extra or {}}
    # only what this rank writes (a device-to-host copy on GPUs; a view on CPU)
    arrays = {c.key: codec.to_numpy(locals_[c.key]) if snapshot else locals_[c.key].detach() for c in mine}
    return Pending(rank, comm, root, final, tmp, step, list(per_rank), owner, mine, arrays, placements,
                   set().union(*all_scalars), attrs, tensor_attrs, keep, t0, single_file, keys, unlock)


def write_local(p: Pending) -> tuple:
    """This rank's shard; the status that :func:`finish` gathers. Touches no MPI (runs in a writer process)."""
    rank = p.rank
    shard = p.tmp / fmt.shard_name(rank)
    try:
        p.tmp.mkdir(parents=True, exist_ok=True)
        if p.mine:
            info = _write_shard(shard, p.mine, p.arrays, p.shard_attrs, p.mac(shard.name))
            return ("ok", shard.stat().st_size, shard.name, info)
    except Exception as e:  # noqa: BLE001 -- reported on every rank by finish
        return ("error", failure(rank, e, shard), "", {})
    return ("ok", 0, "", {})


def finish(p: Pending, status: tuple, write_s: float = 0.0) -> SaveResult:
    """Gather shard statuses, rank 0 writes the index and commits, everyone learns the outcome.
    ``write_s``: how long this rank's own shard write took (logged apart from the wait)."""
    comm, rank = p.comm, p.rank
    # each rank reports the placement of the tensors it writes: rank 0 may hold none of a
    # tensor (a later pipeline stage's), and every written tensor has one owner; ranks finish
    # their shards at their own pace, and wait for the last without spinning
    gathered = waiting.gather(comm, (status, {n: p.placements[n] for n in {c.name for c in p.mine}}))
    outcome = index_and_commit(p, gathered) if rank == 0 else None
    if p.unlock:
        lock.release(p.root)
    outcome = waiting.bcast(comm, outcome)  # rank 0 writes the index and commits meanwhile
    if outcome is not None:
        raise CheckpointError(f"saving {p.final} failed: {outcome}")
    written = sum(c.nbytes for c in p.mine)
    dt = time.perf_counter() - p.t0
    logger.info("saved %s (%.1f MB from this rank, written in %.2f s; committed %.2f s after the save began)",
                p.final, written / 1e6, write_s, dt)
    return SaveResult(p.final, written, dt, write_s)


def index_and_commit(p: Pending, gathered: list[tuple[tuple, dict[str, str]]]) -> str | None:
    """Rank 0's part, from every rank's ``(status, placements)``: None once the index is
    written and the checkpoint committed, else why not."""
    statuses = [s for s, _ in gathered]
    errors = [s[1] for s in statuses if s[0] == "error"]
    if errors:  # nothing of this save stays to confuse the next start
        shutil.rmtree(p.tmp, ignore_errors=True)
        return errors[0] + (f" (and {len(errors) - 1} more ranks failed)" if len(errors) > 1 else "")
    placements: dict[str, str] = {}
    for _, held in gathered:
        for name, placement in held.items():
            placements.setdefault(name, placement)
    try:
        tables = {k: v for s in statuses if s[1] for k, v in s[3]["tables"].items()}
        files = {s[2]: {"bytes": s[1], "meta_sha256": s[3]["meta_sha256"]} for s in statuses if s[1]}
        attrs = {**p.attrs, "shards": fmt.dumps([{"file": f, "bytes": v["bytes"]} for f, v in files.items()]),
                 "created": time.time()}
        m = write_index(p.tmp / fmt.INDEX, p.per_rank, p.owner, tables, attrs, p.tensor_attrs, placements,
                        p.scalars, single_file=p.single_file)
        state = _signed_state(p.root, p.keys) if p.keys is not None else None
        if p.keys is not None:  # bound to this directory, so no other run's step passes for one of it
            m["root"] = rollback.root_id(state)
            m["data_mac"] = chunkmac.header(p.attrs["save_id"])
        finish_manifest(p.tmp, m, files, p.keys)
        commit(p.root, p.tmp, p.final, p.keep)
        if p.keys is not None:
            rollback.record(p.root, m, p.keys, state)
    except Exception as e:  # noqa: BLE001
        shutil.rmtree(p.tmp, ignore_errors=True)
        return failure(0, e)
    return None


def _signed_state(root: Path, keys: keyring_.Keyring) -> dict | None:
    try:
        return rollback.read(root, keys)
    except CheckpointError as e:  # not one this key signed (keys changed, or tampered): saves go on, anew
        logger.warning("%s: starting a new signed state (%s)", root, e)
        (root / rollback.STATE).unlink(missing_ok=True)
        return None
