"""``manifest.json``: what a save wrote, bound to that save, and the only thing hpcml parses
before it has checked a byte of a checkpoint.

A checkpoint is untrusted input. The manifest is read with a size bound and checked field by
field against the only layout the writer makes: plain file names of the step directory,
pieces that tile each tensor exactly once, data chunks inside their files and disjoint, so
that nothing declared can exceed the bytes really on disk. Each file's digest (metadata
SHA-256 plus a CRC-32 per data chunk for shards -- and a keyed tag per chunk when signed,
:mod:`hpcml.ckpt.chunkmac` -- a SHA-256 for ``index.h5``) and the save's
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

from hpcml import safeio
from hpcml.ckpt import chunkmac, format as fmt
from hpcml.ckpt.keys import Keyring
from hpcml.ckpt.chunks import check_fused, fused_spec
from hpcml.ckpt.shard import open_regular
from hpcml.ckpt.tiling import coverage
from hpcml.errors import CheckpointError
from hpcml.numeric import is_int

MANIFEST = fmt.MANIFEST
FORMAT = "hpcml-checkpoint"
MAX_MANIFEST_BYTES = 256 << 20
"""A manifest larger than this is refused before parsing (a 1 TB checkpoint's is ~20 MB)."""
FREE_MANIFEST_BYTES = 8 << 20
"""Beyond this, a manifest may be no larger than the shard files beside it (a real one is far
smaller: ~25 bytes per data chunk of >= 1 KiB, ~60 signed), so parsing it costs memory in proportion to
bytes really on disk, not to what a crafted file claims."""
MAX_INT = 1 << 62
"""Every count, offset and size: below int64's limit (numpy works on them)."""
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


def _body(m: dict) -> bytes:
    """What the signature covers: everything but the signature and the self-digest."""
    return _canonical({k: v for k, v in m.items() if k not in ("manifest_sha256", "signature")})


def write(path: Path, manifest: dict, keys: Keyring | None = None) -> None:
    """Write with its own SHA-256 (of its canonical JSON without that field, so an edited
    digit is caught), signed by ``keys`` when given, and fsync: the commit renames the
    directory only after this. Refused (nothing written) when larger than a reader would take
    for this checkpoint (:func:`_limit`): a save is never committed unloadable."""
    write_file(path, readable(path.parent, manifest, keys))


def readable(ckpt: Path, manifest: dict, keys: Keyring | None = None) -> bytes:
    """:func:`encode`, refused (CheckpointError) when larger than a reader takes for checkpoint
    directory ``ckpt`` (:func:`_limit`): a save or a signature never leaves it unloadable."""
    data = encode(manifest, keys)
    limit = _limit(ckpt) if len(data) > FREE_MANIFEST_BYTES else FREE_MANIFEST_BYTES  # a scan only past it
    if len(data) > limit:
        extra = len(_canonical(manifest.get("extra") or {}))
        raise CheckpointError(f"its manifest would be {len(data)} bytes, more than a reader takes for a checkpoint "
                              f"of these shard files ({limit}); extra= holds {extra} bytes of it: keep large state "
                              f"in tensors")
    return data


def encode(manifest: dict, keys: Keyring | None = None) -> bytes:
    """The manifest's bytes: its canonical JSON with its own SHA-256, signed by ``keys`` when given."""
    body = {k: v for k, v in manifest.items() if k not in ("manifest_sha256", "signature")}
    if keys is not None:
        body["signature"] = keys.sign(_canonical(body))
    return _canonical({**body, "manifest_sha256": hashlib.sha256(_canonical(body)).hexdigest()})


def write_file(path: Path, data: bytes) -> None:
    """``data`` as file ``path``, fsynced; an error (a full disk) names the file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def _limit(ckpt: Path) -> int:
    """How large the manifest of ``ckpt`` may be: :data:`FREE_MANIFEST_BYTES`, or the bytes the
    shard files beside it hold when more -- their data outside holes, so a shard made sparse
    cannot make room for a huge manifest, while a compressed one (few blocks, no holes) counts
    whole (plain names only; at most 1<<17 entries)."""
    data = 0
    try:
        with os.scandir(ckpt) as it:
            for k, entry in enumerate(it):
                if k > 1 << 17:
                    break
                if FILE_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    n = st.st_size
                    if st.st_blocks * 512 < n:  # holes (a shard made sparse) or compression: count what it holds
                        n = safeio.data_bytes(entry.path, n)
                    data += n
    except OSError:
        pass
    return min(MAX_MANIFEST_BYTES, max(FREE_MANIFEST_BYTES, data))


def read(ckpt: Path, keys: Keyring | None = None) -> dict:
    """The checked manifest of checkpoint directory ``ckpt``; raises CheckpointError (one
    line) on anything the writer would not have written. With ``keys``, also on a manifest
    that none of them signed (checked before any field is)."""
    path = ckpt / MANIFEST
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        seen = (os.path.realpath(ckpt), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                tuple(keys.ids) if keys is not None else None)
        if seen in _CHECKED:  # the same file, unchanged, checked already in this process (a tool opens it
            return _CHECKED[seen]  # several times): parsing a 20 MB manifest again costs seconds
        limit = _limit(ckpt)
        held = limit if limit > FREE_MANIFEST_BYTES else "less"
        raw = safeio.read_fd(fd, path, limit, f"a manifest of this checkpoint (its shard files hold {held})",
                             error=CheckpointError)
    finally:
        os.close(fd)
    try:
        m = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {str(e)[:120]}") from None
    del raw
    digest = m.pop("manifest_sha256", None) if isinstance(m, dict) else None
    if not isinstance(digest, str) or hashlib.sha256(_canonical(m)).hexdigest() != digest:
        raise CheckpointError(f"{path} differs from what was saved (its SHA-256): edited or corrupted")
    if keys is not None:
        keys.check(m.get("signature"), _body(m), str(path))
    try:
        check(m, ckpt)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if len(_CHECKED) >= 4:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[seen] = m
    return m


_CHECKED: dict[tuple, dict] = {}
"""The last few manifests read and checked, by file identity (device, inode, size, change
times) and the keys they were checked with; callers treat a manifest as read-only."""


def signed_by(m: dict) -> str | None:
    """The key id a manifest is signed by, or None."""
    sig = m.get("signature")
    return sig.get("key_id") if isinstance(sig, dict) and isinstance(sig.get("key_id"), str) else None


def _no_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _int(v, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if not is_int(v) or v < lo or v > hi:
        raise CheckpointError(f"{what} is {str(v)[:60]!r}: expected an integer >= {lo} and <= {hi}")
    return v


def _ints(v, what: str, n: int | None = None, lo: int = 0) -> list[int]:
    if not isinstance(v, list) or (n is not None and len(v) != n) or len(v) > 32:
        raise CheckpointError(f"{what} is {str(v)[:60]!r}: "
                              f"expected a list of {n if n is not None else 'up to 32'} integers")
    return [_int(x, what, lo) for x in v]


def _str(v, what: str, pattern: re.Pattern | None = None) -> str:
    if not isinstance(v, str) or (pattern is not None and not pattern.match(v)):
        raise CheckpointError(f"{what} is {str(v)[:60]!r}: expected {pattern.pattern if pattern else 'a string'}")
    return v


def check(m, ckpt: Path) -> None:
    """Every field, against the writer's layout (see the module docstring)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError("not an hpcml checkpoint manifest "
                              f"(format {str(m.get('format') if isinstance(m, dict) else m)[:40]!r})")
    version = _str(m.get("format_version"), "format_version")
    if version.split(".")[0] != fmt.FORMAT_VERSION.split(".")[0]:
        raise CheckpointError(f"format version {version!r}: this hpcml reads {fmt.FORMAT_VERSION.split('.')[0]}.x")
    _str(m.get("save_id"), "save_id", SAVE_ID_RE)
    step = _int(m.get("step"), "step")
    if (s := fmt.STEP_RE.match(ckpt.name.removesuffix(fmt.OLD_SUFFIX))) and int(s[1]) != step:
        raise CheckpointError(f"step {step} saved in a directory named {ckpt.name}: a checkpoint from another step")
    _int(m.get("world_size"), "world_size", 1)
    for key in ("layout", "extra", "files", "tensors"):
        if not isinstance(m.get(key), dict):
            raise CheckpointError(f"{key} is not a JSON object")
    if "step" in m["extra"] and m["extra"]["step"] != step:  # what a trainer resumes from must be the saved step
        raise CheckpointError(f"extra step {str(m['extra']['step'])[:40]!r} differs from the saved step {step}: "
                              "edited, or not written by this save")
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
    used: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for name, t in m["tensors"].items():
        _check_tensor(name, t, files, used)
    for name, parts in used.items():  # chunks disjoint within their file: nothing declared exceeds the disk
        at = np.concatenate([a for a, _ in parts])
        nb = np.concatenate([n for _, n in parts])
        order = np.argsort(at, kind="stable")
        at, nb = at[order], nb[order]
        bad = np.flatnonzero(at[:-1] + nb[:-1] > at[1:])
        if len(bad):
            raise CheckpointError(f"{name}: data chunks at bytes {at[bad[0]]} and {at[bad[0] + 1]} overlap")
    chunkmac.check_fields(m)


def _matrix(rows: list, d: int, lo: int, what: str) -> np.ndarray:
    """``rows`` (one list of ``d`` integers per piece) as an int64 array, every value in
    [lo, MAX_INT]: one numpy conversion, not a Python check per number."""
    try:
        a = np.array(rows) if rows else np.zeros((0, d), np.int64)
    except (ValueError, TypeError, OverflowError):
        a = None
    if a is None or a.dtype.kind not in "iub" or a.shape != (len(rows), d):
        k = next((k for k, r in enumerate(rows) if not isinstance(r, list) or len(r) != d or not all(
            is_int(x) for x in r)), 0)
        raise CheckpointError(f"{what} of piece {k} is {str(rows[k] if rows else None)[:60]!r}: expected a list of "
                              f"{d} integers")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < lo or a.max() > MAX_INT):
        k = int(np.flatnonzero(((a < lo) | (a > MAX_INT)).any(axis=1))[0])
        raise CheckpointError(f"{what} of piece {k} is {rows[k]}: expected integers >= {lo} and <= {MAX_INT}")
    return a


def _products(a: np.ndarray, what: str) -> np.ndarray:
    """Row products of ``a``, refused (one line) where one would pass :data:`MAX_INT`."""
    if a.size and (np.sum(np.log2(np.maximum(a, 1)), axis=1) > 62).any():
        raise CheckpointError(f"{what}: more than 2^62 of them in a piece")
    return np.prod(a, axis=1) if a.shape[1] else np.ones(len(a), np.int64)


def _check_tensor(name: str, t, files: dict, used: dict) -> None:
    why = fmt.name_problem(name)
    if why:
        raise CheckpointError(why)
    if not isinstance(t, dict):
        raise CheckpointError(f"tensor {name} is not a JSON object")
    dtype = _str(t.get("dtype"), f"{name} dtype")
    itemsize = np.dtype(fmt.numpy_dtype(dtype)).itemsize
    shape = _ints(t.get("shape"), f"{name} shape")
    if not isinstance(t.get("scalar"), bool) or (t["scalar"] and shape != [1]):
        raise CheckpointError(f"{name} scalar is {t.get('scalar')!r}: expected true (with shape [1]) or false")
    if not isinstance(t.get("attrs"), dict) or not isinstance(t.get("partition"), str):
        raise CheckpointError(f"{name} attrs/partition missing")
    _check_attrs(name, t["attrs"], shape)
    pieces = t.get("pieces")
    if not isinstance(pieces, list) or not pieces and math.prod(shape) or len(pieces) > MAX_PIECES:
        raise CheckpointError(f"{name} pieces: expected a list of 1 to {MAX_PIECES}")
    if not all(isinstance(p, dict) for p in pieces):
        raise CheckpointError(f"{name}: a piece is not a JSON object")
    for file in {p.get("file") for p in pieces if isinstance(p.get("file"), str)} | \
            ({None} if any(not isinstance(p.get("file"), str) for p in pieces) else set()):
        _str(file, f"{name} piece file", FILE_RE)
        if file not in files:
            raise CheckpointError(f"{name}: a piece is in {file}, which the manifest does not list")
    if not all(isinstance(p.get("dataset"), str) for p in pieces):
        raise CheckpointError(f"{name}: a piece's dataset is not a string")
    d = len(shape)
    off = _matrix([p.get("offset") for p in pieces], d, 0, f"{name} offset")
    shp = _matrix([p.get("shape") for p in pieces], d, 1, f"{name} shape")
    chunk = _matrix([p.get("chunk") for p in pieces], d, 1, f"{name} chunk")
    out = np.flatnonzero((off + shp > np.asarray(shape, np.int64)).any(axis=1)) if d else []
    if len(out):
        k = int(out[0])
        raise CheckpointError(f"{name} piece {k} {pieces[k]['offset']}+{pieces[k]['shape']} lies outside the "
                              f"tensor's shape {shape}")
    counts = _products(-(-shp // chunk), f"{name} chunks")
    nb = _products(chunk, f"{name} chunk elements") * itemsize
    for k, (p, count) in enumerate(zip(pieces, counts.tolist())):
        at, crc = p.get("at"), p.get("crc")
        if not isinstance(at, list) or not isinstance(crc, list) or len(at) != count or len(crc) != count:
            raise CheckpointError(f"{name} piece {k}: expected {count} chunk offsets and CRCs")
    at = _matrix([[a] for p in pieces for a in p["at"]], 1, 0, f"{name} chunk offset")[:, 0]
    crc = _matrix([[c] for p in pieces for c in p["crc"]], 1, 0, f"{name} crc")[:, 0]
    if crc.size and crc.max() > 0xFFFFFFFF:
        raise CheckpointError(f"{name}: a chunk CRC is {int(crc.max())}: expected a 32-bit value")
    chunk_nb = np.repeat(nb, counts)
    sizes = np.repeat(np.asarray([files[p["file"]]["bytes"] for p in pieces], np.int64), counts)
    beyond = np.flatnonzero(at + chunk_nb > sizes)
    if len(beyond):
        i = int(beyond[0])
        raise CheckpointError(f"{name}: a chunk at byte {at[i]} of {chunk_nb[i]} bytes lies beyond its file's "
                              f"{sizes[i]} bytes")
    by_file = np.repeat(np.asarray([p["file"] for p in pieces]), counts)
    for file in set(p["file"] for p in pieces):
        mask = by_file == file
        used.setdefault(file, []).append((at[mask], chunk_nb[mask]))
    why = coverage(tuple(shape), (off, shp))
    if why:
        raise CheckpointError(f"{name}: {why}")


def _plain_value(v, depth: int = 0) -> bool:
    """What a save writes as a tensor attribute: a short string, a bool, a number, or a
    (nested once) list of them -- what any HDF5 tool can hold as an attribute."""
    if isinstance(v, list):
        return depth < 2 and len(v) <= 4096 and all(_plain_value(x, depth + 1) for x in v)
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, (bool, int)) and abs(v) <= MAX_INT or isinstance(v, str) and len(v) <= 4096 and "\0" not in v


def _check_attrs(name: str, attrs: dict, shape: list[int]) -> None:
    """The attributes hpcml reads back must fit the tensor; every attribute must be plain."""
    bad = [k for k, v in attrs.items() if not k or len(k) > 256 or not k.isprintable() or not _plain_value(v)]
    if bad:
        raise CheckpointError(f"{name} attrs {[k[:40] for k in bad[:3]]}: expected printable names with short "
                              f"strings, numbers or lists of them")
    logical = attrs.get("logical_shape")
    if logical is not None and (not isinstance(logical, list) or len(logical) != len(shape) or not all(
            is_int(n) and 0 <= n <= s for n, s in zip(logical, shape))):
        raise CheckpointError(f"{name} logical_shape {str(logical)[:60]}: expected one size per dimension, each "
                              f"at most the stored shape {shape}")
    spec = fused_spec(attrs)
    if spec is not None and (why := check_fused(name, spec[0], spec[1], tuple(shape), 1)):
        raise CheckpointError(why)
    experts = attrs.get("experts")
    if experts is not None and (not is_int(experts) or not shape
                                or not 1 <= experts <= shape[0]):
        raise CheckpointError(f"{name} experts {str(experts)[:40]}: expected 1 to {shape[0] if shape else 0} "
                              f"(expert index first)")
