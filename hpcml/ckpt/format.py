"""The on-disk names and encodings of an hpcml checkpoint (spec: docs/checkpoint-format.md).

numpy only, no torch: listing and inspecting checkpoints (``hpcml ckpt ls``) and the async
writer process start fast. Tensor <-> array conversion is in :mod:`hpcml.ckpt.codec`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from hpcml.errors import CheckpointError

FORMAT_VERSION = "1.1"
"""What this hpcml writes when a checkpoint holds a fused tensor (``fused_widths``, new in 1.1)."""
BASE_FORMAT_VERSION = "1.0"
"""What it writes otherwise: such a checkpoint is exactly a 1.0 one. Readers accept any 1.x."""
INDEX = "index.h5"
LATEST = "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")

#: name recorded in a tensor's 'dtype' attribute -> numpy dtype stored in HDF5
#: (bfloat16 as its 16-bit pattern, since numpy has no bfloat16)
STORED_DTYPES: dict[str, type] = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
                                  "bfloat16": np.uint16, "int64": np.int64, "int32": np.int32, "uint8": np.uint8,
                                  "bool": np.bool_}


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"


def numpy_dtype(dtype_name: str) -> type:
    """The numpy dtype HDF5 stores for a recorded dtype name."""
    if dtype_name not in STORED_DTYPES:
        raise CheckpointError(f"unknown stored dtype {dtype_name!r}: expected one of {', '.join(STORED_DTYPES)}")
    return STORED_DTYPES[dtype_name]


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory: ``path`` itself if it holds ``index.h5``, else the one ``path/latest`` names."""
    p = Path(path)
    if (p / INDEX).is_file():
        return p
    latest = p / LATEST
    if latest.is_file():
        target = p / latest.read_text().strip()
        if (target / INDEX).is_file():
            return target
        raise CheckpointError(f"{latest} names {target.name}, which has no {INDEX}")
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    raise CheckpointError(f"no checkpoint at {p}: expected {INDEX} or a '{LATEST}' file")


def dumps(obj) -> str:
    """JSON for attributes: non-tensor state is JSON, never pickle."""
    return json.dumps(obj, sort_keys=True)
