"""Parallelism on the grid with torch-native engines: FSDP2 / DDP on dp, DTensor on tp,
``torch.distributed.pipelining`` on pp, and Ulysses all-to-all attention on cp."""

from hpcml.parallel.api import ParallelModel, parallelize
from hpcml.parallel.config import ParallelConfig, check_plan, split_layers

__all__ = ["ParallelConfig", "ParallelModel", "check_plan", "parallelize", "split_layers"]
