"""Rank 0's part of a save: ``index.h5`` (virtual datasets presenting each global tensor
whole, for any HDF5 tool), ``manifest.json`` (what hpcml reads: every file's digest, bound to
this save) and the commit by rename. h5py and numpy only, no MPI: it works on what every
rank reported (chunks, chunk tables, placements), which is also how the tests drive it."""

from __future__ import annotations

import ctypes
import io
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from hpcml import safeio
from hpcml.ckpt import format as fmt, manifest
from hpcml.ckpt.checked import file_sha256
from hpcml.ckpt.chunks import ChunkMeta
from hpcml.ckpt.shard import fsync_path

SINGLE_FILE = "shared.h5"
"""The one file of a ``single_file`` save, written collectively through MPI-IO."""


def _by_name(per_rank: list[list[ChunkMeta]], single_file: bool) -> dict[str, list[ChunkMeta]]:
    """Each tensor's pieces, each once (the first rank that reported it)."""
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
    return by_name


def write_index(path: Path, per_rank: list[list[ChunkMeta]], owner: dict[tuple, int], tables: dict,
                attrs: dict, tensor_attrs: dict[str, dict], placements: dict[str, str], scalars: set[str],
                single_file: bool = False) -> dict:
    """Write ``index.h5`` and return the manifest (without the index's own digest).
    ``tables``: each piece's chunk table by its key (by tensor name when ``single_file``);
    ``placements``: each tensor's saved placement, from whichever rank holds it."""
    by_name = _by_name(per_rank, single_file)

    def source(c: ChunkMeta) -> tuple[str, str, dict]:
        if single_file:
            return SINGLE_FILE, c.name, tables[c.name]
        return fmt.shard_name(owner[c.key]), c.dataset, tables[c.key]
    tensors = {}
    # built in memory and written with a plain write: a disk that fills up is an OSError naming
    # the file, never HDF5 failing inside its close (which leaves a half-closed file that
    # crashes the process when freed, h5py#914)
    image = io.BytesIO()
    with h5py.File(image, "w", libver="latest") as f:
        for k, v in attrs.items():
            f.attrs[k] = v if not isinstance(v, dict) else fmt.dumps(v)
        for name in sorted(by_name):
            chunks = by_name[name]
            first = chunks[0]
            np_dtype = fmt.numpy_dtype(first.dtype)
            layout = h5py.VirtualLayout(shape=first.global_shape, dtype=np_dtype)
            pieces = []
            for c in chunks:
                file, dataset, table = source(c)
                layout[tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))] = \
                    h5py.VirtualSource(f"./{file}", dataset, shape=c.shape, dtype=np_dtype)
                pieces.append({"file": file, "dataset": dataset, "offset": list(c.offset), "shape": list(c.shape),
                               "chunk": table["chunk"], "at": table["at"], "crc": table["crc"]}
                              | ({"mac": table["mac"]} if "mac" in table else {}))
            ds = f.create_virtual_dataset(name, layout)
            ds.attrs["dtype"] = first.dtype
            ds.attrs["global_shape"] = np.asarray([] if name in scalars else first.global_shape, dtype=np.int64)
            ds.attrs["partition"] = placements.get(name, "")
            ds.attrs["chunks"] = fmt.dumps([{k: p[k] for k in ("offset", "shape", "file")}
                                            | {"storage_chunk": p["chunk"]} for p in pieces])
            for k, v in tensor_attrs.get(name, {}).items():
                ds.attrs[k] = v
            tensors[name] = {"dtype": first.dtype, "shape": list(first.global_shape), "scalar": name in scalars,
                             "partition": placements.get(name, ""), "pieces": pieces,
                             "attrs": manifest.jsonable(tensor_attrs.get(name, {}))}
    manifest.write_file(path, image.getvalue())
    return {"format": manifest.FORMAT, **{k: v for k, v in attrs.items() if k not in ("shards",)}, "tensors": tensors}


def finish_manifest(tmp: Path, m: dict, shard_files: dict[str, dict], keys=None) -> None:
    """Record every file's size and digest (``index.h5``'s read back from cache: it is small)
    and write ``manifest.json``, signed by ``keys`` when given: the last file of a save before its commit."""
    index = tmp / fmt.INDEX
    m["files"] = {**shard_files, fmt.INDEX: {"bytes": index.stat().st_size, "sha256": file_sha256(index)}}
    manifest.write(tmp / fmt.MANIFEST, m, keys)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE); False where
    the C library or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def point_latest(root: Path, name: str) -> None:
    """``latest`` names ``name`` (write + rename, fsynced)."""
    safeio.replace(root / fmt.LATEST, name + "\n", fsync=True)  # a link or FIFO put there is replaced, never followed
    fsync_path(root)


def _steps(root: Path, but: Path) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) step directories of ``root`` other than ``but``: an incomplete
    one (no manifest) is what a save killed while pruning leaves, never a commit."""
    complete, broken = fmt.step_dirs(root)
    return [p for p in complete if p != but], [p for p in broken if p != but]


def commit(root: Path, tmp: Path, final: Path, keep: int | fmt.Keep | None) -> None:
    """``tmp`` becomes ``final``, then ``latest`` names it (each step fsynced); ``keep``
    prunes to the newest K checkpoints (a :class:`~hpcml.ckpt.format.Keep`: and spares the
    step its group holds in common). No crash point leaves ``latest`` without a complete
    step to read: re-saving a step swaps the two directories atomically, or, where the file
    system cannot (Lustre, NFS), moves the old copy aside to ``step_N.old`` first, which
    :func:`~hpcml.ckpt.format.resolve` reads while ``step_N`` is missing."""
    fsync_path(tmp)
    if final.exists():
        if _exchange(tmp, final):  # tmp now holds the old copy
            fsync_path(root)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = root / (final.name + fmt.OLD_SUFFIX)
            shutil.rmtree(old, ignore_errors=True)  # latest names final, which is complete
            final.rename(old)
            fsync_path(root)  # the old copy is findable as step_N.old before step_N changes
            tmp.rename(final)
    else:
        tmp.rename(final)
    fsync_path(root)
    point_latest(root, final.name)
    for suffix in (fmt.OLD_SUFFIX, ".tmp"):  # latest names a complete step now; one job owns the directory
        for old in root.glob(f"step_*{suffix}"):  # (hpcml.ckpt.lock), so no other save is in flight
            if fmt.STEP_RE.match(old.name[:-len(suffix)]) and not old.is_symlink() and old != tmp:
                shutil.rmtree(old, ignore_errors=True)
    if keep:
        last, spared = (keep, None) if isinstance(keep, int) else (keep.last, keep.spared())
        steps, broken = _steps(root, final)
        for old in steps[: max(0, len(steps) - (last - 1))] + broken:
            if spared is None or old.name != fmt.step_dir(spared):
                shutil.rmtree(old, ignore_errors=True)
