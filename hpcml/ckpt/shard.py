"""Writing one rank's shard file: numpy and h5py only (no torch, no MPI), so the async
writer process starts light and shares this code with the synchronous save."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np


def fsync_path(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_chunk(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """HDF5 chunk shape: halve the longest dimension until a chunk holds at most
    max(1 KiB, min(1 MiB, size / 64)). Small square-ish chunks let a rank of another
    layout read a row or column block of a tensor touching little beyond it."""
    if not shape:
        return None
    nbytes = itemsize * math.prod(shape)
    target = max(1024, min(1 << 20, nbytes // 64))
    chunk = list(shape)
    while itemsize * math.prod(chunk) > target and max(chunk) > 1:
        i = max(range(len(chunk)), key=lambda k: chunk[k])
        chunk[i] = (chunk[i] + 1) // 2
    return tuple(chunk)


def write_shard(path: Path, items: Iterable[tuple[str, tuple[int, ...], np.ndarray]]) -> list[tuple | None]:
    """Write ``(dataset, offset, array)`` items into a new shard, fsync it; returns each
    dataset's HDF5 chunk shape (for read accounting), in order."""
    chunks = []
    with h5py.File(path, "w", libver="latest") as f:
        for dataset, offset, arr in items:
            ds = f.create_dataset(dataset, data=arr, chunks=storage_chunk(arr.shape, arr.itemsize),
                                  fletcher32=True)  # checksummed per HDF5 chunk, verified on every read
            ds.attrs["offset"] = np.asarray(offset, dtype=np.int64)
            chunks.append(ds.chunks)
    fsync_path(path)
    return chunks
