"""A Hugging Face safetensors directory read as untrusted input, a slice at a time.

Every size is bounded before it is parsed (``config.json``, the shard index, each file's
header), every tensor's dtype, shape and byte range is checked against what the model
expects before any of it is read, and only plain file names inside the directory are
opened (an index naming ``../x`` or a symbolic link out of it is refused). Reads go through
``safe_open(...).get_slice``, so a rank touches only the rows and columns it asks for.
"""

from __future__ import annotations

import math
import os
import re
import stat
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from hpcml import safeio
from hpcml.ckpt.shard import open_regular
from hpcml.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

MAX_HEADER_BYTES = 64 << 20
"""Largest safetensors header read (the format's own reader stops at 100 MB; ours hold ~300 B per tensor)."""
MAX_INDEX_BYTES = 64 << 20
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
"""Dtypes read (converted to the model's on copy)."""
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq|lm_head\.weight)")
"""Tensors a Llama directory may carry beyond the model's: recomputed buffers, a tied model's copy of the embedding."""


def homes(root: Path) -> set[Path]:
    """Directories the files of model directory ``root`` may resolve into: ``root`` itself and,
    for a snapshot of the Hugging Face hub cache (``models--org--name/snapshots/<rev>``, whose
    files are links), that repository's ``blobs``."""
    real = root.resolve()
    out = {real}
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        out.add(real.parent.parent / "blobs")
    return out


def resolve_inside(root: Path, name: str) -> Path:
    """``root / name`` if it is a regular file that resolves inside :func:`homes` of ``root``."""
    path = root / name
    inside = path.resolve().parent in homes(root)
    try:
        mode = os.stat(path).st_mode if inside else None  # what the name leads to, inside the directory
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):  # a FIFO, a device, a directory: its own cause, not a link's
        raise CheckpointError(f"{path}: is {safeio.kind(mode)}; expected a regular file")
    if mode is None:  # outside the directory, or nothing there
        raise CheckpointError(f"{path}: not a file inside {root} (a link out of the directory, other than the "
                              f"hub cache's own, is not followed)")
    return path


def model_json(root: Path, name: str, limit: int) -> dict:
    """The JSON object of file ``name`` of model directory ``root``, at most ``limit`` bytes long."""
    if not (root / name).exists():
        raise ConfigError(f"{root / name}: no such file (expected a Hugging Face model directory)")
    path = resolve_inside(root, name).resolve()  # inside the directory (or the hub cache): checked
    # transformers writes Infinity: the config's own checks name it
    return safeio.read_json(path, limit, error=ConfigError, required=True, constants=True, expected="a model's JSON")


def inside(root: Path, name) -> Path:
    """``root / name`` for a plain ``*.safetensors`` file name that resolves inside ``root``."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\.safetensors", name):
        raise CheckpointError(f"{root}: file name {name!r} in {INDEX} is not a plain *.safetensors name")
    return resolve_inside(root, name)


def data_bytes(root: Path) -> int | None:
    """Bytes of tensor data in the safetensors files of ``root`` (the index's, or
    ``model.safetensors``; each header checked): what a config may claim is bounded by this
    before any model is built. None: no such files (:class:`SafetensorsDir` says so)."""
    if (root / INDEX).exists():
        index = model_json(root, INDEX, MAX_INDEX_BYTES)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        names = set(wmap.values()) if isinstance(wmap, dict) else set()
    else:
        names = {SINGLE} if (root / SINGLE).exists() else set()
    return sum(header(inside(root, n))[1] for n in sorted(names)) if names else None


def header(path: Path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte size of the data section) of a safetensors file."""
    with os.fdopen(open_regular(path.resolve()), "rb") as f:  # non-blocking open: a FIFO is refused, not waited on
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit a {size}-byte file "
                                  f"(limit {MAX_HEADER_BYTES}): not a safetensors file")
        try:
            h = safeio.parse_json(f.read(n), f"{path}: header")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if not isinstance(h, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    h.pop("__metadata__", None)
    return h, size - 8 - n


class SafetensorsDir:
    """The tensors of a HF directory, checked against ``expected`` (name -> shape); a context manager."""

    def __init__(self, path, expected: dict[str, tuple[int, ...]]) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise ConfigError(f"{self.root}: not a directory (expected a Hugging Face model directory)")
        self.where: dict[str, Path] = {}
        self.dtype: dict[str, str] = {}
        self.shape = dict(expected)
        self.bytes_read = 0
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self._check(expected)
        self.total_bytes = sum(math.prod(s) * ITEMSIZE[self.dtype[n]] for n, s in expected.items())

    def _files(self) -> dict[str, Path] | None:
        """Tensor -> file from the index (None: one ``model.safetensors``, names from its header)."""
        if (self.root / INDEX).exists():
            index = model_json(self.root, INDEX, MAX_INDEX_BYTES)
            wmap = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wmap, dict):
                raise CheckpointError(f"{self.root / INDEX}: no weight_map object")
            return {str(k): inside(self.root, v) for k, v in wmap.items()}
        if (self.root / SINGLE).exists():
            return None
        raise CheckpointError(f"{self.root}: no {SINGLE} or {INDEX} (only safetensors are read, never a pickled "
                              f"pytorch_model.bin)")

    def _check(self, expected: dict[str, tuple[int, ...]]) -> None:
        files = self._files()
        paths = sorted(set(files.values())) if files is not None else [inside(self.root, SINGLE)]
        found: dict[str, tuple[Path, dict, int]] = {}
        for path in paths:
            h, data = header(path)
            found.update({name: (path, entry, data) for name, entry in h.items()})
        if files is not None:
            stray = sorted(n for n, p in files.items() if n not in found or found[n][0] != p)
            if stray:
                raise CheckpointError(f"{self.root / INDEX}: {stray[:3]} not in the files it names")
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(n for n in found if n not in expected and not _IGNORED.fullmatch(n))
        if missing or unexpected:
            raise CheckpointError(f"{self.root}: does not hold the Llama model of its config.json: missing "
                                  f"{missing[:4]}, unexpected {unexpected[:4]} (biases? another architecture?)")
        for name, shape in expected.items():
            path, entry, data = found[name]
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            if dtype not in ITEMSIZE:
                raise CheckpointError(f"{path}: {name} has dtype {dtype!r}, expected one of {', '.join(ITEMSIZE)}")
            if entry.get("shape") != list(shape):
                raise CheckpointError(f"{path}: {name} has shape {entry.get('shape')}, the config says {list(shape)}")
            offs = entry.get("data_offsets")
            if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                    and 0 <= offs[0] and offs[1] <= data and offs[1] - offs[0] == math.prod(shape) * ITEMSIZE[dtype]):
                raise CheckpointError(f"{path}: {name} data_offsets {offs} do not hold {list(shape)} {dtype} "
                                      f"in its {data}-byte data section")
            self.where[name], self.dtype[name] = path, dtype

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def _slice(self, name: str):
        from safetensors import safe_open

        path = self.where[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        return self._handles[path].get_slice(name)

    def read_into(self, dest: torch.Tensor, name: str, rows: np.ndarray, cols: tuple[int, int] | None = None) -> None:
        """Copy rows ``rows`` of tensor ``name`` (columns ``[cols[0], cols[1])``) into the rows of
        ``dest`` in that order; rows past the tensor's end are zeros (the padded vocabulary). Each
        contiguous run is read once and lands in ``dest`` as one (strided) copy."""
        import numpy as np
        import torch

        sl, n = self._slice(name), self.shape[name][0]
        keep = rows < n
        if not keep.all():
            dest[torch.from_numpy(~keep)] = 0
        order = np.argsort(rows[keep], kind="stable")
        want, where = rows[keep][order], np.flatnonzero(keep)[order]  # HF rows ascending, their rows in dest
        for run in np.split(np.arange(want.size), np.flatnonzero(np.diff(want) != 1) + 1) if want.size else []:
            a, b = int(want[run[0]]), int(want[run[-1]]) + 1
            piece = sl[a:b] if cols is None else sl[a:b, cols[0]:cols[1]]
            self.bytes_read += piece.numel() * ITEMSIZE[self.dtype[name]]
            at = where[run]
            step = int(at[1] - at[0]) if at.size > 1 else 1
            if step > 0 and np.array_equal(at, at[0] + step * np.arange(at.size)):  # e.g. every other row: rope
                dest[int(at[0]):int(at[-1]) + 1:step].copy_(piece)
            else:
                dest[torch.from_numpy(at)] = piece.to(dest.dtype)


__all__ = ["ITEMSIZE", "MAX_HEADER_BYTES", "SafetensorsDir", "header", "homes", "inside", "model_json",
           "resolve_inside"]
