"""FPDT's attention core (issue 27): exact causal attention over chunks, memory linear in the sequence.

Yao et al., "Training Ultra Long Context Language Model with Fully Pipelined Distributed
Transformer" (MLSys'25) cut the sequence into chunks and attend query chunk i against key and
value chunks 0..i, merging the partial outputs by an online softmax with their log-sum-exp,
so no ``S x S`` score matrix is ever whole. This module is that core on one rank, after
Ulysses' all-to-all has given it whole sequences of its heads: :func:`chunked_attention`, a
custom autograd function that saves only ``q, k, v``, the output and the log-sum-exp (``O(S)``
per head) and recomputes each chunk pair's scores in backward, accumulating ``dq, dk, dv``
chunk by chunk (FlashAttention's backward, in PyTorch ops). GQA: keys and values of
``n_kv_heads`` serve ``n_heads / n_kv_heads`` query heads each. The scale is
``head_dim ** -0.5``, as ``F.scaled_dot_product_attention``'s, so it matches the model's
plain attention to rounding (1e-10 relative in float64). The per-chunk all-to-all, strided
chunk placement and host offload that make it FPDT across ranks are still to come.
"""

from __future__ import annotations

import math

import torch

from hpcml.errors import ConfigError


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """Causal attention of ``q`` [B, S, H, D] over ``k``, ``v`` [B, S, Hkv, D] (H a multiple of
    Hkv), ``chunk`` positions at a time: [B, S, H, D], equal to the plain computation."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ConfigError(f"chunked_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                          f"[B, S, H, D] and two [B, S, Hkv, D]")
    if q.shape[2] % k.shape[2]:
        raise ConfigError(f"chunked_attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ConfigError(f"chunked_attention: chunk={chunk!r}, expected a positive integer of positions")
    return _Chunked.apply(q, k, v, chunk)


def _heads_first(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hkv * groups, S, D] (each kv head serving ``groups`` query heads)."""
    x = x.transpose(1, 2)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _bounds(s: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, s)) for a in range(0, s, chunk)]


def _scores(qi, kj, scale, i0, j0, diagonal):
    s = torch.matmul(qi, kj.transpose(-1, -2)) * scale
    if diagonal:  # the only chunk pair the causal mask cuts: query position < key position
        qpos = torch.arange(i0, i0 + qi.shape[-2], device=qi.device)[:, None]
        kpos = torch.arange(j0, j0 + kj.shape[-2], device=qi.device)[None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
    return s


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunk):
        groups = q.shape[2] // k.shape[2]
        scale = 1.0 / math.sqrt(q.shape[3])
        qh, kh, vh = q.transpose(1, 2), _heads_first(k, groups), _heads_first(v, groups)
        out = torch.empty_like(qh)
        lse = torch.empty(qh.shape[:3], dtype=torch.float32 if qh.dtype != torch.float64 else qh.dtype,
                          device=qh.device)
        bounds = _bounds(q.shape[1], chunk)
        for i0, i1 in bounds:  # online softmax over the key chunks this query chunk sees
            qi = qh[:, :, i0:i1]
            m = torch.full(qi.shape[:3], float("-inf"), dtype=lse.dtype, device=qh.device)
            l_sum = torch.zeros_like(m)
            acc = torch.zeros(qi.shape, dtype=lse.dtype, device=qh.device)
            for j0, j1 in bounds:
                if j0 >= i1:
                    break
                s = _scores(qi, kh[:, :, j0:j1], scale, i0, j0, diagonal=j1 > i0).to(lse.dtype)
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m_new[..., None])
                keep = torch.exp(m - m_new)
                l_sum = l_sum * keep + p.sum(-1)
                acc = acc * keep[..., None] + torch.matmul(p, vh[:, :, j0:j1].to(lse.dtype))
                m = m_new
            out[:, :, i0:i1] = (acc / l_sum[..., None]).to(out.dtype)
            lse[:, :, i0:i1] = m + torch.log(l_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk = chunk
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        chunk, groups = ctx.chunk, q.shape[2] // k.shape[2]
        scale = 1.0 / math.sqrt(q.shape[3])
        qh, kh, vh = q.transpose(1, 2), _heads_first(k, groups), _heads_first(v, groups)
        do = dout.transpose(1, 2)
        delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # rowsum(dO * O): softmax's backward term
        dq = torch.zeros(qh.shape, dtype=lse.dtype, device=q.device)
        dk = torch.zeros(kh.shape, dtype=lse.dtype, device=q.device)
        dv = torch.zeros(vh.shape, dtype=lse.dtype, device=q.device)
        bounds = _bounds(q.shape[1], chunk)
        for i0, i1 in bounds:  # recompute each chunk pair's probabilities from the saved log-sum-exp
            qi, doi = qh[:, :, i0:i1].to(lse.dtype), do[:, :, i0:i1].to(lse.dtype)
            for j0, j1 in bounds:
                if j0 >= i1:
                    break
                kj, vj = kh[:, :, j0:j1].to(lse.dtype), vh[:, :, j0:j1].to(lse.dtype)
                p = torch.exp(_scores(qi, kj, scale, i0, j0, diagonal=j1 > i0) - lse[:, :, i0:i1, None])
                dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), doi)
                ds = p * (torch.matmul(doi, vj.transpose(-1, -2)) - delta[:, :, i0:i1, None])
                dq[:, :, i0:i1] += torch.matmul(ds, kj) * scale
                dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qi) * scale
        if groups > 1:  # each kv head's gradient: the sum over the query heads it served
            b, h, s, d = dk.shape
            dk = dk.view(b, h // groups, groups, s, d).sum(2)
            dv = dv.view(b, h // groups, groups, s, d).sum(2)
        return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype),
                None)


__all__ = ["chunked_attention"]
