"""HDF5 checkpoints: per-rank shards plus an index of virtual datasets that presents every
global tensor whole -- save distributed, load on any layout, read by any HDF5 tool.

Names are imported on first use, so the async writer process (``hpcml.ckpt.async_writer``,
numpy and h5py only) and ``hpcml ckpt ls`` / ``inspect`` (:mod:`hpcml.ckpt.tools`) start
without importing torch.
"""

from __future__ import annotations

import pkgutil
from typing import TYPE_CHECKING

from hpcml.lazy import lazy_names

_EXPORTS = {"Checkpoint": "checked", "LoadReport": "reader", "load": "reader", "read_extra": "reader",
            "read_tensor": "reader", "read_tensors": "reader", "refuse_saves_over": "format", "resolve": "format",
            "Keep": "format",
            "training_tensors": "state",
            "AsyncSaver": "async_save", "SaveResult": "writer", "save": "writer", "CheckpointError": "hpcml.errors"}
_SUBMODULES = {m.name for m in pkgutil.iter_modules(__path__)}  # every module here (a kept list drifted)

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ckpt.checked import Checkpoint
    from hpcml.ckpt.format import Keep, refuse_saves_over, resolve
    from hpcml.ckpt.reader import LoadReport, load, read_extra, read_tensor, read_tensors
    from hpcml.ckpt.state import training_tensors
    from hpcml.ckpt.async_save import AsyncSaver
    from hpcml.ckpt.writer import SaveResult, save
    from hpcml.errors import CheckpointError


__getattr__ = lazy_names(__name__, _EXPORTS, _SUBMODULES)
