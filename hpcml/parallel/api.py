"""``parallelize(model, grid, config)``: every axis of the grid applied to a model, by its plan.

Order: pipeline cut (pp) -> tensor parallel (tp) -> context parallel (cp) -> activation
checkpointing -> data parallel (dp x cp: FSDP2 or one-all-reduce DDP) -> pipeline stages
and schedule. What each step does to the model is its plan's (:mod:`hpcml.parallel.model_plan`;
the transformer's is :mod:`hpcml.models.transformer.parallelize`); the order, the meshes
and the engines are here. Gradients are averaged over dp x cp: each cp rank's loss is the
mean over its slice of the sequence, so the average is the mean over the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from hpcml import log
from hpcml.errors import ConfigError, LaunchError
from hpcml.grid.mpi import ProcessGrid
from hpcml.parallel import clip, dp, hsdp, pp, zeropp
from hpcml.parallel.config import ParallelConfig, pipeline_refuses
from hpcml.parallel.model_plan import DataParallelPlan, ParallelPlan, checked_plan, plan_of

logger = log.get_logger(__name__)


def dp_mesh(mesh: DeviceMesh, layout) -> DeviceMesh | None:
    """The 1-D mesh of the gradient-reduction group dp x cp (None when it is one rank)."""
    if layout.dp * layout.cp == 1:
        return None
    if layout.cp == 1:
        return mesh["dp"]
    if layout.dp == 1:
        return mesh["cp"]
    try:
        return mesh["dp_cp"]  # flattened before on this (cached) mesh
    except KeyError:
        return mesh["dp", "cp"]._flatten("dp_cp")


@dataclass(kw_only=True)
class ParallelModel:
    """The local parts of a parallelised model and how to run a step on them."""

    parts: list[nn.Module]
    """Model chunks on this rank: one, or several pipeline stages under an interleaved schedule."""
    grid: ProcessGrid
    config: ParallelConfig
    plan: ParallelPlan
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(output, targets) -> mean loss over the micro-batch."""
    schedule: object | None = None
    has_first: bool = True
    has_last: bool = True
    grad_syncs: list[dp.GradAllReduce] = field(default_factory=list)
    tp_enabled: bool = False
    computes_loss: bool = False
    """The model's forward takes ``targets=`` and returns the loss (its plan's :meth:`computes_loss`)."""
    comm_bytes: hsdp.CommBytes | None = None
    """FSDP's collectives' bytes inside and across nodes (None without FSDP)."""
    _params: list[nn.Parameter] = field(default_factory=list)
    _pipeline_warm: bool = False

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def take_comm_bytes(self) -> dict[str, int]:
        """Bytes this rank's FSDP collectives sent inside and across nodes since the last call."""
        return self.comm_bytes.take() if self.comm_bytes is not None else {}

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the unparallelised model, local parameter), over all local parts."""
        for part in self.parts:
            yield from part.named_parameters()

    def reshard(self) -> None:
        """FSDP's parameters back to their shards after a forward without backward (:func:`dp.reshard`)."""
        dp.reshard(self.parts)

    def loss_context(self):
        return loss_parallel() if self.tp_enabled else contextlib.nullcontext()

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def forward_backward(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor,
                         n_micro: int = 1, autocast: contextlib.AbstractContextManager | None = None,
                         every_stage: dict[str, torch.Tensor] | None = None) -> float | None:
        """Forward and backward over ``n_micro`` micro-batches of this rank's batch (``inputs``:
        the model's one input or a tuple of them); gradients accumulate as the mean over them.
        ``every_stage``: keyword inputs [batch, ...] every pipeline stage takes (a document
        mask's ids), cut into the same micro-batches. Returns the mean local loss (None off the
        last stage)."""
        autocast = autocast or contextlib.nullcontext()
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        kw = every_stage or {}
        if self.schedule is not None:
            if self.plan.stat_names and not self._pipeline_warm:
                # torch's pipeline infers stage shapes by running the first micro-batches once
                # more: run a throw-away step, so statistics the model keeps (MoE loads) stay exact
                with self.loss_context(), autocast:
                    self.schedule.step(*(inputs if self.has_first else ()), target=targets if self.has_last else None,
                                       losses=[] if self.has_last else None, **kw)
                for part in self.parts:
                    part.zero_grad(set_to_none=True)
                    self.plan.reset_stats(part)
            self._pipeline_warm = True
            losses: list[torch.Tensor] = []
            args = inputs if self.has_first else ()
            with self.loss_context(), autocast:
                self.schedule.step(*args, target=targets if self.has_last else None,
                                   losses=losses if self.has_last else None, **kw)
            return float(torch.stack([loss.detach().double() for loss in losses]).mean()) if self.has_last else None
        model = self.parts[0]
        self.plan.set_grad_scale(model, 1.0 / n_micro)  # losses the model adds through its gradients follow the mean
        total = 0.0
        fsdp = self.config.fsdp and hasattr(model, "set_requires_gradient_sync")
        every = self.config.grad_sync != "step"  # reduce-scatter each micro-batch's, or once after the last
        hsdp = fsdp and every and self.config.dp_replicate != 1  # (dp_replicate "node" or > 1)
        for i, (x, y, k) in enumerate(_micro_batches(inputs, targets, kw, n_micro)):
            if fsdp:
                model.set_requires_gradient_sync(every or i == n_micro - 1)
            if hsdp:  # reduce-scatter inside the replica each micro-batch, all-reduce across replicas (the
                # nodes) once, after the last: FSDP2 sums the shards meanwhile (``set_requires_all_reduce``)
                model.set_requires_all_reduce(i == n_micro - 1)
            with self.loss_context(), autocast:
                loss = model(*x, targets=y, **k) if self.computes_loss else self.loss_fn(model(*x, **k), y)
                (loss / n_micro).backward()
            total += float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
        return total / n_micro

    @torch.no_grad()
    def forward_loss(self, inputs: torch.Tensor | tuple[torch.Tensor, ...], targets: torch.Tensor, n_micro: int = 1,
                     autocast: contextlib.AbstractContextManager | None = None,
                     every_stage: dict[str, torch.Tensor] | None = None) -> float | None:
        """The mean local loss over ``n_micro`` micro-batches, forward only (validation): no
        gradient, nothing the model keeps for a step changed (None off the last stage)."""
        autocast = autocast or contextlib.nullcontext()
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        kw = every_stage or {}
        try:
            if self.schedule is not None:
                losses: list[torch.Tensor] = []
                with self.loss_context(), autocast:
                    self.schedule.eval(*(inputs if self.has_first else ()), target=targets if self.has_last else None,
                                       losses=losses if self.has_last else None, **kw)
                return float(torch.stack([x.detach().double() for x in losses]).mean()) if self.has_last else None
            model, total = self.parts[0], 0.0
            for x, y, k in _micro_batches(inputs, targets, kw, n_micro):
                with self.loss_context(), autocast:
                    loss = model(*x, targets=y, **k) if self.computes_loss else self.loss_fn(model(*x, **k), y)
                total += float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
            return total / n_micro
        finally:
            if self.plan.stat_names:  # a model's step statistics (MoE loads) count training batches only
                for part in self.parts:
                    self.plan.reset_stats(part)

    def sync_grads(self) -> None:
        """Make this step's gradients final: the data-parallel reductions, and the tp partial sums."""
        for sync in self.grad_syncs:
            sync()
        clip.reduce_partial_grads(self._params)

    def after_step(self) -> None:
        """After the optimizer step: the plan's per-step updates (MoE balancing biases)."""
        for part in self.parts:
            self.plan.after_step(part)

    @property
    def stat_names(self) -> tuple[str, ...]:
        return tuple(self.plan.stat_names)

    def step_stats(self) -> list[float]:
        """This rank's shares of the plan's statistics of the last step (:attr:`stat_names`, e.g.
        MoE balancing losses): summed over all ranks, they are the step's values."""
        out = [0.0] * len(self.stat_names)
        for part in self.parts if out else ():
            shares = self.plan.step_stats(part, self.grid.layout)
            out = [o + shares[k] for o, k in zip(out, self.stat_names)]
        return out

    def local_sq_grad_norm(self) -> torch.Tensor:
        lay = self.grid.layout
        return clip.local_sq_norm(self._params, lay.world_size, lay.pp)


def _micro_batches(inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, kw: dict[str, torch.Tensor],
                   n_micro: int) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor, dict[str, torch.Tensor]]]:
    """(inputs, targets, keyword inputs) of each of ``n_micro`` micro-batches, cut along the batch."""
    cut = {name: t.chunk(n_micro) for name, t in kw.items()}
    for i, (*x, y) in enumerate(zip(*(t.chunk(n_micro) for t in inputs), targets.chunk(n_micro))):
        yield tuple(x), y, {name: parts[i] for name, parts in cut.items()}


def parallelize(model: nn.Module, grid: ProcessGrid, config: ParallelConfig | None = None, *,
                n_microbatches: int = 1, loss_fn: Callable | None = None,
                plan: ParallelPlan | None = None) -> ParallelModel:
    """Apply the grid's axes to ``model`` (built identically on every rank, e.g. same seed).

    ``plan`` defaults to the model's own (``model.parallel_plan()``), else data parallelism
    only; ``loss_fn`` to the plan's. Needs ``grid.init_torch()`` first. The plan is checked
    before any collective. ``n_microbatches`` is the pipeline schedule's micro-batch count per step.
    """
    config = config or ParallelConfig()
    plan = checked_plan(plan) if plan is not None else plan_of(model)
    lay = grid.layout
    plan.check(lay, config)
    why = pipeline_refuses(config, lay.pp)
    if why:
        raise ConfigError(why)
    if config.loss_chunk and (loss_fn is not None or not plan.computes_loss(config)):
        raise ConfigError(f"loss_chunk {config.loss_chunk} with {type(model).__name__}"
                          + (" and a loss_fn given" if loss_fn is not None else "") + ": the chunked loss is the "
                          "model's own (hpcml's Transformer, its loss computed inside its forward)")
    n_replicas = hsdp.replicas(grid, config)  # the node map's checks, before any collective
    hsdp.hpz_size(grid, config)
    zeropp.check(grid, config)
    computes_loss = loss_fn is None and lay.pp == 1 and plan.computes_loss(config)
    loss_fn = loss_fn or plan.loss_fn
    if loss_fn is None:
        raise ConfigError(f"parallelize({type(model).__name__}): its plan has no loss; pass loss_fn=")
    if grid.torch is None:
        raise LaunchError("parallelize() needs torch.distributed: call grid.init_torch() first")
    mesh, device = grid.torch.mesh, grid.torch.device
    hybrid = hsdp.hybrid_meshes(grid, n_replicas) if n_replicas > 1 else None  # HSDP: tp and FSDP on one root
    model = model.to(device)

    stage_ids = [0]
    n_stages = 1
    if lay.pp > 1:
        n_stages = lay.pp * config.n_stages_per_rank
        stage_ids = pp.local_stage_ids(grid.coords["pp"], lay.pp, config.n_stages_per_rank)
        parts = [plan.stage(model, s, n_stages, config) for s in stage_ids]
    else:
        parts = [model]

    data_mesh = hybrid.data if hybrid else dp_mesh(mesh, lay)
    if isinstance(plan, DataParallelPlan) and data_mesh is not None:  # a plain module: start equal, as DDP does
        dp.broadcast_params(list(model.parameters()), data_mesh.get_group())
    expert_params: list[nn.Parameter] = []
    for part in parts:
        if lay.tp > 1:
            plan.apply_tp(part, hybrid.tp if hybrid else mesh["tp"], config)
        expert_params += plan.apply_moe(part, grid, data_mesh)
        if config.loss_chunk:
            plan.apply_loss_chunk(part, config.loss_chunk)
        if config.fpdt_chunk:
            plan.apply_fpdt(part, mesh.get_group("cp") if lay.cp > 1 else None, grid.coords["cp"], lay.cp,
                            config.fpdt_chunk)
        elif lay.cp > 1 and config.cp_kind == "allgather":
            plan.apply_cp_allgather(part, mesh.get_group("cp"), grid.coords["cp"], lay.cp)
        elif lay.cp > 1:
            plan.apply_cp(part, mesh.get_group("cp"), grid.coords["cp"], lay.cp)
        if config.activation_checkpointing:
            plan.apply_activation_checkpointing(part)
        if config.fsdp and data_mesh is not None:
            plan.apply_fsdp(part, grid, hybrid.fsdp if hybrid else data_mesh, config)

    params = [p for part in parts for p in part.parameters()]  # after FSDP: its sharded parameters
    result = ParallelModel(parts=parts, grid=grid, config=config, plan=plan, loss_fn=loss_fn,
                           tp_enabled=lay.tp > 1, _params=params, computes_loss=computes_loss,
                           has_first=0 in stage_ids, has_last=n_stages - 1 in stage_ids)
    if not config.fsdp:
        result.grad_syncs = dp.data_parallel_syncs(params, expert_params, grid, data_mesh, config.reduce_dtype)
    elif data_mesh is not None:
        result.grad_syncs = plan.fsdp_grad_syncs(parts, lay)
        result.comm_bytes = hsdp.CommBytes(grid)
        gather, scatter = zeropp.collectives(grid, config, result.comm_bytes)
        hsdp.install(parts, gather, scatter, result.comm_bytes,
                     hybrid.fsdp.get_group("dp_replicate") if hybrid else None)
    if lay.pp > 1:
        result.schedule = pp.build_schedule(parts, stage_ids, n_stages, device, mesh.get_group("pp"),
                                            config.pp_schedule, n_microbatches, loss_fn)
    logger.info("parallelized %s: %s, %s, %d local part(s), %d local parameters", type(model).__name__,
                lay.describe_degrees(), "fsdp" if config.fsdp else "ddp", len(parts), sum(p.numel() for p in params))
    return result


__all__ = ["ParallelModel", "dp_mesh", "parallelize"]
