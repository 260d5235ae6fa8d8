"""From live training objects to named global tensors and back, with each rank's local piece.

Names are fully qualified names in the unparallelised model: ``model/<fqn>`` for
parameters and ``optim/<fqn>/<state>`` for optimizer state (``exp_avg``, ``exp_avg_sq``,
``step``), so a pipeline or tensor-parallel change only changes which rank holds which piece.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset of the local tensor) for a DTensor or a plain tensor."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
        return local, tuple(t.shape), tuple(offset)
    return t, tuple(t.shape), (0,) * t.dim()


def placement_str(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"{list(t.placements)} over mesh {t.device_mesh.mesh_dim_names}"
    return "replicated"


def model_tensors(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"model/{name}": p for name, p in named_params}


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str],
                      create: bool = False) -> dict[str, torch.Tensor]:
    """``optim/<fqn>/<key>`` for each tensor in the optimizer's per-parameter state.

    ``create=True`` first fills missing AdamW-style state (step, exp_avg, exp_avg_sq) with
    zeros, so a fresh optimizer has tensors to load into.
    """
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in names:
                continue
            state = optimizer.state[p]
            if create and not state and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[p]}/{key}"] = value
    return out


def training_tensors(named_params: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None,
                     create: bool = False) -> dict[str, torch.Tensor]:
    """Everything of the model and optimizer to save (or to load into, with ``create=True``)."""
    named = list(named_params)
    out = model_tensors(named)
    if optimizer is not None:
        out.update(optimizer_tensors(optimizer, {p: n for n, p in named}, create=create))
    return out
