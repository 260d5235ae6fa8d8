"""The on-disk names and encodings of an hpcml checkpoint (spec: docs/checkpoint-format.md)."""

from __future__ import annotations

import json
import re

import numpy as np
import torch

FORMAT_VERSION = "1.1"
"""What this hpcml writes when a checkpoint holds a fused tensor (``fused_widths``, new in 1.1)."""
BASE_FORMAT_VERSION = "1.0"
"""What it writes otherwise: such a checkpoint is exactly a 1.0 one. Readers accept any 1.x."""
INDEX = "index.h5"
LATEST = "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")

#: torch dtype -> (numpy storage dtype, name recorded in the 'dtype' attribute)
_DTYPES = {torch.float32: (np.float32, "float32"), torch.float64: (np.float64, "float64"),
           torch.float16: (np.float16, "float16"), torch.bfloat16: (np.uint16, "bfloat16"),
           torch.int64: (np.int64, "int64"), torch.int32: (np.int32, "int32"), torch.uint8: (np.uint8, "uint8"),
           torch.bool: (np.bool_, "bool")}
_BY_NAME = {name: (np_t, t) for t, (np_t, name) in _DTYPES.items()}


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"


def storage(dtype: torch.dtype) -> tuple[type, str]:
    """(numpy dtype stored in HDF5, dtype name). bfloat16 is stored as its 16-bit pattern."""
    if dtype not in _DTYPES:
        raise TypeError(f"cannot checkpoint dtype {dtype}: expected one of {', '.join(n for _, n in _DTYPES.values())}")
    return _DTYPES[dtype]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Decode what :func:`to_numpy` stored, given the recorded dtype name."""
    if dtype_name not in _BY_NAME:
        raise ValueError(f"unknown stored dtype {dtype_name!r}")
    if dtype_name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def dumps(obj) -> str:
    """JSON for attributes: non-tensor state is JSON, never pickle."""
    return json.dumps(obj, sort_keys=True)
