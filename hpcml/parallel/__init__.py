"""Parallelism on the grid with torch-native engines: FSDP2 / DDP on dp, DTensor on tp,
``torch.distributed.pipelining`` on pp, Ulysses all-to-all attention on cp -- applied to a
model by its plan (:mod:`hpcml.parallel.model_plan`). Imports no model.

Names load on first use: ``hpcml.parallel.config`` (the choices and the layer split) is pure
arithmetic that the planner reads without torch."""

from __future__ import annotations

from hpcml.lazy import lazy_names

_WHERE = {"ParallelModel": "api", "parallelize": "api", "ParallelConfig": "config", "split_layers": "config",
          "DataParallelPlan": "model_plan", "ParallelPlan": "model_plan"}

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)
