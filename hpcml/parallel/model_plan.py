"""What :func:`hpcml.parallel.parallelize` needs to know of a model: its parallel plan.

A model that supports more than data parallelism returns a :class:`ParallelPlan` subclass
from ``model.parallel_plan()`` (the transformer's lives next to it, in
:mod:`hpcml.models.transformer.parallelize`); any other ``nn.Module`` gets
:class:`DataParallelPlan`: DDP or FSDP2 over dp, nothing else. ``parallelize`` calls only the
members of :class:`ParallelPlan`, each with a default, so a new model (a surrogate, a GNN, a
MoE) overrides what it supports and nothing else, without touching the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.parallel import dp, hsdp
from hpcml.parallel.config import ParallelConfig

#: The member a plan overrides to support each axis (and ``check`` refuses the axis without it).
AXIS_MEMBERS = {"tp": "apply_tp", "cp": "apply_cp", "pp": "stage", "ep": "apply_moe"}


class ParallelPlan:
    """How each axis applies to one model. Every member but ``check`` runs after ``check``
    passed on every rank, so only ``check`` may refuse. The defaults: no axis but dp (the
    default ``check`` refuses an axis whose member is not overridden), FSDP over the whole
    model, no experts, no statistics, no per-step hooks."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """The loss a pipeline schedule computes on the last stage (None: the model cannot be pipelined)."""
    stat_names: tuple[str, ...] = ()
    """Per-step statistics :meth:`step_stats` gives (the training loop's metrics)."""

    # -- refusing what the model cannot do: before any collective --------------------------------
    def check(self, layout: Layout, config: ParallelConfig) -> None:
        """Raise :class:`~hpcml.errors.ConfigError` unless the model fits ``layout`` (no collective)."""
        name = type(self).__name__
        missing = {a: layout.degrees[a] for a, member in AXIS_MEMBERS.items()
                   if layout.degrees.get(a, 1) > 1 and not self.supports(member)}
        if missing:
            members = ", ".join(AXIS_MEMBERS[a] for a in missing)
            raise ConfigError(f"{name} does not implement {members}: it cannot run {missing} (override them)")
        if layout.pp > 1 and self.loss_fn is None:
            raise ConfigError(f"{name} has no loss_fn: a pipeline computes the loss on its last stage")
        if config.activation_checkpointing and not self.supports("apply_activation_checkpointing"):
            raise ConfigError(f"{name} does not implement apply_activation_checkpointing")
        if config.sequence_parallel and not self.supports("apply_tp"):
            raise ConfigError(f"{name} does not implement apply_tp: sequence_parallel is part of it")
        if layout.cp > 1 and config.cp_kind == "allgather" and not self.supports("apply_cp_allgather"):
            raise ConfigError(f"{name} does not implement apply_cp_allgather: it cannot run cp_kind allgather")
        if config.fpdt_chunk and not self.supports("apply_fpdt"):
            raise ConfigError(f"{name} does not implement apply_fpdt: it cannot run fpdt_chunk {config.fpdt_chunk}")

    def supports(self, member: str) -> bool:
        """Whether this plan overrides ``member`` of :class:`ParallelPlan`."""
        return getattr(type(self), member) is not getattr(ParallelPlan, member)

    # -- the axes --------------------------------------------------------------------------------
    def stage(self, model: nn.Module, stage: int, n_stages: int, config: ParallelConfig) -> nn.Module:
        """Pipeline stage ``stage`` of ``n_stages`` (parameter names those of the whole model)."""
        raise ConfigError(f"{type(self).__name__} cannot be pipelined")  # check() refuses pp first

    def apply_tp(self, part: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> None:
        raise ConfigError(f"{type(self).__name__} has no tensor-parallel plan")

    def apply_cp(self, part: nn.Module, group, index: int, count: int) -> None:
        """Rank ``index`` of ``count`` on the cp ``group``, holding a contiguous slice of the sequence."""
        raise ConfigError(f"{type(self).__name__} has no context-parallel plan")

    def apply_cp_allgather(self, part: nn.Module, group, index: int, count: int) -> None:
        """:meth:`apply_cp` with keys and values all-gathered (``ParallelConfig.cp_kind`` allgather)."""
        raise ConfigError(f"{type(self).__name__} has no all-gather context-parallel plan")

    def apply_fpdt(self, part: nn.Module, group, index: int, count: int, chunk: int) -> None:
        """FPDT instead of :meth:`apply_cp` (``ParallelConfig.fpdt_chunk``): rank ``index`` of
        ``count`` holds strided chunks of ``chunk`` positions (:func:`hpcml.parallel.fpdt.local_positions`,
        the trainer slices tokens and labels by it); ``group`` is None on cp 1 (chunking alone)."""
        raise ConfigError(f"{type(self).__name__} has no FPDT plan")

    def apply_loss_chunk(self, part: nn.Module, chunk: int) -> None:
        """The model's loss ``chunk`` positions at a time (``ParallelConfig.loss_chunk``)."""
        raise ConfigError(f"{type(self).__name__} has no chunked loss")

    def computes_loss(self, config: ParallelConfig) -> bool:
        """Whether the model's forward takes ``targets=`` and returns the mean loss itself (FPDT's
        chunked logits + loss: the vocabulary-sized logits are never whole). Not under pp, and
        not when ``parallelize`` is given a ``loss_fn`` of the caller's."""
        return False

    def apply_activation_checkpointing(self, part: nn.Module) -> None:
        raise ConfigError(f"{type(self).__name__} has no activation checkpointing plan")

    def apply_moe(self, part: nn.Module, grid, data_mesh: DeviceMesh | None) -> list[nn.Parameter]:
        """Shard the experts over ep; the expert parameters (their gradients reduce over edp)."""
        return []

    def expert_modules(self, part: nn.Module) -> list[nn.Module]:
        """Modules holding experts: FSDP units of their own over edp."""
        return []

    # -- data parallelism ------------------------------------------------------------------------
    def fsdp_units(self, part: nn.Module) -> list[nn.Module]:
        """Sub-modules sharded as their own FSDP units (the root is one in any case)."""
        return []

    def apply_fsdp(self, part: nn.Module, grid, data_mesh: DeviceMesh, config: ParallelConfig) -> None:
        """FSDP2 over dp x cp (``data_mesh`` 2-D under HSDP: replicate, shard); with experts laid
        out apart (ep, or etp != tp), the experts over edp. hpZ: reshard after forward to a node's ranks."""
        reshard = hsdp.hpz_size(grid, config)
        if grid.layout.moe:
            edp = grid.torch.expert_mesh["edp"] if grid.layout.edp > 1 else None
            dp.apply_fsdp_moe(part, self.fsdp_units(part), self.expert_modules(part), data_mesh, edp, reshard,
                              config.reduce_dtype, config.param_dtype)
        else:
            dp.apply_fsdp(part, self.fsdp_units(part), data_mesh, reshard, config.reduce_dtype, config.param_dtype)

    def fsdp_grad_syncs(self, parts: list[nn.Module], layout: Layout) -> list[dp.GradAllReduce]:
        """What FSDP leaves to reduce: the experts' gradients, FSDP's mean over edp turned into the
        sum over edp / (dp x cp) the dense parameters get."""
        if not layout.moe:
            return []
        sharded = [p for part in parts for ex in self.expert_modules(part) for p in ex.parameters()]
        return [dp.GradAllReduce(sharded, None, 1, divide_by=layout.dp * layout.cp // layout.edp)]

    # -- per step --------------------------------------------------------------------------------
    def set_grad_scale(self, part: nn.Module, scale: float) -> None:
        """Losses the model adds through its gradients (MoE balancing) follow the micro-batch mean."""

    def reset_stats(self, part: nn.Module) -> None:
        """Forget the statistics of forwards that were no training (a pipeline's shape inference)."""

    def step_stats(self, part: nn.Module, layout: Layout) -> dict[str, float]:
        """This rank's shares of the step's :attr:`stat_names` (summed over ranks: the step's values)."""
        return {}

    def after_step(self, part: nn.Module) -> None:
        """After the optimizer step (MoE balancing biases)."""

    # -- checkpoints -----------------------------------------------------------------------------
    def tensor_attrs(self) -> dict[str, dict]:
        """Checkpoint attributes of tensors that are stored differently from their logical form."""
        return {}


class DataParallelPlan(ParallelPlan):
    """Any ``nn.Module`` on dp only: replicated (one all-reduce of the gradients) or FSDP2."""

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


def plan_of(model: nn.Module) -> ParallelPlan:
    """The model's own plan, or the data-parallel one. A plan must be a :class:`ParallelPlan`:
    its defaults are what ``parallelize`` calls for what the model does not override."""
    make = getattr(model, "parallel_plan", None)
    return checked_plan(make() if callable(make) else DataParallelPlan(model))


def checked_plan(plan) -> ParallelPlan:
    if not isinstance(plan, ParallelPlan):
        raise ConfigError(f"parallel plan {type(plan).__name__}: expected a subclass of hpcml.parallel.ParallelPlan "
                          f"(its defaults cover every member parallelize() calls)")
    return plan
