"""The MoE part of the transformer's plan: experts sharded over ep (and tp) as DTensors, so
every rank holds ``E / ep`` experts under their global index (a checkpoint stores row e of
``experts.w1`` as expert e, whatever the layout); the dispatch over the ep group; the
groups the routing statistics and the expert tensor parallelism use."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from hpcml.models.transformer.moe import moe_layers
from hpcml.parallel.ep import AllToAllDispatch

#: The hidden (tensor-parallel) dimension of each stacked expert weight.
HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}


def expert_mesh(grid) -> tuple[DeviceMesh | None, tuple[str, ...]]:
    """The mesh the experts are sharded over and its axes: (ep, etp) of the expert mesh, or
    the dense tp mesh when ep is 1; (None, ()) on one rank per expert set."""
    lay, td = grid.layout, grid.torch
    if lay.ep > 1:
        names = ("ep", "etp") if lay.etp > 1 else ("ep",)
        return td.expert_mesh[names if len(names) > 1 else names[0]], names
    if lay.tp > 1:
        return td.mesh["tp"], ("etp",)
    return None, ()


def apply_moe(part: nn.Module, grid, data_mesh: DeviceMesh | None) -> list[nn.Parameter]:
    """Shard, wire and return the expert parameters of every MoE layer of ``part`` (no collective:
    every rank built the same full weights, and keeps its slice)."""
    lay = grid.layout
    mesh, names = expert_mesh(grid)
    params: list[nn.Parameter] = []
    for moe in moe_layers(part):
        moe.data_group = data_mesh.get_group() if data_mesh is not None else None
        if lay.cp > 1:
            moe.cp_group, moe.cp_ranks = grid.torch.mesh.get_group("cp"), lay.cp
        if lay.tp > 1:
            moe.tp_group = grid.torch.mesh.get_group("tp")
        if lay.ep > 1:
            moe.dispatch = AllToAllDispatch(grid.torch.expert_mesh.get_group("ep"), lay.ep, grid.coords["ep"],
                                            moe.n_experts)
        if mesh is not None:
            for name, hidden_dim in HIDDEN_DIM.items():
                full = getattr(moe.experts, name)
                placements = [Shard(0) if n == "ep" else Shard(hidden_dim) for n in names]
                sharded = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
                moe.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        params += list(moe.experts.parameters())
    return params


__all__ = ["HIDDEN_DIM", "apply_moe", "expert_mesh"]
