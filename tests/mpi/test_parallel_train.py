"""Every parallel layout trains like one process: losses, gradient norms and parameters
after 5 steps match a plain PyTorch loop to 1e-4 relative (2 and 4 ranks, gloo, fp32)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml.errors import ConfigError
from hpcml.grid import ProcessGrid
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.parallel.ulysses import heads_to_seq, seq_to_heads
from hpcml.train import TrainConfig
from hpcml.train.recipe import build_llm_trainer
from tests.reference import reference_run

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig.preset("tiny")
TRAIN = TrainConfig(steps=5, global_batch=8, micro_batch=2, seq_len=32, progress=False)
RTOL = 1e-4

LAYOUTS = {
    4: [("dp4", {"dp": 4}, {}), ("fsdp4", {"dp": 4}, {"fsdp": True}),
        ("tp2xdp2", {"tp": 2}, {}), ("tp2xfsdp2", {"tp": 2}, {"fsdp": True}),
        ("tp2xfsdp2-step", {"tp": 2}, {"fsdp": True, "grad_sync": "step"}),
        ("pp2xdp2", {"pp": 2}, {}), ("cp2xdp2", {"cp": 2}, {}),
        ("tp2xpp2", {"tp": 2, "pp": 2}, {}), ("cp2xtp2", {"cp": 2, "tp": 2}, {}),
        ("pp2xfsdp2-interleaved", {"pp": 2}, {"fsdp": True, "pp_schedule": "interleaved1f1b"}),
        ("tp2xdp2-sp", {"tp": 2}, {"sequence_parallel": True}),
        ("pp4-gpipe", {"pp": 4}, {"pp_schedule": "gpipe"}),
        ("zero2-4-ac", {"dp": 4}, {"fsdp": True, "reshard_after_forward": False, "activation_checkpointing": True})],
    2: [("dp2", {"dp": 2}, {}), ("fsdp2", {"dp": 2}, {"fsdp": True}), ("tp2", {"tp": 2}, {}),
        ("fsdp2-step", {"dp": 2}, {"fsdp": True, "grad_sync": "step"}),
        ("pp2", {"pp": 2}, {}), ("cp2", {"cp": 2}, {})],
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True, scope="module")
def _quiet_dtensor():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_layout_matches_single_process(comm, name, degrees, pkw):
    ref_losses, ref_norms, ref_params = reference_run(MODEL, TRAIN)
    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(**pkw), **degrees)
    history = trainer.fit()
    losses = [m["loss"] for m in history]
    norms = [m["grad_norm"] for m in history]
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert norms == pytest.approx(ref_norms, rel=RTOL)
    assert losses[-1] < losses[0] - 0.1  # it learns
    seen = []
    for pname, p in trainer.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.shape == ref_params[pname].shape, pname
        assert rel(full.detach(), ref_params[pname]) < RTOL, pname
        seen.append(pname)
    # all parameters are covered once over the pipeline stages
    all_seen = {n for names in comm.allgather(seen) for n in names}
    assert all_seen == set(ref_params)
    trainer.close()


def test_ulysses_attention_equals_full_attention(comm):
    """seq_to_heads -> attention -> heads_to_seq on sequence slices == attention on the whole sequence."""
    grid = ProcessGrid(cp=WORLD)
    grid.init_torch()
    group = grid.torch.mesh.get_group("cp")
    torch.manual_seed(7)
    b, s, h, kv, d = 2, 8 * WORLD, 2 * WORLD, WORLD, 4
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, kv, d), torch.randn(b, s, kv, d)
    grad_out = torch.randn(b, s, h, d)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full = attend(*full)
    out_full.backward(grad_out)

    chunk = slice(comm.rank * (s // WORLD), (comm.rank + 1) * (s // WORLD))
    local = [t[:, chunk].clone().requires_grad_() for t in (q, k, v)]
    heads = [seq_to_heads(t, group) for t in local]
    assert heads[0].shape == (b, s, h // WORLD, d) and heads[1].shape == (b, s, kv // WORLD, d)
    out = heads_to_seq(attend(*heads), group)
    assert out.shape == (b, s // WORLD, h, d)
    out.backward(grad_out[:, chunk])
    torch.testing.assert_close(out, out_full[:, chunk], rtol=1e-5, atol=1e-6)
    for t_local, t_full in zip(local, full):
        torch.testing.assert_close(t_local.grad, t_full.grad[:, chunk], rtol=1e-5, atol=1e-6)


BAD = [
    ({"tp": WORLD}, TransformerConfig.preset("tiny", n_heads=WORLD * 2 + 1, dim=(WORLD * 2 + 1) * 8, n_kv_heads=None),
     {}, TRAIN, "n_heads {h} is not divisible by tp {w}"),
    ({"cp": WORLD}, TransformerConfig.preset("tiny", n_kv_heads=1), {}, TRAIN,
     "n_kv_heads 1 / tp 1 = 1 heads per rank is not divisible by cp {w} (Ulysses splits heads over cp; cp_kind "
     "allgather does not)"),
    ({"tp": WORLD}, TransformerConfig.preset("tiny", ffn_hidden=67), {}, TRAIN,
     "ffn hidden 67 is not divisible by tp {w}"),
    ({"pp": WORLD}, TransformerConfig.preset("tiny", n_layers=WORLD - 1), {}, TRAIN,
     "n_layers {l} < pipeline stages {w} (pp {w} x 1 stages per rank)"),
    ({"dp": WORLD}, MODEL, {}, TrainConfig(global_batch=6, micro_batch=2),
     "global batch 6 is not divisible by dp {w} x micro-batch 2 = {m}"),
    ({"cp": WORLD}, MODEL, {}, TrainConfig(seq_len=30 if WORLD == 4 else 31), "seq_len {s} is not divisible by cp {w}"),
    ({"pp": WORLD}, MODEL, {"fsdp": True, "grad_sync": "microbatch"}, TrainConfig(global_batch=8, micro_batch=1),
     "grad_sync microbatch with pp {w}: torch.distributed.pipelining reduce-scatters after a step's last backward "
     "only; drop grad_sync (or set it to step)"),
]


@pytest.mark.parametrize("degrees,model,pkw,train,message", BAD, ids=["heads-tp", "kv-cp", "ffn-tp", "layers-pp",
                                                                       "batch-dp", "seq-cp", "sync-pp"])
def test_bad_plans_raise_on_every_rank_before_collectives(comm, degrees, model, pkw, train, message):
    with pytest.raises(ConfigError) as info:
        build_llm_trainer(model, train, ParallelConfig(**pkw), **degrees)
    got = str(info.value)
    expected = message.format(w=WORLD, h=model.n_heads, l=model.n_layers, m=WORLD * 2, s=train.seq_len)
    assert got == expected
    assert comm.allgather(got) == [got] * WORLD  # every rank raised the same, and the job still communicates
    assert not dist.is_initialized() or dist.get_world_size() == WORLD


def test_bf16_autocast_and_hooks(comm):
    """bf16 autocast trains close to fp32; hooks see every step's metrics, in order, on every rank."""
    ref_losses, _, _ = reference_run(MODEL, TRAIN)
    seen: list[int] = []
    trainer = build_llm_trainer(MODEL, TrainConfig(**{**TRAIN.__dict__, "bf16": True}), ParallelConfig(fsdp=True),
                                dp=WORLD)
    trainer.hooks.append(lambda tr, m: seen.append(m["step"]))
    computed = set()  # FSDP in bf16 gathers bf16 weights (no autocast copy of fp32 ones); shards stay fp32
    for mod in trainer.model.parts[0].modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda m, args: computed.add(m.weight.dtype))
    losses = [m["loss"] for m in trainer.fit()]
    assert computed == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parts[0].parameters()} == {torch.float32}
    assert seen == [1, 2, 3, 4, 5] and trainer.step == 5
    assert losses == pytest.approx(ref_losses, rel=2e-2)  # bf16 matmuls: close, not equal
    assert losses != pytest.approx(ref_losses, rel=1e-7)  # and autocast really ran in bf16
    assert comm.allgather(losses) == [losses] * WORLD
