"""What :func:`hpcml.parallel.parallelize` needs to know of a model: its parallel plan.

A model that supports more than data parallelism returns a plan from ``model.parallel_plan()``
(the transformer's lives next to it, in :mod:`hpcml.models.transformer.parallelize`); any
other ``nn.Module`` gets :class:`DataParallelPlan`: DDP or FSDP2 over dp, nothing else. So a
new model (a surrogate, a GNN, a MoE) gets a plan without touching the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.parallel.config import ParallelConfig


class ParallelPlan(Protocol):
    """How each axis applies to one model. Every method but ``check`` runs after
    ``check`` passed on every rank, so only ``check`` may refuse."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    """The loss a pipeline schedule computes on the last stage (None: the model cannot be pipelined)."""

    def check(self, layout: Layout, config: ParallelConfig) -> None:
        """Raise :class:`~hpcml.errors.ConfigError` unless the model fits ``layout`` (no collective)."""

    def stage(self, model: nn.Module, stage: int, n_stages: int, config: ParallelConfig) -> nn.Module:
        """Pipeline stage ``stage`` of ``n_stages`` (parameter names those of the whole model)."""

    def apply_tp(self, part: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> None: ...

    def apply_cp(self, part: nn.Module, group, index: int, count: int) -> None: ...

    def apply_activation_checkpointing(self, part: nn.Module) -> None: ...

    def fsdp_units(self, part: nn.Module) -> list[nn.Module]:
        """Sub-modules sharded as their own FSDP units (the root is one in any case)."""

    def tensor_attrs(self) -> dict[str, dict]:
        """Checkpoint attributes of tensors that are stored differently from their logical form."""


class DataParallelPlan:
    """Any ``nn.Module`` on dp only: replicated (one all-reduce of the gradients) or FSDP2."""

    loss_fn = None

    def __init__(self, model: nn.Module) -> None:
        self.name = type(model).__name__

    def check(self, layout: Layout, config: ParallelConfig) -> None:
        others = {a: d for a, d in layout.degrees.items() if a != "dp" and d > 1}
        if others:
            raise ConfigError(f"{self.name} has no parallel plan for {others}: it runs data-parallel only "
                              f"(give it a parallel_plan() to use other axes)")
        if config.activation_checkpointing or config.sequence_parallel:
            raise ConfigError(f"{self.name} has no parallel plan: activation_checkpointing and sequence_parallel "
                              f"need one (parallel_plan())")

    def stage(self, model, stage, n_stages, config):  # pragma: no cover - check() refuses pp > 1
        raise ConfigError(f"{self.name} cannot be pipelined")

    apply_tp = apply_cp = stage

    def apply_activation_checkpointing(self, part: nn.Module) -> None:  # pragma: no cover - refused by check()
        raise ConfigError(f"{self.name} has no activation checkpointing plan")

    def fsdp_units(self, part: nn.Module) -> list[nn.Module]:
        return []

    def tensor_attrs(self) -> dict[str, dict]:
        return {}


def plan_of(model: nn.Module) -> ParallelPlan:
    """The model's own plan, or the data-parallel one."""
    make = getattr(model, "parallel_plan", None)
    return make() if callable(make) else DataParallelPlan(model)
