"""``manifest.json``: what a save wrote, bound to that save, and the only thing hpcml parses
before it has checked a byte of a checkpoint.

A checkpoint is untrusted input. The manifest is read with a size bound and checked field by
field against the only layout the writer makes: plain file names of the step directory,
pieces that tile each tensor exactly once, data chunks inside their files and disjoint, so
that nothing declared can exceed the bytes really on disk. Each file's digest (metadata
SHA-256 plus a CRC-32 per data chunk for shards, a SHA-256 for ``index.h5``) and the save's
id and step bind every file to this save: a stale, swapped or edited file is refused before
HDF5 (or numpy) sees its bytes. numpy only, no torch, no h5py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from hpcml.ckpt import format as fmt
from hpcml.ckpt.shard import grid, open_regular, pread_exact
from hpcml.errors import CheckpointError

MANIFEST = fmt.MANIFEST
FORMAT = "hpcml-checkpoint"
MAX_MANIFEST_BYTES = 256 << 20
"""A manifest larger than this is refused before parsing (a 1 TB checkpoint's is ~10 MB)."""
MAX_PIECES = 1 << 16
"""Pieces of one tensor (one per saving rank that held part of it, times fused sub-parameters)."""
FILE_RE = re.compile(r"^(rank_\d{5}\.h5|shared\.h5)$")
HEX_RE = re.compile(r"^[0-9a-f]{64}$")
SAVE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def jsonable(value):
    """Tensor attributes as JSON values (numpy arrays and scalars become lists and numbers)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def _canonical(m: dict) -> bytes:
    return json.dumps(m, sort_keys=True, separators=(",", ":")).encode()


def write(path: Path, manifest: dict) -> None:
    """Write with its own SHA-256 (of its canonical JSON without that field, so an edited
    digit is caught) and fsync: the commit renames the directory only after this."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    data = _canonical({**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read(ckpt: Path) -> dict:
    """The checked manifest of checkpoint directory ``ckpt``; raises CheckpointError (one
    line) on anything the writer would not have written."""
    path = ckpt / MANIFEST
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")
        raw = pread_exact(fd, size, 0)
    finally:
        os.close(fd)
    try:
        m = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {str(e)[:120]}") from None
    digest = m.pop("manifest_sha256", None) if isinstance(m, dict) else None
    if not isinstance(digest, str) or hashlib.sha256(_canonical(m)).hexdigest() != digest:
        raise CheckpointError(f"{path} differs from what was saved (its SHA-256): edited or corrupted")
    try:
        check(m, ckpt)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return m


def _no_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _int(v, what: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise CheckpointError(f"{what} is {str(v)[:60]!r}: expected an integer >= {lo}" + (f" and <= {hi}" if hi else ""))
    return v


def _ints(v, what: str, n: int | None = None, lo: int = 0) -> list[int]:
    if not isinstance(v, list) or (n is not None and len(v) != n) or len(v) > 32:
        raise CheckpointError(f"{what} is {str(v)[:60]!r}: expected a list of {n if n is not None else 'up to 32'} integers")
    return [_int(x, what, lo) for x in v]


def _str(v, what: str, pattern: re.Pattern | None = None) -> str:
    if not isinstance(v, str) or (pattern is not None and not pattern.match(v)):
        raise CheckpointError(f"{what} is {str(v)[:60]!r}: expected {pattern.pattern if pattern else 'a string'}")
    return v


def check(m, ckpt: Path) -> None:
    """Every field, against the writer's layout (see the module docstring)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"not an hpcml checkpoint manifest (format {str(m.get('format') if isinstance(m, dict) else m)[:40]!r})")
    version = _str(m.get("format_version"), "format_version")
    if version.split(".")[0] != fmt.FORMAT_VERSION.split(".")[0]:
        raise CheckpointError(f"format version {version!r}: this hpcml reads {fmt.FORMAT_VERSION.split('.')[0]}.x")
    _str(m.get("save_id"), "save_id", SAVE_ID_RE)
    step = _int(m.get("step"), "step")
    if (s := fmt.STEP_RE.match(ckpt.name)) and int(s[1]) != step:
        raise CheckpointError(f"step {step} saved in a directory named {ckpt.name}: a checkpoint from another step")
    _int(m.get("world_size"), "world_size", 1)
    for key in ("layout", "extra", "files", "tensors"):
        if not isinstance(m.get(key), dict):
            raise CheckpointError(f"{key} is not a JSON object")
    files = m["files"]
    if fmt.INDEX not in files:
        raise CheckpointError(f"files does not list {fmt.INDEX}")
    for name, info in files.items():
        if name == fmt.INDEX:
            _str(info.get("sha256") if isinstance(info, dict) else None, f"{name} sha256", HEX_RE)
        else:
            _str(name, "file name", FILE_RE)
            _str(info.get("meta_sha256") if isinstance(info, dict) else None, f"{name} meta_sha256", HEX_RE)
        _int(info.get("bytes"), f"{name} bytes")
    used: dict[str, list[tuple[int, int]]] = {}
    for name, t in m["tensors"].items():
        _check_tensor(name, t, files, used)
    for name, ranges in used.items():  # chunks disjoint within their file: nothing declared exceeds the disk
        ranges.sort()
        for (a, n), (b, _) in zip(ranges, ranges[1:]):
            if a + n > b:
                raise CheckpointError(f"{name}: data chunks at bytes {a} and {b} overlap")


def _check_tensor(name: str, t, files: dict, used: dict) -> None:
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")) or len(name) > 1024:
        raise CheckpointError(f"tensor name {name[:80]!r} is not a plain HDF5 path")
    if not isinstance(t, dict):
        raise CheckpointError(f"tensor {name} is not a JSON object")
    dtype = _str(t.get("dtype"), f"{name} dtype")
    itemsize = np.dtype(fmt.numpy_dtype(dtype)).itemsize
    shape = _ints(t.get("shape"), f"{name} shape")
    if not isinstance(t.get("scalar"), bool) or (t["scalar"] and shape != [1]):
        raise CheckpointError(f"{name} scalar is {t.get('scalar')!r}: expected true (with shape [1]) or false")
    if not isinstance(t.get("attrs"), dict) or not isinstance(t.get("partition"), str):
        raise CheckpointError(f"{name} attrs/partition missing")
    pieces = t.get("pieces")
    if not isinstance(pieces, list) or not pieces and math.prod(shape) or len(pieces) > MAX_PIECES:
        raise CheckpointError(f"{name} pieces: expected a list of 1 to {MAX_PIECES}")
    boxes = []
    for k, p in enumerate(pieces):
        what = f"{name} piece {k}"
        if not isinstance(p, dict):
            raise CheckpointError(f"{what} is not a JSON object")
        file = _str(p.get("file"), f"{what} file", FILE_RE)
        if file not in files:
            raise CheckpointError(f"{what} is in {file}, which the manifest does not list")
        _str(p.get("dataset"), f"{what} dataset")
        off = _ints(p.get("offset"), f"{what} offset", len(shape))
        shp = _ints(p.get("shape"), f"{what} shape", len(shape), 1)
        if any(o + s > g for o, s, g in zip(off, shp, shape)):
            raise CheckpointError(f"{what} {off}+{shp} lies outside the tensor's shape {shape}")
        chunk = _ints(p.get("chunk"), f"{what} chunk", len(shape), 1)
        count = math.prod(grid(tuple(shp), tuple(chunk)))
        nb = math.prod(chunk) * itemsize
        at, crc = p.get("at"), p.get("crc")
        if not isinstance(at, list) or not isinstance(crc, list) or len(at) != count or len(crc) != count:
            raise CheckpointError(f"{what}: expected {count} chunk offsets and CRCs")
        size = files[file]["bytes"]
        for a, c in zip(at, crc):
            if _int(a, f"{what} chunk offset") + nb > size:
                raise CheckpointError(f"{what}: a chunk at byte {a} of {nb} bytes lies beyond {file}'s {size} bytes")
            _int(c, f"{what} crc", 0, 0xFFFFFFFF)
        used.setdefault(file, []).extend((a, nb) for a in at)
        boxes.append((off, shp))
    why = coverage(tuple(shape), boxes)
    if why:
        raise CheckpointError(f"{name}: {why}")


def coverage(shape: tuple[int, ...], boxes: list[tuple[list[int], list[int]]]) -> str | None:
    """None if the (offset, shape) boxes inside ``shape`` cover it exactly once, else why
    not. Compares volumes and pairs of boxes: allocates nothing of the tensor's size."""
    total = math.prod(shape)
    covered = sum(math.prod(s) for _, s in boxes)
    if boxes and len(shape):
        lo = np.asarray([o for o, _ in boxes], dtype=np.int64)
        hi = lo + np.asarray([s for _, s in boxes], dtype=np.int64)
        for i in range(0, len(boxes), 512):
            over = np.all((lo[i:i + 512, None] < hi[None]) & (lo[None] < hi[i:i + 512, None]), axis=-1)
            over[np.arange(over.shape[0]), np.arange(i, i + over.shape[0])] = False
            if over.any():
                return "pieces overlap: some elements are covered more than once"
    if covered != total:
        return f"{total - covered} of {total} elements not covered by any piece"
    return None
