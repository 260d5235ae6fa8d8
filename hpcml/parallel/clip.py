"""Gradient-norm clipping that is correct over any mix of sharded, tensor-parallel and
pipeline-split parameters, with a single all-reduce."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Sum the gradients that are still partial sums over a mesh (a replicated norm weight used on
    sequence-sharded inputs under sequence parallelism), on every rank of it alike: the norm of
    the parts is not the norm of their sum, and the optimizer would sum them anyway."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])


def local_sq_norm(params: list[nn.Parameter], world_size: int, pp: int) -> torch.Tensor:
    """This rank's share of the global squared gradient norm.

    Summed over every rank of the world, the shares give the squared norm of the full
    gradient: each local gradient block counts once, divided by the number of ranks that
    hold an identical copy of it -- ``world / pp`` for a plain (replicated) tensor, divided
    further by the number of distinct shards of a DTensor (FSDP and tp placements).
    Pipeline stages hold disjoint parameters, so they simply add. Partial-sum gradients must
    have been reduced first (:func:`reduce_partial_grads`, ``ParallelModel.sync_grads``).
    """
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        distinct = 1
        if isinstance(g, DTensor):
            # any non-replicated placement splits the tensor (_StridedShard of FSDP over tp is no Shard subclass)
            distinct = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
        by_copies[world_size // pp // distinct].append(_local(g).detach())
    total = torch.zeros((), dtype=torch.float64)
    for copies, grads in by_copies.items():
        norms = torch._foreach_norm(grads)  # fused, fp32, no copies of the gradients
        total += torch.stack(norms).double().pow(2).sum().cpu() / copies
    return total


@torch.no_grad()
def scale_grads(params: list[nn.Parameter], total_norm: float, max_norm: float) -> float:
    """Scale gradients so the global norm is at most ``max_norm``; returns the factor applied."""
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_([_local(p.grad) for p in params if p.grad is not None], coef)
    return coef
