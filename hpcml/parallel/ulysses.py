"""Ulysses sequence parallelism: an all-to-all around attention (torch has none).

Each of the P ranks of a cp group holds a contiguous slice of the sequence. Before
attention, an all-to-all turns q, k, v from [B, S/P, H, D] into [B, S, H/P, D] -- the whole
sequence for a slice of the heads -- so attention itself is the ordinary one; after it the
inverse all-to-all returns [B, S/P, H, D]. Per rank and layer this moves 4 * B*S*H*D/P
elements (q, k, v, output) times (P-1)/P over the network, against Megatron-SP's 4 B*S*h.
Grouped-query attention needs the kv heads divisible by P too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpcml.parallel.ep import all_to_all


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` into P chunks along ``scatter_dim``, send chunk j to rank j, concatenate the
    received along ``gather_dim`` (differentiable: the even-split case of :func:`ep.all_to_all`)."""
    p = dist.get_world_size(group)
    chunks = all_to_all(torch.stack(x.chunk(p, dim=scatter_dim)), [1] * p, [1] * p, group)
    return torch.cat(chunks.unbind(0), dim=gather_dim)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] -> [B, S, H/P, D] over ``group`` (differentiable)."""
    return _all_to_all(x, 2, 1, group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H/P, D] -> [B, S/P, H, D] over ``group`` (differentiable)."""
    return _all_to_all(x, 1, 2, group)


def bytes_per_layer(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, p: int, elem_bytes: int = 4) -> int:
    """Bytes one rank sends per layer forward: q, k, v in and the output back, each (P-1)/P of its local part."""
    local = batch * (seq // p) * head_dim
    elements = local * (heads + 2 * kv_heads + heads)
    return elements * (p - 1) // p * elem_bytes


class UlyssesAttention(torch.nn.Module):
    """Wraps a core attention ``(q, k, v) -> out`` on [B, S/P, H, D] slices of the sequence:
    the all-to-alls give it the whole sequence for H/P heads, so the inner attention is the
    ordinary one. It holds no parameters, so a model's parameter names do not change."""

    def __init__(self, inner: torch.nn.Module, group) -> None:
        super().__init__()
        self.inner, self.group = inner, group
        self.index, self.count = dist.get_rank(group), dist.get_world_size(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs=None) -> torch.Tensor:
        """``docs``: the :class:`~hpcml.parallel.docmask.AttentionMask` of the whole sequence, if
        any (the inner attention sees every position, for this rank's part of the heads)."""
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))
        if docs is not None:
            docs = docs.heads(self.index, self.count)
        return heads_to_seq(self.inner(q, k, v, docs), self.group)
