"""FPDT (issue 27): exact causal attention over chunks, chunk by chunk through Ulysses' all-to-all.

Yao et al., "Training Ultra Long Context Language Model with Fully Pipelined Distributed
Transformer" (MLSys'25) cut the sequence into chunks and attend query chunk i against key and
value chunks 0..i, merging the partial outputs by an online softmax with their log-sum-exp,
so no ``S x S`` score matrix is ever whole. :func:`chunked_attention` is that core on one
rank, after Ulysses' all-to-all has given it whole sequences of its heads: a custom autograd
function that saves only ``q, k, v``, the output and the log-sum-exp (``O(S)`` per head) and
recomputes each chunk pair in backward, accumulating ``dq, dk, dv`` chunk by chunk
(FlashAttention's backward). On CPU torch's fused flash-attention kernels run each query
chunk against its earlier chunks as one span and its own causally; elsewhere PyTorch ops
run each chunk pair. GQA: keys and values of ``n_kv_heads`` serve ``n_heads / n_kv_heads``
query heads each. The scale is ``head_dim ** -0.5``, as ``F.scaled_dot_product_attention``'s,
so it matches the model's plain attention to rounding (1e-10 relative in float64).
:func:`chunked` (the MLP, recomputed per chunk) and :func:`chunked_loss` (the logits and
loss, gradients taken in forward) chunk the rest of a block and the output layer.

Across the P ranks of a cp group (:class:`FPDTAttention`), each rank holds its local sequence
as chunks of ``chunk`` positions placed strided: rank r's local chunk j is global chunk
``j * P + r`` (:func:`local_positions`; the trainer slices tokens and labels, the model its
rotary angles, by it). Each local chunk's q, k, v go through the all-to-all on their own, and
because of the striding, local chunk j of every rank gathered together is the contiguous
global span ``[j * P * chunk, (j + 1) * P * chunk)`` for H/P heads, so the causal chunk loop
runs on global chunks of ``P * chunk`` positions and every rank does the same work. Host
offload of the saved chunks (pinned memory, a side stream) is GPU work not built yet: on
CPU the same code runs without it.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.parallel.config import NO_DOC_MASK
from hpcml.parallel.ulysses import heads_to_seq, seq_to_heads


def local_positions(seq_len: int, index: int, count: int, chunk: int = 0) -> torch.Tensor:
    """The global positions rank ``index`` of ``count`` holds, in its local order: a contiguous
    slice (``chunk`` 0, plain Ulysses) or FPDT's strided chunks of ``chunk`` positions."""
    if count < 1 or not 0 <= index < count or seq_len % count:
        raise ConfigError(f"local_positions: rank {index} of {count} over {seq_len} positions: expected 0 <= rank < "
                          f"count and count dividing the sequence")
    local = seq_len // count
    if not chunk:
        return torch.arange(index * local, (index + 1) * local)
    if local % chunk:
        raise ConfigError(f"fpdt_chunk {chunk}: the local sequence of {local} positions (seq_len {seq_len} / cp "
                          f"{count}) is not a multiple of it")
    starts = (torch.arange(local // chunk) * count + index) * chunk
    return (starts[:, None] + torch.arange(chunk)[None, :]).flatten()


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """Causal attention of ``q`` [B, S, H, D] over ``k``, ``v`` [B, S, Hkv, D] (H a multiple of
    Hkv), ``chunk`` positions at a time: [B, S, H, D], equal to the plain computation."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ConfigError(f"chunked_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                          f"[B, S, H, D] and two [B, S, Hkv, D]")
    if q.shape[2] % k.shape[2]:
        raise ConfigError(f"chunked_attention: {q.shape[2]} query heads are not a multiple of {k.shape[2]} kv heads")
    if not is_int(chunk) or chunk < 1:
        raise ConfigError(f"chunked_attention: chunk={chunk!r}, expected a positive integer of positions")
    return _Chunked.apply(q, k, v, chunk)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D]: each kv head serving ``groups`` query heads."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse's gradient: [B, Hkv * groups, S, D] summed over each kv head's query heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _bounds(s: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, s)) for a in range(0, s, chunk)]


def _scores(qi, kj, scale, diagonal):
    s = torch.matmul(qi, kj.transpose(-1, -2)) * scale
    if diagonal:  # the only chunk pair the causal mask cuts (a square block): query position < key position
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


FUSED_CPU = True
"""On CPU, torch's fused flash-attention kernels, a query chunk's earlier keys as one span
(False: each chunk pair in PyTorch ops, the path every other device runs, kept tested against them)."""


def _fused(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and FUSED_CPU


def _pair(qi, kj, vj, scale, diagonal, acc):
    """One chunk pair's attention: (output normalised within the pair, its log-sum-exp). Keys
    and values in their own (kv) heads: the kernels serve grouped queries without a copy."""
    if _fused(qi):  # torch's fused flash kernel for CPU: no S x S scores in memory
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qi, kj, vj, 0.0, diagonal, scale=scale)
        return out.to(acc), lse.to(acc)
    groups = qi.shape[1] // kj.shape[1]
    s = _scores(qi.to(acc), _repeat(kj, groups).to(acc), scale, diagonal)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]), _repeat(vj, groups).to(acc)), lse


def _pair_backward(doi, qi, kj, vj, oi, lse_i, scale, diagonal, acc):
    """dq, dk, dv of one chunk pair (dk, dv in kv heads), from the whole row's output and
    log-sum-exp: exact, as FlashAttention's backward."""
    if _fused(qi):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doi, qi, kj, vj, oi, lse_i.to(torch.float32) if qi.dtype != torch.float64 else lse_i, 0.0, diagonal,
            scale=scale)
        return tuple(g.to(acc) for g in grads)
    groups = qi.shape[1] // kj.shape[1]
    qi, doi = qi.to(acc), doi.to(acc)
    kj, vj = _repeat(kj, groups).to(acc), _repeat(vj, groups).to(acc)
    p = torch.exp(_scores(qi, kj, scale, diagonal) - lse_i[..., None])
    delta = (doi * oi.to(acc)).sum(-1)  # rowsum(dO * O): softmax's backward term
    ds = p * (torch.matmul(doi, vj.transpose(-1, -2)) - delta[..., None])
    return (torch.matmul(ds, kj) * scale, _sum_groups(torch.matmul(ds.transpose(-1, -2), qi) * scale, groups),
            _sum_groups(torch.matmul(p.transpose(-1, -2), doi), groups))


def _key_spans(bounds: list[tuple[int, int]], i: int, qi: torch.Tensor) -> list[tuple[int, int]]:
    """The key spans query chunk ``i`` attends, each one kernel call: every earlier chunk apart,
    then its own (the diagonal, causal). The fused CPU kernels take the earlier ones as one span
    (they tile it themselves, holding no scores beyond a tile): fewer calls, the same sums."""
    i0, i1 = bounds[i]
    if _fused(qi):
        return ([(0, i0)] if i0 else []) + [(i0, i1)]
    return bounds[:i + 1]


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunk):
        scale = 1.0 / math.sqrt(q.shape[3])
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = torch.empty_like(qh)
        lse = torch.empty(qh.shape[:3], dtype=acc, device=qh.device)
        bounds = _bounds(q.shape[1], chunk)
        for i, (i0, i1) in enumerate(bounds):  # merge the key chunks this query chunk sees by their log-sum-exp
            qi = qh[:, :, i0:i1]
            o_i, lse_i = None, None
            for j0, j1 in _key_spans(bounds, i, qi):
                o_ij, lse_ij = _pair(qi, kh[:, :, j0:j1], vh[:, :, j0:j1], scale, j0 == i0, acc)
                if o_i is None:
                    o_i, lse_i = o_ij, lse_ij
                    continue
                new = torch.logaddexp(lse_i, lse_ij)
                o_i = o_i * torch.exp(lse_i - new)[..., None] + o_ij * torch.exp(lse_ij - new)[..., None]
                lse_i = new
            out[:, :, i0:i1] = o_i.to(out.dtype)
            lse[:, :, i0:i1] = lse_i
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunk = chunk
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        chunk, scale, acc = ctx.chunk, 1.0 / math.sqrt(q.shape[3]), lse.dtype
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        do = dout.transpose(1, 2).to(q.dtype)
        dq = torch.zeros(qh.shape, dtype=acc, device=q.device)
        dk = torch.zeros(kh.shape, dtype=acc, device=q.device)
        dv = torch.zeros(vh.shape, dtype=acc, device=q.device)
        bounds = _bounds(q.shape[1], chunk)
        for i, (i0, i1) in enumerate(bounds):  # each chunk pair's share, from the saved output and log-sum-exp
            qi, doi, oi, lse_i = qh[:, :, i0:i1], do[:, :, i0:i1], out[:, :, i0:i1], lse[:, :, i0:i1]
            for j0, j1 in _key_spans(bounds, i, qi):
                g = _pair_backward(doi, qi, kh[:, :, j0:j1], vh[:, :, j0:j1], oi, lse_i, scale, j0 == i0, acc)
                dq[:, :, i0:i1] += g[0]
                dk[:, :, j0:j1] += g[1]
                dv[:, :, j0:j1] += g[2]
        return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype),
                None)




class FPDTAttention(torch.nn.Module):
    """The attention core ``(q, k, v) -> out`` on a rank's strided chunks [B, S/P, H, D]: each
    chunk's all-to-all on its own, then :func:`chunked_attention` over global chunks of
    ``P * chunk`` positions, then each output chunk back. ``group`` None: one rank (no
    all-to-all, the chunked attention alone). No parameters: a model's names do not change."""

    def __init__(self, group, chunk: int) -> None:
        super().__init__()
        self.group, self.chunk = group, chunk

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs=None) -> torch.Tensor:
        if docs is not None:  # its chunked kernel takes no mask
            raise ConfigError(NO_DOC_MASK if docs.slopes is None else "ALiBi under FPDT is not built (its chunked "
                              "kernel takes no biases): drop --fpdt-chunk, or use rotary positions")
        c, n = self.chunk, _chunks(q, self.chunk, "FPDTAttention")
        if self.group is None:
            return chunked_attention(q, k, v, c)
        p = torch.distributed.get_world_size(self.group)
        hq, hkv = q.shape[2] // p, k.shape[2] // p
        # q, k, v of a chunk in one all-to-all: rank i's heads of all three side by side
        qkv = torch.cat([t.unflatten(2, (p, -1)) for t in (q, k, v)], dim=3).flatten(2, 3)
        qkv = torch.cat([seq_to_heads(qkv[:, j * c:(j + 1) * c], self.group) for j in range(n)], dim=1)
        q, k, v = qkv.split([hq, hkv, hkv], dim=2)
        out = chunked_attention(q, k, v, p * c)
        return torch.cat([heads_to_seq(out[:, j * p * c:(j + 1) * p * c], self.group) for j in range(n)], dim=1)


def _chunks(x: torch.Tensor, chunk: int, what: str) -> int:
    """Whole chunks of ``chunk`` positions in ``x`` [B, S, ...], or a one-line error."""
    if not is_int(chunk) or chunk < 1 or x.shape[1] % chunk:
        raise ConfigError(f"{what}: chunk {chunk!r} does not divide the sequence of {x.shape[1]} positions "
                          f"(expected a positive divisor)")
    return x.shape[1] // chunk


def chunked(fn, x: torch.Tensor, chunk: int, *args) -> torch.Tensor:
    """``fn`` applied to ``x`` [B, S, ...] ``chunk`` positions at a time, each chunk recomputed in
    backward (non-reentrant checkpoint): what is saved is ``x``, not ``fn``'s intermediates
    (FPDT's chunked MLP). Without grad the chunks run plainly, one at a time: the intermediates
    of one chunk live at once either way. ``fn`` must act on each position alone."""
    n = _chunks(x, chunk, "chunked")
    parts = (x[:, j * chunk:(j + 1) * chunk] for j in range(n))
    if not torch.is_grad_enabled():
        return torch.cat([fn(p, *args) for p in parts], dim=1)
    return torch.cat([checkpoint(fn, p, *args, use_reentrant=False) for p in parts], dim=1)


class _GradsInForward(torch.autograd.Function):
    """``fn``'s summed loss over chunks over its count, the gradients taken chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, fn, chunk, x, targets, *params):
        dx = torch.empty_like(x)
        # the weights' gradients summed over chunks in fp32 at least (bf16 weights, FSDP's bf16 gathers: a
        # rounding per chunk otherwise, 1.3% off at 128 chunks), returned in the weights' dtype
        ctx.dtypes = [p.dtype for p in params]
        dparams = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in params]
        total, count = None, 0
        for j in range(x.shape[1] // chunk):
            sl = slice(j * chunk, (j + 1) * chunk)
            xj = x[:, sl].detach().requires_grad_()
            # a graph gone before this returns: no saved-tensor hook of the caller's (an offload, an account) sees it
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss, n = fn(xj, targets[:, sl])
                grads = torch.autograd.grad(loss, (xj, *params))
            dx[:, sl] = grads[0]
            for acc, g in zip(dparams, grads[1:]):
                acc += g
            total, count = (loss.detach() if total is None else total + loss.detach()), count + int(n)
        ctx.save_for_backward(dx / count, *(g / count for g in dparams))
        return total / count

    @staticmethod
    def backward(ctx, grad):
        dx, *dparams = ctx.saved_tensors
        if hasattr(grad, "full_tensor"):  # a vocabulary-parallel loss is a replicated DTensor
            grad = grad.full_tensor()
        return (None, None, dx * grad, None, *((g * grad).to(t) for g, t in zip(dparams, ctx.dtypes)))


def chunked_loss(fn, x: torch.Tensor, targets: torch.Tensor, chunk: int, params: list[torch.Tensor]) -> torch.Tensor:
    """The mean loss over ``x`` [B, S, ...], ``chunk`` positions at a time: ``fn(x_chunk,
    targets_chunk)`` gives a chunk's summed loss and the number of targets it counts (ignored
    ones not), so the result is the plain mean whatever each chunk holds. With grad, the
    gradients to ``x`` and ``params`` (every parameter ``fn`` uses) are taken chunk by chunk in
    forward, as a fused linear cross-entropy does: each chunk's vocabulary-sized logits live
    only while that chunk is computed, nothing is recomputed in backward, and what waits for
    backward is ``d loss / d x`` (x's size) and the parameters' gradients."""
    n = _chunks(x, chunk, "chunked_loss")
    if torch.is_grad_enabled():  # (one chunk too: its log-softmax is not kept for backward, as planned)
        return _GradsInForward.apply(fn, chunk, x, targets, *params)
    total, count = None, 0
    for j in range(n):
        loss, c = fn(x[:, j * chunk:(j + 1) * chunk], targets[:, j * chunk:(j + 1) * chunk])
        total, count = (loss if total is None else total + loss), count + int(c)
    return total / count


__all__ = ["FPDTAttention", "chunked", "chunked_attention", "chunked_loss", "local_positions"]
