"""Issue 27, part 1's core: FPDT's chunked causal attention on one rank (hpcml.parallel.fpdt)
equals the plain one-process attention -- forward and every gradient, with GQA, 1 to 8 chunks
(an uneven last one included) -- to 1e-10 relative in float64 and 1e-5 in float32, and saves
only q, k, v, the output and the log-sum-exp: bytes linear in the sequence, where the plain
computation keeps the S x S probabilities."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpcml.errors import ConfigError
from hpcml.parallel.fpdt import chunked_attention


def plain(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v, heads repeated for GQA: the reference."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    s = qh @ kh.transpose(-1, -2) / q.shape[3] ** 0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(1, 2)


def _inputs(dtype, heads=4, kv_heads=2, seq=24, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(2, seq, h, dim, generator=g, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), torch.randn(2, seq, heads, dim, generator=g, dtype=dtype)


def _rel(a, b) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("chunk", [24, 12, 8, 5, 3])  # 1, 2, 3, 5 (uneven), 8 chunks
def test_forward_and_every_gradient_equal_the_plain_attention(dtype, tol, kv_heads, chunk):
    q, k, v, dout = _inputs(dtype, kv_heads=kv_heads)
    out = chunked_attention(q, k, v, chunk)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = plain(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert out.shape == q.shape and _rel(out, ref) <= tol
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and g.dtype == dtype and _rel(g, r) <= tol, _rel(g, r)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=kv_heads != 4).transpose(1, 2)
    assert _rel(out, sdpa) <= tol  # the model's own attention, the same scale


def test_gradcheck_in_float64():
    q, k, v, _ = _inputs(torch.float64, heads=2, kv_heads=1, seq=7, dim=3, seed=1)
    assert torch.autograd.gradcheck(lambda a, b, c: chunked_attention(a, b, c, 3), (q, k, v))


def test_saved_bytes_are_the_inputs_output_and_lse_linear_in_the_sequence():
    def saved(fn, seq):
        q, k, v, _ = _inputs(torch.float32, heads=4, kv_heads=2, seq=seq, dim=8)
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            fn(q, k, v)
        return sum(total), q, k

    for seq in (64, 256):
        got, q, k = saved(lambda a, b, c: chunked_attention(a, b, c, 16), seq)
        assert got == 2 * q.numel() * 4 + 2 * k.numel() * 4 + 2 * 4 * seq * 4  # q, out, k, v, lse (fp32)
    small, big = saved(lambda a, b, c: chunked_attention(a, b, c, 16), 64)[0], saved(
        lambda a, b, c: chunked_attention(a, b, c, 16), 256)[0]
    plain_small, plain_big = saved(plain, 64)[0], saved(plain, 256)[0]
    assert big / small == 4 and plain_big / plain_small > 10  # linear, where the plain one is quadratic


@pytest.mark.parametrize("args, error", [
    ((torch.zeros(1, 4, 3, 2), torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2), 2),
     "chunked_attention: 3 query heads are not a multiple of 2 kv heads"),
    ((torch.zeros(1, 4, 2, 2), torch.zeros(1, 5, 2, 2), torch.zeros(1, 5, 2, 2), 2),
     "chunked_attention: q (1, 4, 2, 2), k (1, 5, 2, 2), v (1, 5, 2, 2): expected [B, S, H, D] and two [B, S, Hkv, D]"),
    ((torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2), 0),
     "chunked_attention: chunk=0, expected a positive integer of positions"),
])
def test_bad_shapes_and_chunks_are_refused_in_one_line(args, error):
    with pytest.raises(ConfigError) as e:
        chunked_attention(*args)
    assert str(e.value) == error
