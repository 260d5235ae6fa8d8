"""An open checkpoint whose every read is checked: the manifest first, then each file as it
is opened (a regular file of the step directory, its recorded size, its metadata digest),
then each data chunk against its CRC-32 -- under a key, its keyed digest
(:mod:`hpcml.ckpt.chunkmac`) -- as it is read. HDF5 never parses a checkpoint byte
on this path, so a source HDF5 could not open can never come back as fill values.
numpy only: ``hpcml ckpt ls/inspect/verify`` start without torch.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hpcml import stop
from hpcml.ckpt import chunkmac, format as fmt, keys as keyring_, manifest, rollback
from hpcml.ckpt.shard import COALESCE, crc32, metadata_sha256, open_regular, pread_exact, read_region
from hpcml.errors import CheckpointError


class Checkpoint:
    """``Checkpoint(path)``: ``path`` is a step directory or a root with ``latest``. Use as a
    context manager (it holds the shard descriptors it opened). ``key``: the keys a signature
    must match (:func:`hpcml.ckpt.keys.keyring`: by default ``$HPCML_CKPT_KEY`` or
    ``$HPCML_CKPT_KEY_FILE``; ``False``: none) -- with one, an unsigned checkpoint is refused."""

    def __init__(self, path: str | os.PathLike, key=None) -> None:
        self.path = fmt.resolve(path)
        self.keys = keyring_.keyring(key)
        self.manifest = manifest.read(self.path, self.keys)
        m = self.manifest
        if self.keys is not None:  # signed, and of this directory, and not rolled back behind `latest`
            rollback.check(self.path.parent, self.path, m, self.keys, via_latest=self.path != Path(path))
        self._mac_key = chunkmac.reader_key(m, self.keys, str(self.path))
        self._macs: dict[str, chunkmac.ChunkMac] = {}
        self.signed_by: str | None = manifest.signed_by(m)
        self.step: int = m["step"]
        self.extra: dict = m["extra"]
        self.layout: dict = m["layout"]
        self.tensors: dict[str, dict] = m["tensors"]
        self._fds: dict[str, int] = {}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.tensors if n.startswith(prefix))

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(fmt.numpy_dtype(self.tensors[name]["dtype"]))

    def _data_ranges(self, file: str) -> list[tuple[int, int]]:
        out = []
        for name, t in self.tensors.items():
            nb = self.dtype(name).itemsize
            for p in t["pieces"]:
                if p["file"] == file:
                    out += [(a, math.prod(p["chunk"]) * nb) for a in p["at"]]
        return out

    def mac(self, file: str) -> chunkmac.ChunkMac | None:
        """What ``file``'s chunks are checked with under a key (else None: their CRC-32s)."""
        if self._mac_key is None:
            return None
        if file not in self._macs:
            self._macs[file] = chunkmac.for_file(*self._mac_key, file)
        return self._macs[file]

    def _open(self, file: str, check_meta: bool = True) -> int:
        """A shard's descriptor, once its size and (``check_meta``) metadata digest match."""
        if file in self._fds:
            return self._fds[file]
        path, info = self.path / file, self.manifest["files"][file]
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{path} is {size} bytes, expected {info['bytes']}: truncated or replaced")
            if check_meta and metadata_sha256(fd, size, self._data_ranges(file)) != info["meta_sha256"]:
                raise CheckpointError(f"{path}: HDF5 metadata differs from what was saved (SHA-256): "
                                      "edited, corrupted or from another save")
        except BaseException:
            os.close(fd)
            raise
        self._fds[file] = fd
        return fd

    def check_index(self) -> None:
        """``index.h5`` (what other tools read) against its SHA-256: small, read once."""
        info = self.manifest["files"][fmt.INDEX]
        fd = open_regular(self.path / fmt.INDEX)
        try:
            size = os.fstat(fd).st_size
            if size != info["bytes"] or _sha256(fd, size) != info["sha256"]:
                raise CheckpointError(f"{self.path / fmt.INDEX} differs from what was saved (size or SHA-256): "
                                      "edited, corrupted or stale")
        finally:
            os.close(fd)

    def read(self, name: str, region: tuple[slice, ...] | None = None,
             out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """``region`` (default: all) of tensor ``name`` as stored (bfloat16 as uint16), and the
        bytes read to get it (whole chunks, each checked). ``out``: where to put it (e.g. a
        view of the destination tensor, which saves a copy)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        t = self.tensors[name]
        shape = tuple(t["shape"])
        region = region if region is not None else tuple(slice(0, s) for s in shape)
        if out is None:
            out = np.empty(tuple(r.stop - r.start for r in region), dtype=self.dtype(name))
        pieces = t["pieces"]
        off = np.asarray([p["offset"] for p in pieces], np.int64).reshape(len(pieces), len(shape))
        end = off + np.asarray([p["shape"] for p in pieces], np.int64).reshape(len(pieces), len(shape))
        rlo = np.asarray([r.start for r in region], np.int64)
        rhi = np.asarray([r.stop for r in region], np.int64)
        touched = np.flatnonzero(np.all((np.maximum(off, rlo) < np.minimum(end, rhi)), axis=1))
        inside = np.all((off >= rlo) & (end <= rhi), axis=1)
        whole = [k for k in touched.tolist() if inside[k] and pieces[k]["chunk"] == pieces[k]["shape"]]
        nread = self._read_whole([pieces[k] for k in whole], region, out) if whole else 0
        for k in sorted(set(touched.tolist()) - set(whole)):
            p = pieces[k]
            _interrupted(self.path)
            lo = [max(r.start, o) for r, o in zip(region, p["offset"])]
            hi = [min(r.stop, o + s) for r, o, s in zip(region, p["offset"], p["shape"])]
            fd = self._open(p["file"])
            _, n = read_region(fd, tuple(p["shape"]), p, out.dtype,
                               tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p["offset"])),
                               f"{self.path / p['file']} {p['dataset']}",
                               out=out[tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))],
                               mac=self.mac(p["file"]))
            nread += n
        return out, nread

    def _read_whole(self, pieces: list[dict], region: tuple[slice, ...], out: np.ndarray) -> int:
        """Pieces inside ``region`` stored as one chunk each (small tensors, many ranks' small
        shards): read in runs of chunks adjacent in their file, one pread per run, each chunk
        checked (CRC-32 or keyed digest), with no per-dimension chunk-grid work."""
        item = out.dtype.itemsize
        sizes = [math.prod(p["chunk"]) * item for p in pieces]
        order = sorted(range(len(pieces)), key=lambda k: (pieces[k]["file"], pieces[k]["at"][0]))
        runs: list[list[int]] = []
        for k in order:
            if runs:
                last, first = pieces[runs[-1][-1]], pieces[runs[-1][0]]
                if last["file"] == pieces[k]["file"] and last["at"][0] + sizes[runs[-1][-1]] == pieces[k]["at"][0] \
                        and pieces[k]["at"][0] + sizes[k] - first["at"][0] <= COALESCE:
                    runs[-1].append(k)
                    continue
            runs.append([k])
        nread = 0
        for run in runs:
            _interrupted(self.path)
            first = pieces[run[0]]
            size = pieces[run[-1]]["at"][0] + sizes[run[-1]] - first["at"][0]
            data = memoryview(pread_exact(self._open(first["file"]), size, first["at"][0]))
            mac = self.mac(first["file"])
            for k in run:
                p, pos = pieces[k], pieces[k]["at"][0] - first["at"][0]
                chunk = data[pos:pos + sizes[k]]
                if mac is not None:
                    mac.check(p["at"][0], chunk, p["mac"], 0, f"{self.path / p['file']} {p['dataset']}")
                elif crc32(chunk) != p["crc"][0]:
                    raise CheckpointError(f"{self.path / p['file']} {p['dataset']}: chunk 0 at byte {p['at'][0]} fails "
                                          f"its CRC-32: corrupted or replaced")
                out[tuple(slice(o - r.start, o + n - r.start) for o, n, r in zip(p["offset"], p["shape"], region))] = \
                    np.frombuffer(chunk, dtype=out.dtype).reshape(p["shape"])
            nread += size
        return nread

    def verify(self) -> list[str]:
        """Every byte of every file checked, streamed (bounded memory): problems, or []."""
        problems = []
        for file, info in sorted(self.manifest["files"].items()):
            _interrupted(self.path)
            path = self.path / file
            if file == fmt.INDEX:
                try:
                    self.check_index()
                except CheckpointError as e:
                    problems.append(str(e))
                continue
            try:
                fd = open_regular(path)
            except CheckpointError as e:
                problems.append(str(e) if path.exists() or path.is_symlink() else f"{path}: missing")
                continue
            try:
                size = os.fstat(fd).st_size
                if size != info["bytes"]:
                    problems.append(f"{path}: {size} bytes, expected {info['bytes']}")
                else:
                    tables = [(f"{n} piece {k}", p, self.dtype(n).itemsize) for n, t in self.tensors.items()
                              for k, p in enumerate(t["pieces"]) if p["file"] == file]
                    problems += [f"{path}: {p}" for p in check_file(fd, size, info["meta_sha256"], tables,
                                                                      self.mac(file))]
            finally:
                os.close(fd)
        return problems


def check_file(fd: int, size: int, meta_sha256: str, tables: list[tuple[str, dict, int]],
               mac: chunkmac.ChunkMac | None = None) -> list[str]:
    """Every byte of a shard checked, streamed in file order (bounded memory, one pass however
    many datasets the file holds): each data chunk against its CRC-32 (with ``mac``: its keyed
    tag), the rest against the metadata digest. ``tables``: (dataset name, chunk table, itemsize) of each dataset in
    the file. Problems found (the first bad chunk of each dataset), or []."""
    chunks = sorted((a, math.prod(table["chunk"]) * itemsize, c, k, i) for k, (_, table, itemsize) in enumerate(tables)
                    for i, (a, c) in enumerate(zip(table["at"], table["crc"])))
    runs: list[list[tuple]] = []
    for ch in chunks:  # adjacent chunks in one pread, up to COALESCE bytes
        if runs and ch[0] == runs[-1][-1][0] + runs[-1][-1][1] and ch[0] + ch[1] - runs[-1][0][0] <= COALESCE:
            runs[-1].append(ch)
        else:
            runs.append([ch])
    bad: dict[int, str] = {}
    buffers = [np.empty(max((r[-1][0] + r[-1][1] - r[0][0] for r in runs), default=0), np.uint8) for _ in range(2)]

    def fill(k: int) -> memoryview:
        run = runs[k]
        view = memoryview(buffers[k % 2])[:run[-1][0] + run[-1][1] - run[0][0]]
        n = os.preadv(fd, [view], run[0][0])
        if n != len(view):
            raise CheckpointError(f"short read of {n} of {len(view)} bytes at offset {run[0][0]}: "
                                  "the file is truncated")
        return view

    with ThreadPoolExecutor(1) as pool:  # the next run is read while this one's CRCs are taken
        ahead = pool.submit(fill, 0) if runs else None
        for k, run in enumerate(runs):
            try:
                view = ahead.result()
            except CheckpointError as e:
                for ch in run:
                    bad.setdefault(ch[3], f"{tables[ch[3]][0]}: {e}")
                view = None
            ahead = pool.submit(fill, k + 1) if k + 1 < len(runs) else None
            if view is None:
                continue
            base = run[0][0]
            for at, nb, crc, t, i in run:
                if t in bad:
                    continue
                data = view[at - base:at - base + nb]
                if mac is not None:
                    try:
                        mac.check(at, data, tables[t][1]["mac"], i, tables[t][0])
                    except CheckpointError as e:
                        bad[t] = str(e)
                elif crc32(data) != crc:
                    bad[t] = f"{tables[t][0]}: chunk {i} at byte {at} fails its CRC-32: corrupted or replaced"
    problems = [bad[t] for t in sorted(bad)]
    try:
        if metadata_sha256(fd, size, [(a, nb) for a, nb, *_ in chunks]) != meta_sha256:
            problems.append("HDF5 metadata differs from what was saved (SHA-256): "
                            "edited, corrupted or from another save")
    except CheckpointError as e:
        problems.append(str(e))
    return problems


def _interrupted(path: Path) -> None:
    """A kill (SIGTERM or SIGINT caught by :mod:`hpcml.stop`) ends a long read between pieces
    within seconds; the walltime warning does not (a save and its read-back go on then)."""
    why = stop.requested()
    if why in ("SIGTERM", "SIGINT"):
        raise CheckpointError(f"reading {path} stopped: {why} arrived (nothing was changed)")


def _sha256(fd: int, size: int) -> str:
    h = hashlib.sha256()
    for at in range(0, size, COALESCE):
        h.update(pread_exact(fd, min(COALESCE, size - at), at))
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    fd = open_regular(path)
    try:
        return _sha256(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
