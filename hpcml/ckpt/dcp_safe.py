"""Read a torch.distributed.checkpoint (DCP) directory without running any of its pickles.

What torch (2.6-2.14) writes and its ``FileSystemReader`` does with it:

- ``.metadata``: a pickle of ``Metadata`` (entry name -> tensor or bytes record, entry ->
  ``_StorageInfo(relative_path, offset, length)``), read with ``pickle.load``: any code runs.
- ``__<rank>_<i>.distcp``: entries back to back, each a ``torch.save`` zip. A tensor entry is
  read with ``torch.load(weights_only=True)``; a non-tensor one (a float, a tuple) goes to the
  load planner's ``torch.load(weights_only=False)``: any code runs again.

Here ``.metadata`` is size-bounded, then unpickled knowing only the DCP record classes,
``torch.Size``, dtypes, layouts and paths -- each replaced by an inert stand-in, so not even
torch's constructors run; anything else is refused by name. A storage file must be a plain
name inside the directory (no ``..``, no separator, no symlink out) and each entry's byte
range must lie inside it. An entry's zip members are stored, CRC-checked and size-checked;
its ``data.pkl`` may name ``_rebuild_tensor_v2`` and typed storages (tensor entries, rebuilt
here from the raw bytes) or nothing at all (other entries: plain values only).
"""


from __future__ import annotations

import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcml.ckpt.dcp_pickle import MAX_PICKLE_BYTES, Record, Window, dims, line, load_entry, metadata_globals, unpickle
from hpcml.ckpt.shard import open_regular
from hpcml import safeio
from hpcml.errors import CheckpointError

METADATA = ".metadata"
MAX_METADATA_BYTES = 256 * 2**20
"""A larger ``.metadata`` is refused before parsing (a 405B-parameter torchtitan run's is tens of MB)."""


@dataclass(frozen=True)
class _Loc:
    file: Path
    offset: int
    length: int


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype | None
    """None: a non-tensor value."""
    size: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], _Loc], ...]
    """(offsets, sizes, where) of each saved piece."""


class DcpReader:
    """A DCP directory's entries by flattened name (``optimizer.state.<fqn>.exp_avg``), read
    without running its pickles (module docstring). Every refusal is a one-line CheckpointError."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        meta = self.path / METADATA
        if not meta.is_file():
            raise CheckpointError(f"no DCP checkpoint at {self.path} (no {METADATA})")
        raw = safeio.read_bytes(meta, MAX_METADATA_BYTES, "a DCP .metadata", error=CheckpointError, required=True)
        md = unpickle(raw, metadata_globals(), str(meta))
        if getattr(md, "kind", None) != "Metadata":
            raise CheckpointError(f"{meta} holds a {type(md).__name__}, not DCP Metadata")
        self._sizes: dict[str, int] = {}
        self.entries = self._entries(md, self._locations(md, str(meta)), str(meta))

    def _file(self, rel: Any, where: str) -> Path:
        ok = isinstance(rel, str) and rel not in ("", ".", "..") and os.path.basename(rel) == rel \
            and "\\" not in rel and "\0" not in rel
        path = self.path / rel if ok else None
        if not ok or path.resolve().parent != self.path.resolve() or not path.is_file():
            raise CheckpointError(f"{where}: storage file {rel!r} is not a plain file name inside {self.path}")
        return path

    def _locations(self, md: Record, where: str) -> dict[tuple[str, Any], _Loc]:
        out = {}
        data = md.get("storage_data", 2)
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: storage_data is a {type(data).__name__}, not a dict")
        for index, info in data.items():
            if getattr(index, "kind", None) != "MetadataIndex" or getattr(info, "kind", None) != "_StorageInfo":
                raise CheckpointError(f"{where}: storage_data maps {type(index).__name__} to {type(info).__name__}, "
                                      f"not MetadataIndex to _StorageInfo (a storage hpcml does not read)")
            fqn, offset = index.get("fqn", 0), index.get("offset", 1, None)
            file = self._file(info.get("relative_path", 0), where)
            start, length = info.get("offset", 1), info.get("length", 2)
            if info.get("transform_descriptors", 3, None):
                raise CheckpointError(f"{where}: {fqn!r} is stored through transforms "
                                      f"{info.get('transform_descriptors', 3)} (e.g. compression): not read by hpcml")
            if file not in self._sizes:
                self._sizes[file] = file.stat().st_size
            if not (type(start) is int and type(length) is int and 0 <= start and 0 <= length
                    and start + length <= self._sizes[file]):
                raise CheckpointError(f"{where}: {fqn!r} claims bytes [{start}, {start}+{length}) of {file.name}, "
                                      f"which has {self._sizes[file]}")
            out[(fqn, None if offset is None else tuple(offset))] = _Loc(file, start, length)
        return out

    def _entries(self, md: Record, locs: dict, where: str) -> dict[str, _Entry]:
        out: dict[str, _Entry] = {}
        records = md.get("state_dict_metadata", 0)
        if not isinstance(records, dict):
            raise CheckpointError(f"{where}: state_dict_metadata is a {type(records).__name__}, not a dict")
        for key, rec in records.items():
            kind = getattr(rec, "kind", None)
            if not isinstance(key, str) or kind not in ("TensorStorageMetadata", "BytesStorageMetadata"):
                raise CheckpointError(f"{where}: entry {str(key)[:80]!r} is a {kind or type(rec).__name__}")
            if kind == "BytesStorageMetadata":
                out[key] = _Entry(None, (), (((), (), self._loc(locs, key, None, where)),))
                continue
            dtype, size = rec.get("properties", 0).get("dtype", 0), dims(rec.get("size", 1))
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{where}: {key!r} has dtype {dtype!r}")
            chunks = []
            for c in rec.get("chunks", 2):
                offsets, sizes = dims(c.get("offsets", 0)), dims(c.get("sizes", 1))
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                        o + s > n for o, s, n in zip(offsets, sizes, size)):
                    raise CheckpointError(f"{where}: {key!r} has a piece at {list(offsets)} of {list(sizes)} outside "
                                          f"its {list(size)}")
                loc = self._loc(locs, key, offsets, where)
                if loc.length < math.prod(sizes) * dtype.itemsize:
                    raise CheckpointError(f"{where}: {key!r} piece at {list(offsets)} needs "
                                          f"{math.prod(sizes) * dtype.itemsize} bytes, its entry has {loc.length}")
                chunks.append((offsets, sizes, loc))
            if sum(math.prod(s) for _, s, _ in chunks) != math.prod(size):
                raise CheckpointError(f"{where}: the pieces of {key!r} hold {sum(math.prod(s) for _, s, _ in chunks)} "
                                      f"elements, its shape {list(size)} {math.prod(size)}")
            out[key] = _Entry(dtype, size, tuple(chunks))
        return out

    @staticmethod
    def _loc(locs: dict, key: str, offsets: tuple[int, ...] | None, where: str) -> _Loc:
        try:
            return locs[(key, offsets)]
        except KeyError:
            raise CheckpointError(f"{where}: {key!r} (piece at {offsets}) has no storage entry") from None

    # -- what a caller asks ------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.entries

    def children(self, prefix: str) -> list[str]:
        """The rest of each entry name under ``prefix`` (e.g. ``exp_avg``, ``step`` of a parameter's state)."""
        return sorted(k[len(prefix):] for k in self.entries if k.startswith(prefix))

    def _entry(self, key: str) -> _Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no entry {key!r}") from None

    def shape(self, key: str) -> tuple[int, ...] | None:
        """A tensor entry's shape; None for a non-tensor value."""
        e = self._entry(key)
        return None if e.dtype is None else e.size

    def check_shape(self, key: str, want: tuple[int, ...], ours: str) -> None:
        if key not in self.entries:
            raise CheckpointError(f"{self.path}: no {key!r} (torchtitan's name for hpcml {ours})")
        got = self.shape(key)
        if got != tuple(want):
            raise CheckpointError(f"{self.path}: {key!r} is {'a value' if got is None else list(got)}, expected "
                                  f"{list(want)} for hpcml {ours}")

    def tensor(self, key: str) -> torch.Tensor:
        e = self._entry(key)
        if e.dtype is None:
            raise CheckpointError(f"{self.path}: {key!r} is a value, not a tensor")
        if len(e.chunks) == 1:
            return self._piece(key, *e.chunks[0], e.dtype)
        out, seen = torch.empty(e.size, dtype=e.dtype), torch.zeros(e.size, dtype=torch.bool)
        for offsets, sizes, loc in e.chunks:
            box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if seen[box].any():
                raise CheckpointError(f"{self.path}: pieces of {key!r} overlap at {list(offsets)}")
            seen[box] = True
            out[box] = self._piece(key, offsets, sizes, loc, e.dtype)
        return out

    def value(self, key: str) -> Any:
        """A non-tensor entry (int, float, str, tuple ...), or a 0-d tensor entry's number."""
        e = self._entry(key)
        if e.dtype is not None:
            t = self.tensor(key)
            return t.item() if t.dim() == 0 else t
        return self._read(key, e.chunks[0][2], tensor=False)

    def _piece(self, key: str, offsets, sizes, loc: _Loc, dtype: torch.dtype) -> torch.Tensor:
        t = self._read(key, loc, tensor=True)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(sizes):
            what = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{self.path}: {key!r} piece at {list(offsets)} holds {what}, its metadata says "
                                  f"{dtype} {list(sizes)}")
        return t

    def _read(self, key: str, loc: _Loc, tensor: bool) -> Any:
        where = f"{loc.file}[{loc.offset}:+{loc.length}] ({key})"
        with os.fdopen(open_regular(loc.file), "rb") as f:
            try:
                zf = zipfile.ZipFile(Window(f, loc.offset, loc.length))
                return load_entry(zf, where, tensor)
            except CheckpointError:
                raise
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, NotImplementedError) as e:
                raise CheckpointError(f"{where}: not a sound torch.save archive ({line(e)})") from None


__all__ = ["DcpReader", "MAX_METADATA_BYTES", "MAX_PICKLE_BYTES"]
