"""Mixture-of-Experts with expert parallelism trains like one process (issue 13): losses,
gradient norms, parameters and the Switch auxiliary loss of 5 steps match a plain PyTorch
loop to 1e-4 on ep 2 and 4 with dp, tp, pp and cp; the all-to-all dispatch returns its input."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml.grid import ProcessGrid
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.parallel.ep import AllToAllDispatch
from hpcml.models.transformer.moe import permutation
from hpcml.train import TrainConfig
from hpcml.train.recipe import build_llm_trainer
from tests.reference import reference_run_with_stats

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig.preset("tiny-moe", n_layers=2, moe_shared_hidden=32)
TRAIN = TrainConfig(steps=10, global_batch=8, micro_batch=2, seq_len=16, progress=False)
RTOL = 1e-4
PARAM_RTOL = 5e-4
"""Parameters after AdamW steps: Adam divides each gradient by its own running size, so a
rounding difference in a near-zero gradient (another matmul kernel: AVX-512 on one host,
AVX2 on another) moves that weight by a full step -- 1.3e-4 of wo's norm on an AVX-512 host.
A wrong layout moves them by O(1)."""

LAYOUTS = [("ep4", {"ep": 4}, {}, MODEL), ("ep2", {"ep": 2}, {}, MODEL),
           ("ep2xtp2", {"ep": 2, "tp": 2}, {}, MODEL), ("ep2xpp2", {"ep": 2, "pp": 2}, {}, MODEL),
           ("ep4xcp2", {"ep": 4, "cp": 2}, {}, MODEL),
           ("ep4xcp2-fpdt", {"ep": 4, "cp": 2}, {"fpdt_chunk": 4}, MODEL),
           ("ep2-bias-sigmoid", {"ep": 2}, {}, replace(MODEL, moe_balance="bias", moe_score="sigmoid")),
           ("tp2xdp2-ep1", {"tp": 2}, {}, MODEL), ("ep2-fsdp", {"ep": 2}, {"fsdp": True}, MODEL),
           ("ep4-fsdp", {"ep": 4}, {"fsdp": True}, MODEL),
           ("fsdp4-bias", {"dp": 4}, {"fsdp": True}, replace(MODEL, moe_balance="bias", moe_bias_rate=0.01))]


@pytest.fixture(autouse=True, scope="module")
def _quiet_dtensor():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.skipif(WORLD != 4, reason="4 ranks")
@pytest.mark.parametrize("name,degrees,pkw,model", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_moe_layout_matches_single_process(comm, name, degrees, pkw, model):
    train = replace(TRAIN, steps=5)  # eleven layouts: 5 steps each (the resume test below runs the 10)
    ref_losses, ref_norms, ref_params, ref_aux = reference_run_with_stats(model, train)
    trainer = build_llm_trainer(model, train, ParallelConfig(**pkw), **degrees)
    history = trainer.fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=RTOL)
    assert [m["grad_norm"] for m in history] == pytest.approx(ref_norms, rel=RTOL)
    if model.moe_balance == "aux":  # the auxiliary loss is that of the data, the same on every layout
        assert [m["moe_aux"] for m in history] == pytest.approx(ref_aux, rel=RTOL)
        assert all(0.9 < a < 2.0 for a in ref_aux)  # E * sum f P is 1 when balanced
    assert all(m["moe_load_max_over_mean"] >= 1.0 for m in history)
    seen = []
    for pname, p in trainer.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.shape == ref_params[pname].shape, pname
        assert rel(full.detach(), ref_params[pname]) < PARAM_RTOL, pname
        if pname.endswith("experts.w1") and degrees.get("ep", 1) > 1:
            ep = degrees["ep"]
            edp = WORLD // ep if pkw.get("fsdp") else 1  # FSDP shards each expert set over edp too
            assert p.to_local().shape[0] == model.n_experts // ep // edp  # each rank holds its experts only
        seen.append(pname)
    assert {n for names in comm.allgather(seen) for n in names} == set(ref_params)
    trainer.close()


@pytest.mark.skipif(WORLD != 4, reason="4 ranks")
def test_dispatch_then_combine_returns_the_input_with_gradients(comm):
    """Identity experts and weights 1/k: dispatch, experts and combine over the ep group give
    back each token exactly; its gradient is the incoming gradient exactly; an expert that gets
    no token is skipped cleanly."""
    group = dist.new_group(list(range(WORLD)))
    e, k, n, dim = 8, 2, 12, 6
    torch.manual_seed(comm.rank)
    x = torch.randn(n, dim, requires_grad=True)
    idx = torch.stack([torch.randperm(e - 1)[:k] for _ in range(n)])  # expert 7 gets nothing
    order, counts = permutation(idx, e)
    seen_counts = []

    def identity_experts(tokens, local_counts):
        seen_counts.append(list(local_counts))
        return tokens * 1.0

    dispatch = AllToAllDispatch(group, WORLD, comm.rank, e)
    y = dispatch(x[order // k], counts, identity_experts)
    out = torch.zeros_like(x).index_add(0, order // k, y * (1.0 / k))
    assert torch.equal(out, x)
    g = torch.randn(n, dim)
    out.backward(g)
    assert torch.equal(x.grad, g)
    # each rank's experts got what every rank routed to them
    all_counts = torch.tensor(comm.allgather(counts.tolist()))
    assert seen_counts[0] == all_counts[:, 2 * comm.rank:2 * comm.rank + 2].sum(0).tolist()
    if comm.rank == WORLD - 1:
        assert seen_counts[0][1] == 0
    # bytes handed to other ranks: what leaves for the other ranks' experts, both ways
    off = sum(counts[j * 2:(j + 1) * 2].sum() for j in range(WORLD) if j != comm.rank) * dim * 4
    back = (all_counts[:, 2 * comm.rank:2 * comm.rank + 2].sum()
            - all_counts[comm.rank, 2 * comm.rank:2 * comm.rank + 2].sum()) * dim * 4
    assert dispatch.sent_bytes == int(off + back)
    dist.destroy_process_group(group)


@pytest.mark.skipif(WORLD != 4, reason="4 ranks")
def test_grid_expert_groups_are_megatrons(comm):
    grid = ProcessGrid(tp=2, ep=2)
    try:
        assert grid.group("ep") == [comm.rank % 2, comm.rank % 2 + 2]
        assert grid.group("dp") == [comm.rank % 2, comm.rank % 2 + 2]  # dense dp includes ep
    finally:
        grid.free()


@pytest.mark.skipif(WORLD != 4, reason="4 ranks")
def test_moe_checkpoint_resumes_on_another_ep_degree(comm):
    """Experts are saved under their global index: a checkpoint of ep 4 resumes on ep 2 (with
    tp 2), ep 1 (dense dp 4) and ep 4 with the next-step losses of one uninterrupted process,
    each rank reading about the bytes of its own experts; and along a chain ep4 -> ep2 -> ep1."""
    import shutil
    import tempfile

    from hpcml.ckpt.tools import inspect
    from hpcml.train.checkpointing import load_trainer, save_trainer

    ref_losses = reference_run_with_stats(MODEL, TRAIN)[0]
    root = comm.bcast(tempfile.mkdtemp(prefix="hpcml-moe-") if comm.rank == 0 else None)
    try:
        first = build_llm_trainer(MODEL, TRAIN, ParallelConfig(), ep=4)
        first.fit(3)
        path = save_trainer(first, root).path
        first.close()
        for degrees in ({"ep": 2}, {"ep": 2, "tp": 2}, {"dp": 4}, {"ep": 4}):
            trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(), **degrees)
            report = load_trainer(trainer, path)
            assert trainer.step == 3 and not report.missing and not report.mismatched
            losses = [m["loss"] for m in trainer.fit(5)]
            assert losses == pytest.approx(ref_losses[3:5], rel=RTOL), degrees
            experts = [p for n, p in trainer.model.named_parameters() if "experts." in n]
            local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in experts)
            if degrees.get("ep", 1) > 1:
                # a rank's expert weights (and their moments) are 1/ep of all of them
                assert local * degrees["ep"] * degrees.get("tp", 1) == sum(p.numel() for p in experts)
            assert report.read_amplification < 1.5  # reads what it needs, not the whole file
            if degrees == {"ep": 2}:  # the chain ep4 -> ep2 -> ep1: ep2 saves at step 5 for ep1 below
                chained = save_trainer(trainer, f"{root}/chain").path
            trainer.close()
        last = build_llm_trainer(MODEL, TRAIN, ParallelConfig(), dp=4)  # ep 1: every rank all experts
        load_trainer(last, chained)
        assert last.step == 5
        assert [m["loss"] for m in last.fit(7)] == pytest.approx(ref_losses[5:7], rel=RTOL)
        last.close()
        # hpcml ckpt inspect: each expert tensor says how many experts its first dimension holds
        info = inspect(path)["tensors"]
        w1 = info["model/layers.0.feed_forward.experts.w1"]
        assert w1["shape"] == [8, 64, 64] and w1["experts"] == 8 and w1["pieces"] == 4
        assert info["optim/layers.1.feed_forward.experts.w2/exp_avg"]["experts"] == 8
        comm.Barrier()
    finally:
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
