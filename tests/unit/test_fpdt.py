"""Issue 27 on one rank: FPDT's chunked causal attention (hpcml.parallel.fpdt) equals the plain
one-process attention -- forward and every gradient, with GQA, 1 to 8 chunks (an uneven last
one included), through torch's fused CPU kernels and through PyTorch ops -- to 1e-10 relative
in float64 and 1e-5 in float32, and saves only q, k, v, the output and the log-sum-exp; the
whole transformer with FPDT (chunked attention, MLP and loss) equals it without; the strided
positions and the bad settings. Across ranks: tests/mpi/test_fpdt.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F


from hpcml.errors import ConfigError
from hpcml.models.transformer import Transformer, TransformerConfig
from hpcml.models.transformer.model import IGNORE, cross_entropy
from hpcml.parallel import ParallelConfig, fpdt
from hpcml.parallel.fpdt import FPDTAttention, chunked_attention, local_positions


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


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernels", "torch-ops"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("chunk", [24, 12, 8, 5, 3])  # 1, 2, 3, 5 (uneven), 8 chunks
def test_forward_and_every_gradient_equal_the_plain_attention(dtype, tol, kv_heads, chunk, fused, monkeypatch):
    """Both ways a chunk pair is computed: torch's fused CPU kernels, and the PyTorch-ops path
    other devices run."""
    monkeypatch.setattr(fpdt, "FUSED_CPU", fused)
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


# -- the model on one rank (cp 1): FPDT is the chunking alone ------------------------------------

def test_local_positions_are_strided_chunks_that_cover_the_sequence_once():
    assert local_positions(16, 1, 2).tolist() == list(range(8, 16))  # plain Ulysses: a contiguous slice
    assert local_positions(16, 1, 2, chunk=2).tolist() == [2, 3, 6, 7, 10, 11, 14, 15]  # global chunks 1, 3, 5, 7
    every = torch.cat([local_positions(48, r, 4, chunk=3) for r in range(4)])
    assert sorted(every.tolist()) == list(range(48))
    with pytest.raises(ConfigError, match=r"^fpdt_chunk 5: the local sequence of 8 positions \(seq_len 16 / cp 2\) "
                                          r"is not a multiple of it$"):
        local_positions(16, 0, 2, chunk=5)


@pytest.mark.parametrize("chunk", [32, 16, 8, 4])  # 1, 2, 4, 8 chunks
def test_the_transformer_with_fpdt_equals_it_without(chunk):
    """Logits and every parameter's gradient to 1e-10 (float64); the chunked loss to 1e-6 (the
    loss is computed in float32, as the plain one)."""
    torch.manual_seed(0)
    cfg = TransformerConfig.preset("tiny")  # GQA: 8 heads over 4 kv heads
    plain_model = Transformer(cfg).double()
    fpdt = copy.deepcopy(plain_model)
    plan = fpdt.parallel_plan()
    plan.apply_fpdt(fpdt, None, 0, 1, chunk)
    assert plan.computes_loss(ParallelConfig(fpdt_chunk=chunk)) and isinstance(fpdt.layers["0"].attention.core,
                                                                               FPDTAttention)
    x, y = torch.randint(0, cfg.vocab_size, (2, 32)), torch.randint(0, cfg.vocab_size, (2, 32))
    dlogits = torch.randn(2, 32, cfg.padded_vocab, dtype=torch.float64)
    plain_model(x).backward(dlogits)
    fpdt(x).backward(dlogits)
    for (name, p), q in zip(plain_model.named_parameters(), fpdt.parameters()):
        assert _rel(q.grad, p.grad) < 1e-10, name
    plain_model.zero_grad(), fpdt.zero_grad()
    ref = cross_entropy(plain_model(x), y)
    loss = fpdt(x, targets=y)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    ref.backward(), loss.backward()
    for (name, p), q in zip(plain_model.named_parameters(), fpdt.parameters()):
        assert _rel(q.grad, p.grad) < 1e-6, name


@pytest.mark.parametrize("kw, error", [
    ({"fpdt_chunk": -1}, "fpdt_chunk -1: expected a whole number of positions >= 0 (0: off)"),
    ({"fpdt_chunk": True}, "fpdt_chunk True: expected a whole number of positions >= 0 (0: off)"),
    ({"fpdt_chunk": 8, "sequence_parallel": True},
     "fpdt_chunk 8 with sequence_parallel: FPDT chunks the sequence itself; use one of them"),
])
def test_bad_fpdt_settings_are_refused_in_one_line(kw, error):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**kw)
    assert str(e.value) == error


def _pair(chunk: int, **cfg_kw):
    torch.manual_seed(0)
    cfg = TransformerConfig.preset("tiny", **cfg_kw)
    plain_model = Transformer(cfg).double()
    fpdt = copy.deepcopy(plain_model)
    fpdt.parallel_plan().apply_fpdt(fpdt, None, 0, 1, chunk)
    return cfg, plain_model, fpdt


def test_ignored_targets_give_the_plain_mean_even_a_chunk_with_none_counted():
    """The loss is the mean over the targets that count, not a mean of chunk means: a chunk of
    padding alone (every target ignored) changes nothing (it would be NaN chunk by chunk)."""
    cfg, plain_model, fpdt = _pair(8)
    x, y = torch.randint(0, cfg.vocab_size, (2, 32)), torch.randint(0, cfg.vocab_size, (2, 32))
    y[:, :8] = IGNORE  # the first chunk: all padding
    y[0, 20:23] = IGNORE
    ref = cross_entropy(plain_model(x), y)
    loss = fpdt(x, targets=y)
    ref.backward(), loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for (name, p), q in zip(plain_model.named_parameters(), fpdt.parameters()):
        assert _rel(q.grad, p.grad) < 1e-6, name
    with torch.no_grad():  # evaluation: chunk by chunk too, the same mean
        assert float(fpdt(x, targets=y)) == pytest.approx(float(ref.detach()), rel=1e-6)
        assert _rel(fpdt(x), plain_model(x)) < 1e-10


def test_fpdt_with_activation_checkpointing_and_under_bf16_autocast():
    cfg, plain_model, fpdt = _pair(8)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    dlogits = torch.randn(2, 32, cfg.padded_vocab, dtype=torch.float64)
    for block in fpdt.layers.values():
        block.activation_checkpointing = True
    plain_model(x).backward(dlogits)
    fpdt(x).backward(dlogits)
    for (name, p), q in zip(plain_model.named_parameters(), fpdt.parameters()):
        assert _rel(q.grad, p.grad) < 1e-10, name
    plain_model.float(), fpdt.float()
    y = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, loss = cross_entropy(plain_model(x), y), fpdt(x, targets=y)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=2e-2)


@pytest.mark.parametrize("call", [
    lambda x: fpdt.chunked(lambda t: t, x, 4),
    lambda x: fpdt.chunked_loss(lambda t, y: (t.sum(), 1), x, x, 4, []),
    lambda x: fpdt.FPDTAttention(None, 4)(x, x, x),
], ids=["chunked", "chunked_loss", "attention"])
def test_a_sequence_the_chunk_does_not_divide_is_refused(call):
    with pytest.raises(ConfigError, match=r"chunk 4 does not divide the sequence of 10 positions \(expected a "
                                          r"positive divisor\)$"):
        call(torch.zeros(1, 10, 2, 4))
