"""One shard file, both ways: numpy and h5py only (no torch, no MPI), so the async writer
process starts light and shares this code with the synchronous save and the reader.

A shard is an ordinary HDF5 file (any HDF5 tool reads it, and ``index.h5`` maps it), but
hpcml itself never lets HDF5 parse one on load. HDF5 lays out the file -- metadata and
chunked datasets with their space allocated up front -- and closes it; then hpcml writes
every data chunk itself at the byte offset HDF5 allocated, with a CRC-32 of each chunk taken
while its bytes are in cache, and a SHA-256 of everything else in the file (the metadata).
The manifest records both. The reader reads the chunks it needs straight from those offsets
and checks each CRC as it reads: no second pass over the bytes on either side, no fill values
for a source HDF5 could not open, and a disk that fills up gives Python's ``OSError`` (no
space left) from a plain write instead of a crash inside HDF5.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from hpcml import safeio
from hpcml.ckpt.chunkmac import ChunkMac
from hpcml.ckpt.sink import BufferedSink, DirectSink
from hpcml.errors import CheckpointError

try:  # ISA-L's CRC-32: the same values as zlib's, ~3x faster (the CRC was a quarter of a save's CPU)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover -- isal is a dependency; zlib is the fallback
    from zlib import crc32

COALESCE = 8 << 20
"""Adjacent chunks are written and read in runs of up to this many bytes (one syscall each)."""


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


def grid(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[int, ...]:
    """Chunks along each dimension."""
    return tuple(-(-s // c) for s, c in zip(shape, chunk))


def tile(index: int, shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[slice, ...]:
    """The region of chunk ``index`` (row-major over the chunk grid) inside its dataset."""
    coords = np.unravel_index(index, grid(shape, chunk))
    return tuple(slice(int(k) * c, min(s, (int(k) + 1) * c)) for k, c, s in zip(coords, chunk, shape))


def preallocated(chunk: tuple[int, ...] | None):
    """Dataset creation properties: ``chunk`` (None: contiguous), space allocated at creation,
    never filled -- every byte is written by the save, and filling chunked datasets is one
    collective write each under MPI-IO (seconds per save on an oversubscribed node)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    if chunk:
        dcpl.set_chunk(chunk)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def _skeleton(path: Path, items: list[tuple[str, tuple[int, ...], np.ndarray]], attrs: dict) -> list[dict]:
    """HDF5 writes the file's structure, every chunk's space allocated and nothing written
    into it; returns each dataset's chunk shape and chunk byte offsets (grid order)."""
    tables = []
    with h5py.File(path, "w", libver="latest") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        for dataset, offset, arr in items:
            chunk = storage_chunk(arr.shape, arr.itemsize) or (1,)
            shape = arr.shape or (1,)
            ds = f.create_dataset(dataset, shape=shape, dtype=arr.dtype, dcpl=preallocated(chunk))
            ds.attrs["offset"] = np.asarray(offset, dtype=np.int64)
            tables.append({"chunk": list(chunk), "at": _chunk_offsets(ds)})
    return tables


def _chunk_offsets(ds: h5py.Dataset) -> list[int]:
    """Byte offset of each chunk of ``ds`` in its file, in row-major order of the chunk grid."""
    chunk, g = ds.chunks, grid(ds.shape, ds.chunks)
    at = [0] * ds.id.get_num_chunks()
    if len(at) != math.prod(g):
        raise CheckpointError(f"{ds.name}: {len(at)} chunks allocated, expected {math.prod(g)}")
    for i in range(len(at)):
        info = ds.id.get_chunk_info(i)
        at[int(np.ravel_multi_index(tuple(o // c for o, c in zip(info.chunk_offset, chunk)), g))] = \
            int(info.byte_offset)
    return at


def write_shard(path: Path, items: Iterable[tuple[str, tuple[int, ...], np.ndarray]], *,
                attrs: dict | None = None, mac: ChunkMac | None = None) -> dict:
    """Write ``(dataset, offset, array)`` items into a new shard and fsync it.

    Returns what the manifest records of it: ``{"bytes", "meta_sha256", "datasets": [{"chunk":
    chunk shape, "at": byte offsets, "crc": CRC-32 per chunk}]}`` in item order, and with
    ``mac`` (a signed save) each chunk's keyed tag too (``"mac"``, :mod:`hpcml.ckpt.chunkmac`).
    Raises ``OSError`` (ENOSPC included) from plain writes: the space is reserved before any data goes in.
    """
    items = [(d, o, np.ascontiguousarray(a)) for d, o, a in items]
    need = sum(a.nbytes for _, _, a in items)
    free = _free_bytes(path.parent)
    if free is not None and free < need:
        raise OSError(28, f"no space left on device: {path.name} needs {need} bytes, {free} free", str(path.parent))
    tables = _skeleton(path, items, attrs or {})
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, cleanly, before any data
        data_ranges = []
        with DirectSink.open(path, fd, COALESCE) as sink:
            for (_, _, arr), table in zip(items, tables):
                nb = math.prod(table["chunk"]) * arr.itemsize
                table["crc"], tags = _write_chunks(sink, arr.reshape(arr.shape or (1,)), tuple(table["chunk"]),
                                                   table["at"], mac)
                if mac is not None:
                    table["mac"] = tags
                data_ranges += [(a, nb) for a in table["at"]]
        meta = metadata_sha256(fd, size, data_ranges)
        os.fsync(fd)  # what is still in the page cache (HDF5's metadata, runs' end pages, the writeback's tail)
    finally:
        os.close(fd)
    return {"bytes": size, "meta_sha256": meta, "datasets": tables}


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _write_chunks(sink: BufferedSink, arr: np.ndarray, chunk: tuple[int, ...], at: list[int],
                  mac: ChunkMac | None = None) -> tuple[list[int], str]:
    """Each run of chunks adjacent in the file goes to ``sink`` in one piece: straight from the
    array when its chunks are whole rows (they are then its bytes, in order) and the sink
    takes the caller's memory, else through the sink's staging buffer the chunks are copied
    into (edge chunks zero-padded to the full chunk, as HDF5 stores them). Each chunk's CRC-32
    is taken while its bytes are in cache, and with ``mac`` its keyed tag (hex, in chunk order)."""
    nb = math.prod(chunk) * arr.itemsize
    crcs = [0] * len(at)
    tags = [b""] * len(at) if mac is not None else []
    flat = arr.reshape(-1).view(np.uint8)
    whole_rows = chunk[1:] == arr.shape[1:]
    for run in _runs(at, list(range(len(at))), nb):
        own = whole_rows and (run[-1] + 1) * nb <= flat.nbytes and run[-1] - run[0] == len(run) - 1
        if own and sink.zero_copy:  # its own bytes
            data = flat[run[0] * nb:(run[-1] + 1) * nb]
        else:
            data = sink.staging(at[run[0]], nb * len(run))
            if own:
                np.copyto(data, flat[run[0] * nb:(run[-1] + 1) * nb])
            else:
                for j, i in enumerate(run):
                    region = tile(i, arr.shape, chunk)
                    box = data[j * nb:(j + 1) * nb].view(arr.dtype).reshape(chunk)
                    inner = tuple(slice(0, r.stop - r.start) for r in region)
                    if any(r.stop - r.start != c for r, c in zip(region, chunk)):
                        box[...] = 0
                    box[inner] = arr[region]
        view = memoryview(data)
        for j, i in enumerate(run):
            crcs[i] = crc32(view[j * nb:(j + 1) * nb])
            if mac is not None:
                tags[i] = mac.tag(at[i], view[j * nb:(j + 1) * nb])
        sink.put(at[run[0]], data)
    return crcs, b"".join(tags).hex()


def gaps(size: int, data_ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, length) of the bytes of a file of ``size`` that no data chunk covers: its metadata."""
    out, pos = [], 0
    for start, n in sorted(data_ranges):
        if start > pos:
            out.append((pos, start - pos))
        pos = max(pos, start + n)
    if pos < size:
        out.append((pos, size - pos))
    return out


def metadata_sha256(fd: int, size: int, data_ranges: list[tuple[int, int]]) -> str:
    """SHA-256 of the file's metadata bytes (everything but the data chunks), in file order."""
    h = hashlib.sha256()
    for start, n in gaps(size, data_ranges):
        h.update(pread_exact(fd, n, start))
    return h.hexdigest()


def pread_exact(fd: int, n: int, at: int) -> bytes:
    data = os.pread(fd, n, at)
    if len(data) != n:
        raise CheckpointError(f"short read: {len(data)} of {n} bytes at offset {at}: the file is truncated")
    return data


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file and not a symlink:
    a checkpoint's files never lead out of its directory. Opened non-blocking, so a FIFO,
    socket or device planted under a checkpoint's name is refused at once instead of
    blocking ``open()`` until a writer appears (signals then could not stop the process)."""
    try:
        return safeio.open_fd(path)
    except (OSError, ValueError) as e:  # FileRefused is a ValueError
        what = e if isinstance(e, ValueError) else f"cannot open {path}: {(e.strerror or str(e)).lower()}"
        raise CheckpointError(f"{what} (a checkpoint's files are regular files in its directory)") from None


def _runs(at: list[int], wanted: list[int], nb: int) -> list[list[int]]:
    """The wanted chunk indices grouped into runs adjacent in the file (one pread each)."""
    runs: list[list[int]] = []
    for i in sorted(wanted, key=lambda k: at[k]):
        if runs and at[i] == at[runs[-1][-1]] + nb and (len(runs[-1]) + 1) * nb <= COALESCE:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def read_chunks(fd: int, table: dict, itemsize: int, wanted: list[int], where: str, mac: ChunkMac | None = None):
    """Yield ``(chunk index, bytes)`` of the wanted chunks, each checked against its CRC-32 --
    or with ``mac`` (a keyed reader), its keyed tag -- as it is read. Runs of adjacent chunks
    are read in one pread into two reused buffers and checked by a thread (pread and crc32
    release the GIL) while the caller copies the run before. A yielded view is valid until the
    next one. ``where`` names the dataset for errors."""
    nb = math.prod(table["chunk"]) * itemsize
    at, crc = table["at"], table["crc"]
    runs = _runs(at, wanted, nb)
    if not runs:
        return
    size = max(len(r) for r in runs) * nb
    buffers = [np.empty(size, np.uint8), np.empty(size, np.uint8) if len(runs) > 1 else None]

    def fill(k: int) -> memoryview:
        view = memoryview(buffers[k % 2])[:len(runs[k]) * nb]
        n = os.preadv(fd, [view], at[runs[k][0]])
        if n != len(view):
            raise CheckpointError(f"{where}: short read of {n} of {len(view)} bytes at offset {at[runs[k][0]]}: "
                                  "the file is truncated")
        for j, i in enumerate(runs[k]):
            if mac is not None:
                mac.check(at[i], view[j * nb:(j + 1) * nb], table["mac"], i, where)
            elif crc32(view[j * nb:(j + 1) * nb]) != crc[i]:
                raise CheckpointError(f"{where}: chunk {i} at byte {at[i]} fails its CRC-32: corrupted or replaced")
        return view

    if len(runs) == 1:  # one run: no thread
        data = fill(0)
        for j, i in enumerate(runs[0]):
            yield i, data[j * nb:(j + 1) * nb]
        return

    # No posix_fadvise(WILLNEED) ahead: the runs are read in file order, so the kernel's own
    # readahead already streams them, and the advice walked the page cache synchronously --
    # it cost a third of a cold load (benchmarks.md, issue 11).
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(fill, 0)
        for k, run in enumerate(runs):
            data = ahead.result()
            if k + 1 < len(runs):
                ahead = pool.submit(fill, k + 1)
            for j, i in enumerate(run):
                yield i, data[j * nb:(j + 1) * nb]


def read_region(fd: int, shape: tuple[int, ...], table: dict, dtype: np.dtype, region: tuple[slice, ...],
                where: str, out: np.ndarray | None = None, mac: ChunkMac | None = None) -> tuple[np.ndarray, int]:
    """The ``region`` of a dataset of ``shape`` stored in chunks (``table``), checked chunk by
    chunk (:func:`read_chunks`), copied into ``out`` (an array of the region's shape; default:
    a new one); returns it and the bytes read (whole chunks)."""
    chunk = tuple(table["chunk"])
    g = grid(shape, chunk)
    ranges = [range(r.start // c, (r.stop - 1) // c + 1) for r, c in zip(region, chunk)]
    wanted = [int(np.ravel_multi_index(k, g)) for k in np.ndindex(*(len(r) for r in ranges))
              for k in [tuple(r[j] for r, j in zip(ranges, k))]]
    if out is None:
        out = np.empty(tuple(r.stop - r.start for r in region), dtype=dtype)
    nread = 0
    for i, data in read_chunks(fd, table, dtype.itemsize, wanted, where, mac):
        box = np.frombuffer(data, dtype=dtype).reshape(chunk)
        t = tile(i, shape, chunk)
        lo = [max(a.start, b.start) for a, b in zip(t, region)]
        hi = [min(a.stop, b.stop) for a, b in zip(t, region)]
        out[tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))] = \
            box[tuple(slice(a - s.start, b - s.start) for a, b, s in zip(lo, hi, t))]
        nread += len(data)
    return out, nread


def describe(path: Path, datasets: list[str], mac: ChunkMac | None = None) -> dict:
    """What :func:`write_shard` returns, for a file that HDF5 wrote itself (the collective
    single-file save): chunk tables from HDF5, then one read of every chunk for its CRC-32
    (and with ``mac``, its keyed tag)."""
    tables = []
    with h5py.File(path, "r") as f:
        for name in datasets:
            ds = f[name]
            tables.append({"chunk": list(ds.chunks), "at": _chunk_offsets(ds), "itemsize": ds.dtype.itemsize})
    fd = open_regular(path)
    try:
        size, ranges = os.fstat(fd).st_size, []
        for table in tables:
            nb = math.prod(table["chunk"]) * table.pop("itemsize")
            table["crc"], tags = [], []
            for a in table["at"]:  # a chunk at a time: memory stays one chunk whatever the file holds
                data = pread_exact(fd, nb, a)
                table["crc"].append(crc32(data))
                if mac is not None:
                    tags.append(mac.tag(a, data))
            if mac is not None:
                table["mac"] = b"".join(tags).hex()
            ranges += [(a, nb) for a in table["at"]]
        return {"bytes": size, "meta_sha256": metadata_sha256(fd, size, ranges), "datasets": tables}
    finally:
        os.close(fd)
