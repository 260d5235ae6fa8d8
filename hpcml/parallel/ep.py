"""Expert parallelism: the all-to-all token dispatch torch lacks, and the two tensor-parallel
region functions an expert-parallel MoE needs around its experts.

Dispatch on the ``ep`` group (Megatron's AllToAll token dispatcher, torch-native): each rank
holds ``E / ep`` experts; its permuted tokens are grouped by global expert, so the tokens
for rank j are one contiguous run. One all-to-all tells every rank how many tokens it gets
for each of its experts, a second (``all_to_all_single`` with uneven splits, differentiable)
moves the tokens; the local experts run on them regrouped by expert, and the reverse
all-to-all brings the outputs home in the original order. Per layer and rank, forward moves
``2 * T_sent * dim`` elements off the rank (dispatch and combine), ``T_sent`` the
assignments routed to other ranks' experts: ``N * k * (ep - 1) / ep`` under balanced routing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor (differentiable), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: sum the gradients over ``group`` (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: sum over ``group``. Backward: identity (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``in_splits[j]`` of ``x`` go to rank j; ``out_splits[j]`` rows arrive from it (differentiable)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatch(nn.Module):
    """Tokens to the experts of the ``ep`` group and back (see the module docstring).

    ``sent_bytes`` counts what forward hands to other ranks (dispatch plus combine; the
    rows a rank keeps are not counted), the figure the benchmark compares with theory.
    """

    def __init__(self, group, ep: int, ep_rank: int, n_experts: int) -> None:
        super().__init__()
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.local = n_experts // ep
        self.sent_bytes = 0

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        send = counts.reshape(self.ep, self.local).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [source rank, local expert]
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        row_bytes = tokens.shape[1] * tokens.element_size()
        self.sent_bytes += (sum(in_splits) - in_splits[self.ep_rank] + sum(out_splits) - out_splits[self.ep_rank]) \
            * row_bytes
        got = all_to_all(tokens, out_splits, in_splits, self.group)
        # arrived ordered by source rank, then local expert: regroup by local expert (stable)
        expert_of_row = torch.repeat_interleave(torch.arange(self.local, device=tokens.device).repeat(self.ep),
                                                recv.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        y = experts(got[order], recv.sum(0).tolist())
        back = torch.empty_like(y).index_copy(0, order, y) if y.shape[0] else y
        return all_to_all(back, in_splits, out_splits, self.group)


__all__ = ["AllToAllDispatch", "all_to_all", "copy_to_group", "local_tensor", "reduce_from_group"]
