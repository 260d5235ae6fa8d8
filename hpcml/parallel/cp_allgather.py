"""Context parallelism by all-gathering keys and values (Llama 3's form; torch has none for a
plain module).

Each of the P ranks of a cp group holds a contiguous slice of the sequence, as under Ulysses.
Before attention the keys and values of every slice are all-gathered, so each rank attends its
own queries over the whole sequence with the causal mask offset by its slice's start; in
backward the gradients of the gathered keys and values are reduce-scattered back. Unlike
Ulysses no heads are split, so it runs with fewer key/value heads than cp ranks (GQA with 8 kv
heads on cp 16). Per rank and layer it receives 2 * B*S*Hkv*D*(P-1)/P elements forward (k, v)
and sends as many back, against Ulysses' (2H + 2Hkv) * B*S*D/P * (P-1)/P: less for
P < (H + Hkv) / Hkv (5 for Llama 3's 32 query and 8 kv heads), more above. This version masks
densely (an additive mask offset by the rank's slice): every query meets every key, where a
kernel taking the offset would skip the causal half.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcml.parallel.docmask import AttentionMask


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward reduce-scatters the gradient. Plain
    collectives, not torch's functional ones: on gloo those crashed a rank twice in CI-sized runs
    (SIGSEGV in their wait, 2026-12-02; SIGABRT in their dispatch, 2026-12-03), never reproduced."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] of every rank -> [B, S, H, D], in rank order (differentiable: backward
    reduce-scatters the gradient, each rank keeping its slice's sum over the ranks' uses)."""
    seq_first = x.transpose(0, 1).contiguous()  # gathered along dim 0
    return _GatherSeq.apply(seq_first, group).transpose(0, 1)


@functools.lru_cache(maxsize=8)
def causal_offset_mask(s_local: int, s_total: int, start: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[s_local, s_total] additive mask: 0 where query ``start + i`` may attend key ``j``
    (j <= start + i), -inf elsewhere; one tensor for every layer of a rank (cached: SDPA would
    otherwise turn a boolean mask into a new float one in every block and keep each)."""
    q = torch.arange(start, start + s_local, device=device)[:, None]
    allowed = torch.arange(s_total, device=device)[None, :] <= q
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


class AllGatherAttention(torch.nn.Module):
    """Causal attention of this rank's queries [B, S/P, H, D] over the keys and values of the
    whole sequence, all-gathered over ``group`` (rank ``index`` holds positions
    ``[index * S/P, (index + 1) * S/P)``). No parameters: a model's names do not change."""

    def __init__(self, group, index: int) -> None:
        super().__init__()
        self.group, self.index = group, index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: AttentionMask | None = None
                ) -> torch.Tensor:
        """``docs``: the whole sequence's mask, if any (documents, ALiBi: this rank takes its queries' rows)."""
        k, v = gather_seq(k, self.group), gather_seq(v, self.group)
        s = q.shape[1]
        if docs is not None:
            mask = docs.rows(self.index * s, s, q.dtype)
        else:
            mask = causal_offset_mask(s, k.shape[1], self.index * s, q.dtype, q.device)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def bytes_per_layer(batch: int, seq: int, kv_heads: int, head_dim: int, p: int, elem_bytes: int = 4) -> int:
    """Bytes one rank receives per layer forward: the other ranks' keys and values."""
    return 2 * batch * seq * kv_heads * head_dim * (p - 1) // p * elem_bytes

