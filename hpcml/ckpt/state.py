"""From live training objects to named global tensors and back, with each rank's local piece.

Names are fully qualified names in the unparallelised model: ``model/<fqn>`` for
parameters and ``optim/<fqn>/<state>`` for optimizer state (``exp_avg``, ``exp_avg_sq``,
``step``), so a pipeline or tensor-parallel change only changes which rank holds which piece.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

#: Mesh dimensions whose ``Shard(fused_dim)`` of a fused tensor (QKV, gate/up) holds every
#: sub-parameter's own slice, ``[wq_r; wk_r; wv_r]`` (tensor parallelism). A shard on any
#: other mesh dimension (FSDP's ``dp``, ``dp_cp``) or a ``_StridedShard`` cuts the rows as
#: they are. On a mesh without dimension names every ``Shard(fused_dim)`` counts.
FUSED_AXES = ("tp",)


def local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset of the local tensor) for a DTensor or a plain tensor."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
        return local, tuple(t.shape), tuple(offset)
    return t, tuple(t.shape), (0,) * t.dim()


def fused_shards(t: torch.Tensor, dim: int) -> int:
    """How many tensor-parallel shards interleave the sub-parameters of fused tensor ``t``
    along ``dim`` (1 for a plain tensor, a replicated or an FSDP-only DTensor); see :data:`FUSED_AXES`."""
    if not isinstance(t, DTensor):
        return 1
    names = t.device_mesh.mesh_dim_names
    n = 1
    for i, p in enumerate(t.placements):
        if type(p) is Shard and p.dim % max(t.dim(), 1) == dim and (names is None or names[i] in FUSED_AXES):
            n *= t.device_mesh.size(i)
    return n


def fused_attrs(fused: dict[str, Sequence[int]], dim: int = 0,
                states: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> dict[str, dict]:
    """``tensor_attrs`` declaring fused parameters (fqn -> sub-parameter widths along ``dim``)
    and their optimizer state of the same shape, for :func:`hpcml.ckpt.save` and :func:`hpcml.ckpt.load`::

        fused_attrs({"layers.0.attention.wqkv.weight": [8 * hd, 2 * hd, 2 * hd]})
    """
    out = {}
    for fqn, widths in fused.items():
        a = {"fused_widths": [int(w) for w in widths], "fused_dim": int(dim)}
        out[f"model/{fqn}"] = a
        out.update({f"optim/{fqn}/{s}": dict(a) for s in states})
    return out


def placement_str(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"{list(t.placements)} over mesh {t.device_mesh.mesh_dim_names}"
    return "replicated"


def model_tensors(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"model/{name}": p for name, p in named_params}


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str],
                      create: bool = False) -> dict[str, torch.Tensor]:
    """``optim/<fqn>/<key>`` for each tensor in the optimizer's per-parameter state.

    Missing AdamW-style state (before the first step) is zeros (step, exp_avg, exp_avg_sq):
    ``create=True`` puts them into the optimizer, so a fresh one has tensors to load into;
    otherwise they are only returned, for a save.
    """
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in names:
                continue
            state = optimizer.state[p]
            if not state and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                zeros = {"step": torch.zeros((), dtype=torch.float32),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                if create:
                    state.update(zeros)
                else:
                    state = zeros
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[p]}/{key}"] = value
    return out


def training_tensors(named_params: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None,
                     create: bool = False) -> dict[str, torch.Tensor]:
    """Everything of the model and optimizer to save (or to load into, with ``create=True``).

    AdamW's state is created by its first step; a save before it (a stop that came during
    start-up) writes the zero state AdamW would create -- without touching the optimizer --
    so that checkpoint resumes like any other."""
    named = list(named_params)
    out = model_tensors(named)
    if optimizer is not None:
        out.update(optimizer_tensors(optimizer, {p: n for n, p in named}, create=create))
    return out
