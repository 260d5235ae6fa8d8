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

from typing import TYPE_CHECKING

from hpcml.lazy import lazy_names

__version__ = "0.1.0"

_EXPORTS = {
    "ProcessGrid": "hpcml.grid", "Layout": "hpcml.grid",
    "parallelize": "hpcml.parallel", "ParallelConfig": "hpcml.parallel",
    "Trainer": "hpcml.train", "TrainConfig": "hpcml.train", "FieldTrainer": "hpcml.train",
    "FieldTrainConfig": "hpcml.train", "FieldScales": "hpcml.train",
    "train_surrogate": "hpcml.train", "Contract": "hpcml.contract",
    "train_online": "hpcml.train", "OnlineConfig": "hpcml.train", "OnlineResult": "hpcml.train",
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
    from hpcml.train import (FieldScales, FieldTrainConfig, FieldTrainer, OnlineConfig, OnlineResult, TrainConfig,
                             Trainer, train_online, train_surrogate)


__getattr__ = lazy_names(__name__, _EXPORTS, _SUBMODULES)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
