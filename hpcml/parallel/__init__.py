"""Parallelism on the grid with torch-native engines: FSDP2 / DDP on dp, DTensor on tp,
``torch.distributed.pipelining`` on pp, Ulysses all-to-all attention on cp -- applied to a
model by its plan (:mod:`hpcml.parallel.plan`). Imports no model."""

from hpcml.parallel.api import ParallelModel, parallelize
from hpcml.parallel.config import ParallelConfig, split_layers
from hpcml.parallel.plan import DataParallelPlan, ParallelPlan

__all__ = ["DataParallelPlan", "ParallelConfig", "ParallelModel", "ParallelPlan", "parallelize", "split_layers"]
