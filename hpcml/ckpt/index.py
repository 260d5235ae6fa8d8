"""Rank 0's part of a save: ``index.h5``, whose virtual datasets present each global tensor
whole, and the commit by rename. h5py and numpy only, no MPI: it works on what every rank
reported (chunks, storage, placements), which is also how the tests drive it."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np

from hpcml.ckpt import format as fmt
from hpcml.ckpt.plan import ChunkMeta
from hpcml.ckpt.shard import fsync_path

SINGLE_FILE = "shared.h5"
"""The one file of a ``single_file`` save, written collectively through MPI-IO."""


def write_index(path: Path, per_rank: list[list[ChunkMeta]], owner: dict[tuple, int], storage: dict[tuple, tuple],
                attrs: dict, tensor_attrs: dict[str, dict], placements: dict[str, str], scalars: set[str],
                single_file: bool = False) -> None:
    """Every tensor of every rank as a virtual dataset over the owners' shards.
    ``placements``: each tensor's saved placement, from whichever rank holds it."""
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
            np_dtype = fmt.numpy_dtype(first.dtype)
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


def commit(root: Path, tmp: Path, final: Path, keep: int | None) -> None:
    """``tmp`` becomes ``final``, then ``latest`` names it (each step fsynced); ``keep``
    prunes to the newest K checkpoints."""
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
