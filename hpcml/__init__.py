"""hpcml: machine learning at supercomputer scale, the same code on a laptop.

The main names are here, imported on first use (``import hpcml`` loads neither torch nor
MPI, so a simulation or a login-node tool starts fast)::

    grid = hpcml.ProcessGrid(tp=2)                 # named parallel axes over MPI ranks
    model = hpcml.parallelize(model, grid, ...)    # FSDP2 / DTensor / pipelining / Ulysses
    hpcml.train_online(trainer, source, grid=grid, config=hpcml.OnlineConfig(...))
    sys.exit(hpcml.train_surrogate(model, params=..., fields=..., scales=...))   # a campaign's trainer
    hpcml.Campaign(site="local", ...).run(sims, training=...)
    hpcml.save(ckpt_dir, step, tensors, comm=comm); hpcml.load(ckpt_dir, tensors)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ProcessGrid": "hpcml.grid", "Layout": "hpcml.grid",
    "parallelize": "hpcml.parallel", "ParallelConfig": "hpcml.parallel",
    "Trainer": "hpcml.train", "TrainConfig": "hpcml.train", "FieldTrainer": "hpcml.train",
    "FieldTrainConfig": "hpcml.train", "FieldScales": "hpcml.train",
    "train_surrogate": "hpcml.train", "Contract": "hpcml.contract",
    "train_online": "hpcml.train.online", "OnlineConfig": "hpcml.train.online", "OnlineResult": "hpcml.train.online",
    "Campaign": "hpcml.ensemble", "SimSpec": "hpcml.ensemble", "TrainingJob": "hpcml.ensemble",
    "load_site": "hpcml.ensemble",
    "Producer": "hpcml.stream", "StreamServer": "hpcml.stream", "Buffer": "hpcml.stream",
    "BufferConfig": "hpcml.stream",
    "save": "hpcml.ckpt", "load": "hpcml.ckpt",
}
_SUBMODULES = {"ckpt", "contract", "ensemble", "env", "errors", "grid", "interop", "lifeline", "log", "models", "net",
               "parallel", "plan", "stop", "stream", "train"}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ckpt import load, save
    from hpcml.contract import Contract
    from hpcml.ensemble import Campaign, SimSpec, TrainingJob, load_site
    from hpcml.grid import Layout, ProcessGrid
    from hpcml.parallel import ParallelConfig, parallelize
    from hpcml.stream import Buffer, BufferConfig, Producer, StreamServer
    from hpcml.train import FieldScales, FieldTrainConfig, FieldTrainer, TrainConfig, Trainer, train_surrogate
    from hpcml.train.online import OnlineConfig, OnlineResult, train_online


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"hpcml.{name}")
    raise AttributeError(f"module 'hpcml' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
