"""hpcml's chunked loss (``loss_chunk``) in the planner: the logits never whole, what it refuses,
and the flags that carry it to llm_pretrain.py. Its saved bytes against autograd's are
``tests/mpi/test_plan_exact.py``'s; its training against one process ``tests/mpi/test_loss_chunk.py``'s."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hpcml.errors import ConfigError
from hpcml.models.transformer.config import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.memory import memory
from hpcml.plan.emit import emit, member_entry

ROOT = Path(__file__).resolve().parents[2]


def _long(**kw) -> PlanLayout:
    """Llama 2 7B's shape (vocabulary 32,000), FSDP on 8 A100s, 64K tokens a micro-batch."""
    base = dict(model=TransformerConfig.preset("llama2-7b"), gpus=8, gpu="a100-80gb", seq_len=65536, global_batch=8,
                zero=3, recompute="full")
    return PlanLayout(**{**base, **kw})


def test_the_logits_are_never_whole():
    """At 64K tokens the whole fp32 log-softmax (4 B) and the logits' gradient (2 x 4 B) of every
    position are ~25 GB; chunked by 1,024 positions they are one chunk's, and what waits for
    backward is d loss / d h (the stream's width) and the output layer's gradients."""
    whole, chunked = _long(), _long(loss_chunk=1024)
    cfg = whole.model
    v, tokens = cfg.padded_vocab, 65536
    a, b = memory(cfg, whole), memory(cfg, chunked)
    # whole: the final norm's (its fp32 copy and bf16 output: 6 B x dim + 4), the output's bf16 input and the
    # fp32 log-softmax a position; chunked: d loss / d h (bf16) a position and the fp32 sums of the output's gradients
    saved = a.activations - b.activations
    assert saved == pytest.approx(tokens * (4 * v + 6 * cfg.dim + 4) - 4 * (v * cfg.dim + cfg.dim), rel=1e-9)
    assert a.buffers - b.buffers == pytest.approx(2 * 4 * v * (tokens - 1024), rel=1e-9)
    assert (a.total - b.total) / (1 << 30) > 20


@pytest.mark.parametrize("kw,match", [
    (dict(loss_chunk=-1), "loss_chunk=-1: expected an integer in"),
    (dict(loss_chunk=512, framework="torchtitan"), "hpcml's chunked loss runs without them"),
    (dict(loss_chunk=512, fpdt_chunk=512), "fpdt_chunk 512"),
    (dict(loss_chunk=512, tp=2, sequence_parallel=True), "sequence_parallel True"),
    (dict(loss_chunk=512, pp=2, micro_batch=1, global_batch=16), "pp 2"),
    (dict(loss_chunk=512, loss="fused"), "loss fused: hpcml's chunked loss runs without them"),
    (dict(loss_chunk=1536, cp=2), "loss_chunk 1536: seq_len 65536 must be a multiple of cp 2 x loss_chunk"),
])
def test_what_it_cannot_run_is_refused_naming_the_value(kw, match):
    with pytest.raises(ConfigError, match=match):
        _long(**kw)


def test_the_trainers_config_refuses_the_same():
    assert ParallelConfig(loss_chunk=256).loss_chunk == 256
    for kw, match in ((dict(loss_chunk=-2), "loss_chunk -2: expected a whole number of positions >= 0"),
                      (dict(loss_chunk=64, fpdt_chunk=64), "FPDT chunks its loss by fpdt_chunk already"),
                      (dict(loss_chunk=64, sequence_parallel=True), "sequence parallelism splits the positions")):
        with pytest.raises(ConfigError, match=match):
            ParallelConfig(**kw)


def test_emit_and_members_carry_it():
    sys.path.insert(0, str(ROOT / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    lay = _long(loss_chunk=1024, model="llama2-7b")
    assert llm_pretrain.parse_args(emit(lay)).loss_chunk == 1024
    assert llm_pretrain.parse_args(emit(replace(lay, loss_chunk=0))).loss_chunk == 0
    assert member_entry(lay)["loss_chunk"] == 1024 and "loss_chunk" not in member_entry(replace(lay, loss_chunk=0))


def test_the_weights_gradients_are_summed_in_fp32_whatever_the_chunks():
    """bf16 weights (FSDP's bf16 gathers): the output layer's gradient summed over 128 chunks is as
    close to fp64's as one chunk's (summed in bf16 it was 1.3% off, against 0.25%)."""
    import torch

    from hpcml.parallel.fpdt import chunked_loss

    torch.manual_seed(0)
    v, d, s = 1024, 64, 4096
    w0, x0, t = torch.randn(v, d) * 0.02, torch.randn(1, s, d), torch.randint(0, v, (1, s))

    def grad(dtype, chunk):
        w, x = w0.to(dtype).requires_grad_(), x0.to(dtype).requires_grad_()

        def fn(xc, tc):
            logits = (xc @ w.t()).float()
            return torch.nn.functional.cross_entropy(logits.view(-1, v), tc.reshape(-1), reduction="sum"), tc.numel()

        chunked_loss(fn, x, t, chunk, [w]).backward()
        assert w.grad.dtype == dtype
        return w.grad.double()

    ref = grad(torch.float64, s)
    err = {c: float((grad(torch.bfloat16, c) - ref).norm() / ref.norm()) for c in (s, 32)}
    assert err[32] < 1.5 * err[s] and err[s] < 0.005, err
