"""torch tensors <-> the numpy arrays a checkpoint stores. The only torch-dependent part of
the format, kept apart so that listing and inspecting checkpoints never imports torch."""

from __future__ import annotations

import numpy as np
import torch

from hpcml.ckpt.format import STORED_DTYPES
from hpcml.errors import CheckpointError

#: torch dtype -> name recorded in the 'dtype' attribute (a key of STORED_DTYPES)
_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8", torch.bool: "bool"}
_BY_NAME = {name: t for t, name in _NAMES.items()}


def storage(dtype: torch.dtype, tensor: str | None = None) -> tuple[type, str]:
    """(numpy dtype stored in HDF5, dtype name). bfloat16 is stored as its 16-bit pattern.
    ``tensor``: the tensor's name, for the error."""
    if dtype not in _NAMES:
        what = f"{tensor} of dtype {dtype}" if tensor else f"dtype {dtype}"
        raise CheckpointError(f"cannot checkpoint {what}: expected one of {', '.join(_NAMES.values())}")
    name = _NAMES[dtype]
    return STORED_DTYPES[name], name


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def numpy_view(t: torch.Tensor, dtype_name: str) -> np.ndarray | None:
    """A writable numpy view of ``t``'s memory in the stored encoding of ``dtype_name``, or
    None where there is none (another device, a non-contiguous view, another dtype)."""
    if t.device.type != "cpu" or not t.is_contiguous() or _NAMES.get(t.dtype) != dtype_name:
        return None
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Decode what :func:`to_numpy` stored, given the recorded dtype name."""
    if dtype_name not in _BY_NAME:
        raise CheckpointError(f"unknown stored dtype {dtype_name!r}: expected one of {', '.join(_BY_NAME)}")
    if dtype_name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))
