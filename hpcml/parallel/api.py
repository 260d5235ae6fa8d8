"""``parallelize(model, grid, config)``: every axis of the grid applied to a transformer.

Order: pipeline cut (pp) -> tensor parallel (tp) -> Ulysses (cp) -> activation
checkpointing -> data parallel (dp x cp: FSDP2 or one-all-reduce DDP) -> pipeline stages
and schedule. Gradients are averaged over dp x cp: each cp rank's loss is the mean over
its slice of the sequence, so the average is the mean over the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from hpcml import log
from hpcml.grid.mpi import ProcessGrid
from hpcml.models.transformer import Transformer, cross_entropy
from hpcml.parallel import clip, dp, pp, tp
from hpcml.parallel.config import ParallelConfig, check_plan, stage_layers

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
    schedule: object | None = None
    has_first: bool = True
    has_last: bool = True
    grad_sync: dp.GradAllReduce | None = None
    tp_enabled: bool = False
    _params: list[nn.Parameter] = field(default_factory=list)

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the unparallelised model, local parameter), over all local parts."""
        for part in self.parts:
            yield from part.named_parameters()

    def loss_context(self):
        return loss_parallel() if self.tp_enabled else contextlib.nullcontext()

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor, n_micro: int,
                         autocast: contextlib.AbstractContextManager | None = None) -> float | None:
        """Forward and backward over ``n_micro`` micro-batches of this rank's batch; gradients
        accumulate as the mean over them. Returns the mean local loss (None off the last stage)."""
        autocast = autocast or contextlib.nullcontext()
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (tokens,) if self.has_first else ()
            with self.loss_context(), autocast:
                self.schedule.step(*args, target=targets if self.has_last else None,
                                   losses=losses if self.has_last else None)
            return float(torch.stack([loss.detach().float() for loss in losses]).mean()) if self.has_last else None
        model = self.parts[0]
        total = 0.0
        fsdp = self.config.fsdp and hasattr(model, "set_requires_gradient_sync")
        for i, (x, y) in enumerate(zip(tokens.chunk(n_micro), targets.chunk(n_micro))):
            if fsdp:
                model.set_requires_gradient_sync(i == n_micro - 1)  # reduce-scatter once, after the last
            with self.loss_context(), autocast:
                loss = cross_entropy(model(x), y)
                (loss / n_micro).backward()
            total += float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
        return total / n_micro

    def sync_grads(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync()

    def local_sq_grad_norm(self) -> torch.Tensor:
        lay = self.grid.layout
        return clip.local_sq_norm(self._params, lay.world_size, lay.pp)


def parallelize(model: Transformer, grid: ProcessGrid, config: ParallelConfig | None = None, *,
                n_microbatches: int = 1) -> ParallelModel:
    """Apply the grid's axes to ``model`` (built identically on every rank, e.g. same seed).

    Needs ``grid.init_torch()`` first. The plan is checked before any collective.
    ``n_microbatches`` is the pipeline schedule's micro-batch count per step.
    """
    config = config or ParallelConfig()
    lay = grid.layout
    check_plan(model.config, lay, config)
    if grid.torch is None:
        raise RuntimeError("parallelize() needs torch.distributed: call grid.init_torch() first")
    mesh, device = grid.torch.mesh, grid.torch.device
    model = model.to(device)

    stage_ids = [0]
    n_stages = 1
    if lay.pp > 1:
        n_stages = lay.pp * config.n_stages_per_rank
        stage_ids = pp.local_stage_ids(grid.coords["pp"], lay.pp, config.n_stages_per_rank)
        layers = stage_layers(model.config, lay, config)
        parts = [pp.cut_stage(model, layers[s], first=s == 0, last=s == n_stages - 1) for s in stage_ids]
    else:
        parts = [model]

    cp_group = mesh.get_group("cp") if lay.cp > 1 else None
    data_mesh = dp_mesh(mesh, lay)
    for part in parts:
        if lay.tp > 1:
            tp.apply_tp(part, mesh["tp"], config.sequence_parallel)
        part.cp_rank, part.cp_size = grid.coords["cp"], lay.cp
        for block in part.layers.values():
            block.attention.cp_group = cp_group
            block.activation_checkpointing = config.activation_checkpointing
        if config.fsdp and data_mesh is not None:
            dp.apply_fsdp(part, data_mesh, config.reshard_after_forward)

    params = [p for part in parts for p in part.parameters()]
    result = ParallelModel(parts=parts, grid=grid, config=config, tp_enabled=lay.tp > 1, _params=params,
                           has_first=0 in stage_ids, has_last=n_stages - 1 in stage_ids)
    if data_mesh is not None and not config.fsdp:
        result.grad_sync = dp.GradAllReduce(params, data_mesh.get_group(), lay.dp * lay.cp)
    if lay.pp > 1:
        result.schedule = pp.build_schedule(parts, stage_ids, n_stages, device, mesh.get_group("pp"),
                                            config.pp_schedule, n_microbatches, cross_entropy)
    logger.info("parallelized: %s, %s, %d local part(s), %d local parameters", lay.describe_degrees(),
                "fsdp" if config.fsdp else "ddp", len(parts), sum(p.numel() for p in params))
    return result


__all__ = ["ParallelModel", "parallelize", "dp_mesh"]
