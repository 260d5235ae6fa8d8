"""FPDT on the cp axis (issue 27): exact against one process.

The attention sub-block (projections, RoPE at the strided positions, per-chunk all-to-alls,
chunked attention, output projection) against the plain one on the whole sequence: forward
and every gradient, cp 2 and 4, 1..8 chunks per rank, GQA, float64 to 1e-10 and float32 to
1e-5. Then whole runs: 5 training steps on cp x tp, cp alone, cp x dp, cp x FSDP and
cp x pp give the one-process losses to 1e-4 (cp x ep: tests/mpi/test_moe.py), and a
checkpoint saved with FPDT resumes without it and back.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcml.grid import ProcessGrid
from hpcml.models.transformer import TransformerConfig
from hpcml.models.transformer.model import Attention
from hpcml.models.transformer.rope import rope_tables
from hpcml.parallel import ParallelConfig
from hpcml.parallel.fpdt import FPDTAttention, local_positions
from hpcml.train import TrainConfig
from hpcml.train.checkpointing import load_trainer, save_trainer
from hpcml.train.data import SyntheticTokens
from hpcml.train.recipe import build_llm_trainer
from tests.reference import reference_run

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig.preset("tiny")  # 8 heads, 4 kv heads: GQA
TRAIN = TrainConfig(steps=5, global_batch=8, micro_batch=2, seq_len=32, progress=False)


@pytest.fixture(scope="module")
def grids(comm):
    """cp over all ranks, and cp 2 (x dp) where there are 4: built once, each a few collectives."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {WORLD: ProcessGrid(cp=WORLD)}
    if WORLD == 4:
        out[2] = ProcessGrid(cp=2)
    for g in out.values():
        g.init_torch()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_equals_one_process(comm, grids, cp, dtype, tol):
    if cp not in grids:
        pytest.skip(f"cp {cp} needs {cp} ranks")
    grid = grids[cp]
    group, r = grid.torch.mesh.get_group("cp"), grid.coords["cp"]
    cfg = TransformerConfig.preset("tiny", n_heads=2 * cp, n_kv_heads=cp, dim=2 * cp * 8)  # GQA: 2 heads per kv head
    torch.manual_seed(3)
    plain = Attention(cfg).to(dtype)
    fpdt = copy.deepcopy(plain)
    chunk, b = 2, 2
    for n in range(1, 9):  # chunks per rank
        s = cp * chunk * n
        cos, sin = rope_tables(cfg.head_dim, s, cfg.rope_theta)
        x = torch.randn(b, s, cfg.dim, dtype=dtype)
        grad = torch.randn(b, s, cfg.dim, dtype=dtype)
        plain.zero_grad(), fpdt.zero_grad()
        xf = x.clone().requires_grad_()
        out = plain(xf, cos, sin)
        out.backward(grad)

        pos = local_positions(s, r, cp, chunk)
        every = torch.cat([local_positions(s, i, cp, chunk) for i in range(cp)])
        assert sorted(every.tolist()) == list(range(s))  # each position on one rank
        fpdt.core = FPDTAttention(group, chunk)
        xl = x[:, pos].clone().requires_grad_()
        out_l = fpdt(xl, cos[pos], sin[pos])
        out_l.backward(grad[:, pos])
        assert rel(out_l, out[:, pos]) < tol, (n, rel(out_l, out[:, pos]))
        assert rel(xl.grad, xf.grad[:, pos]) < tol, n
        for (name, p_plain), p_fpdt in zip(plain.named_parameters(), fpdt.parameters()):
            g = p_fpdt.grad.clone()
            dist.all_reduce(g, group=group)  # each cp rank holds its positions' share
            assert rel(g, p_plain.grad) < tol, (n, name, rel(g, p_plain.grad))


#: (name, degrees, fpdt_chunk): two chunks per rank (the attention test above covers 1..8)
LAYOUTS = {4: [("cp2xtp2", {"cp": 2, "tp": 2}, 8), ("cp4", {"cp": 4}, 4), ("cp2xdp2", {"cp": 2}, 8),
               ("cp2xfsdp2", {"cp": 2}, 8), ("cp2xpp2", {"cp": 2, "pp": 2}, 8)],
           2: [("cp2", {"cp": 2}, 8), ("cp1xdp2", {}, 16)]}


@pytest.mark.parametrize("name,degrees,chunk", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_training_equals_one_process(comm, name, degrees, chunk):
    ref_losses, ref_norms, _ = reference_run(MODEL, TRAIN)
    pcfg = ParallelConfig(fpdt_chunk=chunk, fsdp="fsdp" in name)
    trainer = build_llm_trainer(MODEL, TRAIN, pcfg, **degrees)
    # the chunked logits + loss, not the whole logits (under pp the schedule computes the loss)
    assert trainer.model.computes_loss == ("pp" not in degrees)
    losses = [m["loss"] for m in trainer.fit()]
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert [m["grad_norm"] for m in trainer.history] == pytest.approx(ref_norms, rel=1e-4)
    assert losses[-1] < losses[0] - 0.1
    trainer.close()


def test_checkpoint_resumes_without_fpdt_and_back(comm):
    """The same universal checkpoint: FPDT adds no parameter, so either side loads the other's."""
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-fpdt-") if comm.rank == 0 else None))
    train = TrainConfig(**{**TRAIN.__dict__, "steps": 4})
    ref_losses, _, _ = reference_run(MODEL, train)
    sides = [({"cp": 2}, ParallelConfig(fpdt_chunk=4)), ({"cp": WORLD // 2} if WORLD == 4 else {}, ParallelConfig())]
    for (save_deg, save_cfg), (load_deg, load_cfg) in (sides, sides[::-1]):
        first = build_llm_trainer(MODEL, train, save_cfg, **save_deg)
        first.fit(2)
        path = root / f"fpdt{save_cfg.fpdt_chunk}"
        save_trainer(first, path)
        first.close()
        fresh = build_llm_trainer(MODEL, TrainConfig(**{**train.__dict__, "seed": 9}), load_cfg, **load_deg)
        load_trainer(fresh, path)
        assert fresh.step == 2
        fresh.data = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=train.seq_len, seed=train.seed)
        losses = [m["loss"] for m in fresh.fit()]
        assert losses == pytest.approx(ref_losses[2:], rel=1e-4), (save_cfg, load_cfg)
        fresh.close()
