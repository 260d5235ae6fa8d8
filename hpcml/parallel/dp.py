"""Data parallelism over the dp (x cp) ranks: FSDP2 sharding, or replication with one
bucketed gradient all-reduce (DDP)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

_WIRE = {"fp32": None, "bf16": torch.bfloat16}


def wire_dtype(reduce_dtype: str) -> torch.dtype | None:
    """``ParallelConfig.reduce_dtype`` as the dtype gradients are cast to for their reduction;
    None: the gradients' own."""
    return _WIRE[reduce_dtype]


def _policy(reduce_dtype: str, param_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """FSDP2's policy: the gathered parameters and compute in ``param_dtype`` (fp32: their own),
    the reduce-scatter (and HSDP's all-reduce) in ``reduce_dtype`` -- fp32 named as such under bf16
    parameters, which FSDP2 would otherwise reduce in."""
    if param_dtype == "fp32":
        return MixedPrecisionPolicy(reduce_dtype=wire_dtype(reduce_dtype))
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=wire_dtype(reduce_dtype) or torch.float32)


def apply_fsdp(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh,
               reshard_after_forward: bool | int = True, reduce_dtype: str = "fp32", param_dtype: str = "fp32") -> None:
    """``fully_shard`` each unit (a transformer block), then the rest of the model (torchtitan's wrapping).

    Parameters already sharded by tensor parallelism become 2-D (dp x tp) DTensors.
    ``reshard_after_forward=False`` keeps each block's parameters gathered until backward
    (ZeRO-2-like), an int N reshards them over N consecutive ranks (hpZ). The root keeps its
    parameters gathered after forward: they are needed first in backward anyway.
    """
    mp = _policy(reduce_dtype, param_dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)


def apply_fsdp_moe(model: nn.Module, units: list[nn.Module], experts: list[nn.Module], mesh: DeviceMesh,
                   expert_mesh: DeviceMesh | None, reshard_after_forward: bool | int = True,
                   reduce_dtype: str = "fp32", param_dtype: str = "fp32") -> None:
    """:func:`apply_fsdp` for a model whose ``experts`` are sharded over ep: each experts module
    is its own unit over the expert-data-parallel mesh (edp; its DTensors on ep make the FSDP
    + EP 2-D layout torchtitan uses). FSDP averages their gradients over edp; they need the
    sum over edp divided by dp x cp, so the engine divides them by ep afterwards (gloo has no
    PREMUL_SUM for ``set_gradient_divide_factor``). With edp 1 (``expert_mesh`` None) the
    experts stay out of FSDP (``ignored_params``)."""
    ignored: set[nn.Parameter] = set()
    mp = _policy(reduce_dtype, param_dtype)
    for ex in experts:
        if expert_mesh is None:
            ignored |= set(ex.parameters())
            continue
        # (hpZ's int counts the dense data ranks of a node: the experts reshard over all of edp)
        fully_shard(ex, mesh=expert_mesh, reshard_after_forward=reshard_after_forward is not False, mp_policy=mp)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params=(ignored & set(unit.parameters())) or None, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None, mp_policy=mp)


def reshard(modules: list[nn.Module]) -> None:
    """Every FSDP2 module in ``modules`` back to its shards. A forward without a backward (an
    evaluation, a prediction) leaves the root's parameters gathered -- full plain tensors in
    ``named_parameters()``, with no optimizer state under their names -- until the next
    backward; whatever reads the shards (a checkpoint, a tournament's swap) calls this first."""
    from torch.distributed.fsdp import FSDPModule

    for part in modules:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


class GradAllReduce:
    """Average gradients over a process group with one flat all-reduce (DDP without hooks).

    Gradients are accumulated locally over all micro-batches and reduced once, after the
    last: one collective per step instead of one per parameter, which matters where every
    collective costs milliseconds. Tensor-parallel DTensor gradients reduce their local shards.
    ``dtype``: what they cross the wire in (bf16: each rank's rounded, summed in bf16, then
    divided in the gradients' own dtype), None: their own.
    """

    def __init__(self, params: list[nn.Parameter], group, group_size: int, divide_by: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.dtype = dtype
        self.group, self.group_size = group, group_size
        self.divide_by = group_size if divide_by is None else divide_by
        """Sum over the group, then divide by this: the group size for a mean; the data ranks
        for experts, whose local gradient already sums the tokens of their ep peers."""

    @torch.no_grad()
    def __call__(self) -> None:
        if self.divide_by == 1 and self.group_size == 1 or not self.params:
            return
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.group_size > 1:
            wire = flat if self.dtype in (None, flat.dtype) else flat.to(self.dtype)
            dist.all_reduce(wire, group=self.group)
            if wire is not flat:
                flat.copy_(wire)
        flat /= self.divide_by
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def broadcast_params(params: list[nn.Parameter], group) -> None:
    """Every rank of ``group`` takes the first rank's parameter values, in one flat broadcast
    (what torch's DDP does at construction: replicas start equal however they were built)."""
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def data_parallel_syncs(params: list[nn.Parameter], expert_params: list[nn.Parameter], grid,
                        data_mesh: DeviceMesh | None, reduce_dtype: str = "fp32") -> list[GradAllReduce]:
    """The gradient reductions of a replicated (DDP) model: dense weights averaged over dp x cp;
    with MoE axes, the experts summed over edp (their replicas) and divided by dp x cp."""
    lay, dtype = grid.layout, wire_dtype(reduce_dtype)
    data = lay.dp * lay.cp
    experts = {id(p) for p in expert_params} if lay.moe else set()  # ep 1: experts are dense weights
    dense = [p for p in params if id(p) not in experts]
    syncs = [GradAllReduce(dense, data_mesh.get_group(), data, dtype=dtype)] if data_mesh is not None else []
    if lay.moe:
        edp_group = grid.torch.expert_mesh.get_group("edp") if lay.edp > 1 else None
        syncs.append(GradAllReduce(expert_params, edp_group, lay.edp, divide_by=data, dtype=dtype))
    return syncs
