"""Unpickling what torch.distributed.checkpoint wrote, without running any of it.

DCP's ``.metadata`` is a pickle of its record classes, and each storage entry is a
``torch.save`` zip whose ``data.pkl`` torch would load with ``pickle``. Here an unpickler
knows only an allow-list: the DCP record classes (each replaced by an inert
:class:`Record` that keeps its fields), ``torch.Size``, dtypes, layouts and paths for the
metadata; ``_rebuild_tensor_v2`` and typed storages for a tensor entry, rebuilt from the
raw bytes with every index checked; nothing at all for other entries. Anything else is
refused by name. The reader that uses this is :mod:`hpcml.ckpt.dcp_safe`.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import sys
import zipfile
import zlib
from typing import Any

import torch

from hpcml.errors import CheckpointError

MAX_PICKLE_BYTES = 2**20
"""A larger ``data.pkl`` in one entry is refused (a tensor's is about 150 bytes)."""
_READ_CHUNK = 16 * 2**20

_DCP_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "_StorageInfo")
_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
             "ComplexDoubleStorage": torch.complex128}


class Record:
    """Stands in for an allow-listed DCP class: keeps its constructor arguments and pickled state, runs nothing."""

    kind = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def get(self, name: str, pos: int, default: Any = ...) -> Any:
        """Field ``name`` (position ``pos``), whichever way the class pickled itself."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # a dataclass with __slots__
        if isinstance(state, dict) and name in state:
            return state[name]
        seq = state if isinstance(state, (tuple, list)) else self.args
        if pos < len(seq):
            return seq[pos]
        if default is ...:
            raise CheckpointError(f"DCP metadata record {self.kind} has no field {name!r}")
        return default


def dims(*args: Any) -> tuple[int, ...]:
    """``torch.Size`` as a plain tuple of non-negative ints (what the metadata pickle calls)."""
    out = tuple(args[0]) if args else ()
    if not all(type(d) is int and d >= 0 for d in out):
        raise CheckpointError(f"DCP metadata has a torch.Size of non-sizes {out!r}")
    return out


def metadata_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for name in _DCP_CLASSES:
        stand_in = type(name, (Record,), {"kind": name})
        for module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
            allowed[(module, name)] = stand_in
    allowed[("torch", "Size")] = dims
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = lambda name: str(name)
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = lambda *parts: "/".join(map(str, parts))
    allowed[("collections", "OrderedDict")] = dict
    return allowed


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], where: str, storage=None) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed, self.where, self.storage = allowed, where, storage

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise CheckpointError(f"{self.where}: refused to unpickle {module}.{name}: not on hpcml's allow-list "
                                  f"(hpcml never runs code from a checkpoint)") from None

    def persistent_load(self, pid: Any) -> Any:
        if self.storage is None:
            raise CheckpointError(f"{self.where}: refused a persistent id {str(pid)[:60]!r} outside a tensor")
        return self.storage(pid)


def line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def unpickle(data: bytes, allowed: dict, where: str, storage=None) -> Any:
    try:
        return _Unpickler(data, allowed, where, storage).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- any malformed pickle is one line
        raise CheckpointError(f"{where}: unreadable pickle ({type(e).__name__}: {line(e)})") from None


class Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a file of their own (for ``zipfile``)."""

    def __init__(self, f, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = (offset, self.pos + offset, self.length + offset)[whence]
        if pos < 0:
            raise OSError("seek before the start of the entry")
        self.pos = pos
        return pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def load_entry(zf: zipfile.ZipFile, where: str, tensor: bool) -> Any:
    pkls = [i for i in zf.infolist() if i.filename.rsplit("/", 1)[-1] == "data.pkl"]
    if len(pkls) != 1 or pkls[0].file_size > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{where}: {len(pkls)} data.pkl member(s), or one over {MAX_PICKLE_BYTES} bytes")
    prefix = pkls[0].filename[:-len("data.pkl")]
    order = zf.read(prefix + "byteorder").decode() if prefix + "byteorder" in zf.namelist() else "little"
    if order != sys.byteorder:
        raise CheckpointError(f"{where}: saved {order}-endian, this machine is {sys.byteorder}-endian")
    storages: dict[str, torch.Tensor] = {}

    def storage(pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)
                and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            raise CheckpointError(f"{where}: refused persistent id {str(pid)[:80]!r}")
        _, dtype, name, _, numel = pid
        if name not in storages:
            storages[name] = _read_storage(zf, prefix + "data/" + name, dtype, numel, where)
        return storages[name]

    if not tensor:
        return unpickle(zf.read(pkls[0]), {}, where)
    allowed = {("torch", n): d for n, d in _STORAGES.items()}
    allowed[("torch._utils", "_rebuild_tensor_v2")] = _rebuild
    allowed[("collections", "OrderedDict")] = dict
    return unpickle(zf.read(pkls[0]), allowed, where, storage)


def _read_storage(zf: zipfile.ZipFile, member: str, dtype: torch.dtype, numel: int, where: str) -> torch.Tensor:
    """The member's bytes read straight into a tensor (one copy), its CRC-32 checked."""
    try:
        info = zf.getinfo(member)
    except KeyError:
        raise CheckpointError(f"{where}: no member {member}") from None
    nbytes = numel * dtype.itemsize
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes or info.compress_size != nbytes:
        raise CheckpointError(f"{where}: {member} is {info.file_size} bytes (compression {info.compress_type}), "
                              f"expected {nbytes} stored for {numel} {dtype}")
    win = zf.fp
    win.seek(info.header_offset)
    head = win.read(30)  # the local file header: signature ... name length, extra length
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: {member} has no local file header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    win.seek(info.header_offset + 30 + name_len + extra_len)
    out = torch.empty(numel, dtype=dtype)
    view = memoryview(out.view(torch.uint8).numpy()) if nbytes else memoryview(bytearray())
    pos, crc = 0, 0
    while pos < nbytes:
        got = win.readinto(view[pos:pos + _READ_CHUNK])
        if not got:
            raise CheckpointError(f"{where}: {member} ends after {pos} of {nbytes} bytes")
        crc = zlib.crc32(view[pos:pos + got], crc)
        pos += got
    if crc != info.CRC:
        raise CheckpointError(f"{where}: {member} fails its CRC-32 (stored {info.CRC:08x}, read {crc:08x})")
    return out


def _rebuild(storage: torch.Tensor, offset: int, size: tuple, stride: tuple, *_: Any) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` for plain CPU tensors, every index checked inside its storage."""
    if not (type(offset) is int and all(type(v) is int and v >= 0 for v in (*size, *stride)) and offset >= 0
            and len(size) == len(stride)):
        raise CheckpointError(f"tensor view offset {offset!r}, size {size!r}, stride {stride!r} is malformed")
    if math.prod(size) == 0:
        return torch.empty(size, dtype=storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.numel():
        raise CheckpointError(f"tensor view reaches element {last} of a {storage.numel()}-element storage")
    return storage.as_strided(size, stride, offset)


__all__ = ["MAX_PICKLE_BYTES", "Record", "Window", "dims", "line", "load_entry", "metadata_globals", "unpickle"]
