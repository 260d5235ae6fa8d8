"""The planner's memory model against the real thing, at 2 and 4 ranks: the parameter,
gradient and Adam-state elements each rank holds after a step equal ``hpcml.plan``'s count
exactly (tp, pp stages, FSDP's dim-0 chunks, DDP), and the bytes autograd saves for backward
in one forward are within 2% of its activation count (0.1-0.8% measured: token ids and the loss
scalar are the difference)."""

from __future__ import annotations

import logging
import pytest
import torch
from mpi4py import MPI
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.plan.memory import activation_bytes
from hpcml.plan.placement import rank_elements, rank_state
from hpcml.plan.candidate import PlanLayout
from hpcml.train import TrainConfig
from hpcml.train.memory import SavedBytes
from hpcml.train.recipe import build_llm_trainer

WORLD = MPI.COMM_WORLD.Get_size()
# vocab 250 pads to 256 and ffn 96 is not a multiple of 4 x 4: FSDP's chunks are uneven somewhere
MODEL = TransformerConfig(vocab_size=250, dim=64, n_layers=5, n_heads=8, n_kv_heads=4, ffn_hidden=96, max_seq_len=64)
MOE = TransformerConfig(vocab_size=250, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=96, max_seq_len=64,
                        n_experts=4, moe_top_k=2, moe_hidden=48, moe_every=2)
GPT = TransformerConfig(vocab_size=250, dim=64, n_layers=4, n_heads=8, ffn_hidden=96, max_seq_len=64,
                        activation="gelu", norm="layernorm", bias=True)
ALIBI = TransformerConfig(vocab_size=250, dim=64, n_layers=4, n_heads=8, ffn_hidden=96, max_seq_len=64,
                          positions="alibi")
TRAIN = TrainConfig(steps=1, global_batch=8, micro_batch=1, seq_len=32, progress=False)

LAYOUTS = {
    4: [("dp4", {"dp": 4}, {}), ("fsdp4", {"dp": 4}, {"fsdp": True}), ("zero2-4", {"dp": 4},
        {"fsdp": True, "reshard_after_forward": False}), ("tp2xfsdp2", {"tp": 2}, {"fsdp": True}),
        ("pp2xdp2", {"pp": 2}, {}), ("pp2xfsdp2", {"pp": 2}, {"fsdp": True}), ("cp2xfsdp2", {"cp": 2}, {"fsdp": True}),
        ("tp2xpp2", {"tp": 2, "pp": 2}, {}), ("tp2xdp2-sp", {"tp": 2}, {"sequence_parallel": True}),
        ("pp2-interleaved", {"pp": 2}, {"pp_schedule": "interleaved1f1b"}), ("tp4", {"tp": 4}, {}),
        ("pp4", {"pp": 4}, {}), ("cp2xtp2", {"cp": 2, "tp": 2}, {"fsdp": True}),
        ("moe-ep2xdp2", {"ep": 2}, {}), ("moe-ep2-fsdp", {"ep": 2}, {"fsdp": True}),
        ("moe-ep4-fsdp", {"ep": 4}, {"fsdp": True}), ("moe-tp2xep2", {"tp": 2, "ep": 2}, {}),
        ("gpt-tp2xfsdp2", {"tp": 2}, {"fsdp": True}), ("gpt-pp2xdp2", {"pp": 2}, {}), ("gpt-tp4", {"tp": 4}, {}),
        ("hsdp2x2", {"dp": 4}, {"fsdp": True, "dp_replicate": 2}),
        ("hsdp-cp2", {"cp": 2}, {"fsdp": True, "dp_replicate": 2})],
    2: [("dp2", {"dp": 2}, {}), ("fsdp2", {"dp": 2}, {"fsdp": True}), ("tp2", {"tp": 2}, {}),
        ("pp2", {"pp": 2}, {}), ("cp2", {"cp": 2}, {}), ("zero2-2", {"dp": 2}, {"fsdp": True,
        "reshard_after_forward": False}), ("moe-ep2", {"ep": 2}, {"fsdp": True}), ("gpt-tp2", {"tp": 2}, {}),
        ("gpt-fsdp2", {"dp": 2}, {"fsdp": True})],
}


def _plan_layout(degrees: dict, pcfg: ParallelConfig, model: TransformerConfig = MODEL, **kw) -> PlanLayout:
    zero = (2 if not pcfg.reshard_after_forward else 3) if pcfg.fsdp else 0
    return PlanLayout(model=model, gpus=WORLD, ep=degrees.get("ep", 1), gpu="a100-80gb", seq_len=TRAIN.seq_len,
                      global_batch=TRAIN.global_batch, micro_batch=TRAIN.micro_batch, tp=degrees.get("tp", 1),
                      pp=degrees.get("pp", 1), cp=degrees.get("cp", 1), zero=zero,
                      sequence_parallel=pcfg.sequence_parallel,
                      schedule=pcfg.pp_schedule, precision="fp32", dp_replicate=pcfg.dp_replicate, **kw)


def _local(t) -> torch.Tensor:
    """The plain tensor holding ``t``'s bytes on this rank (a DTensor's shard, the result inside
    a functional collective's wrapper)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


@pytest.fixture(autouse=True, scope="module")
def _quiet_dtensor():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_states_equal_the_plan_exactly(comm, name, degrees, pkw):
    pcfg = ParallelConfig(**pkw)
    model = MOE if name.startswith("moe") else GPT if name.startswith("gpt") else MODEL
    trainer = build_llm_trainer(model, TRAIN, pcfg, **degrees)
    trainer.optimizer.zero_grad = lambda set_to_none=True: None  # keep this step's gradients to count them
    trainer.fit()
    params = list(trainer.model.parameters())
    got = {"params": sum(_local(p).numel() for p in params),
           "grads": sum(_local(p.grad).numel() for p in params if p.grad is not None),
           "optimizer": sum(_local(trainer.optimizer.state[p]["exp_avg"]).numel() for p in params
                            if p in trainer.optimizer.state),
           "tensors": sum("step" in trainer.optimizer.state.get(p, {}) for p in params)}
    lay = _plan_layout(degrees, pcfg, model)
    c = trainer.grid.coords
    want = rank_elements(model, lay, c["pp"], c["dp"] * lay.cp + c["cp"], c.get("edp", 0))
    assert got == want, f"rank {comm.rank} {c}"
    if c["dp"] == 0 and c["cp"] == 0:  # the first shard: what the planner prices
        st = rank_state(model, lay, c["pp"])
        assert (st.params, st.grads, st.optimizer, st.tensors) == tuple(want.values())
    trainer.close()


SAVED = {4: [("dp4", {"dp": 4}, {}), ("fsdp4", {"dp": 4}, {"fsdp": True}), ("cp2xdp2", {"cp": 2}, {}),
             ("tp2xdp2", {"tp": 2}, {}), ("tp2xdp2-sp", {"tp": 2}, {"sequence_parallel": True}),
             ("full-ac", {"dp": 4}, {"activation_checkpointing": True}),
             ("cp2xtp2-fpdt", {"cp": 2, "tp": 2}, {"fpdt_chunk": 4}), ("cp4-fpdt", {"cp": 4}, {"fpdt_chunk": 2}),
             ("gpt-tp2xdp2-sp", {"tp": 2}, {"sequence_parallel": True}), ("gpt-cp2xdp2", {"cp": 2}, {}),
             ("cp4-allgather", {"cp": 4}, {"cp_kind": "allgather"}),
             ("cp2xtp2-allgather", {"cp": 2, "tp": 2}, {"cp_kind": "allgather"}),
             ("alibi-cp2xtp2", {"cp": 2, "tp": 2}, {}),
             ("alibi-cp2xdp2-allgather", {"cp": 2}, {"cp_kind": "allgather"}),
             ("alibi-fsdp4", {"dp": 4}, {"fsdp": True}), ("cp2xdp2-loss-chunk", {"cp": 2}, {"loss_chunk": 4}),
             ("tp2xdp2-loss-chunk", {"tp": 2}, {"loss_chunk": 8}), ("tp2xfsdp2", {"tp": 2}, {"fsdp": True}),
             ("gpt-tp2xfsdp2", {"tp": 2}, {"fsdp": True})],
         2: [("tp2", {"tp": 2}, {}), ("fsdp2", {"dp": 2}, {"fsdp": True}), ("cp2-fpdt", {"cp": 2}, {"fpdt_chunk": 4}),
             ("dp2-fpdt", {"dp": 2}, {"fpdt_chunk": 8, "fsdp": True}), ("gpt-tp2", {"tp": 2}, {}),
             ("cp2-allgather", {"cp": 2}, {"cp_kind": "allgather"}), ("alibi-tp2", {"tp": 2}, {}),
             ("fsdp2-loss-chunk", {"dp": 2}, {"fsdp": True, "loss_chunk": 8}),
             ("tp2-loss-chunk", {"tp": 2}, {"loss_chunk": 4})]}


@pytest.mark.parametrize("name,degrees,pkw", SAVED.get(WORLD, []), ids=[x[0] for x in SAVED.get(WORLD, [])])
def test_saved_activations_match_the_plan(comm, name, degrees, pkw):
    """One micro-batch's forward and loss under the memory account (``hpcml.train.memory``: the
    distinct storages autograd keeps that are not parameters or buffers, FSDP's gathered weights
    and DTensor's included as parameters), summed, against :func:`activation_bytes` for one
    micro-batch in flight."""
    pcfg = ParallelConfig(**pkw)
    cfg = GPT if name.startswith("gpt") else ALIBI if name.startswith("alibi") else MODEL
    trainer = build_llm_trainer(cfg, TRAIN, pcfg, **degrees)
    model = trainer.model.parts[0]
    account = SavedBytes({}, [model])  # the training loop's memory account
    x, y = trainer.local_batch(0)
    x, y = x[:TRAIN.micro_batch], y[:TRAIN.micro_batch]  # one micro-batch
    with trainer.model.loss_context():
        with account:
            loss = model(x, targets=y) if trainer.model.computes_loss else trainer.model.loss_fn(model(x), y)
        loss.backward()
    lay = _plan_layout(degrees, pcfg, cfg, recompute="full" if pcfg.activation_checkpointing else "none",
                       fpdt_chunk=pcfg.fpdt_chunk, cp_kind=pcfg.cp_kind, loss_chunk=pcfg.loss_chunk)
    want, _ = activation_bytes(cfg, lay, 0, rank_state(cfg, lay, 0))
    got = sum(account.take()[0].values())
    assert got == pytest.approx(want, rel=0.02), f"rank {comm.rank}: saved {got} B, planned {want:.0f} B"
    trainer.close()


# (without FSDP, autocast's path over an fp32 stream: each linear keeps its own bf16 cast of the input, and
# the weights' cached casts leave out the embedding and the norms -- 9% more than planned at tp 2 before)
BF16 = {4: [("fsdp4", {"dp": 4}, {"fsdp": True}), ("zero2-4", {"dp": 4}, {"fsdp": True,
                                                                         "reshard_after_forward": False}),
            ("autocast-tp2xdp2", {"tp": 2}, {}), ("autocast-dp4", {"dp": 4}, {})],
        2: [("fsdp2", {"dp": 2}, {"fsdp": True}), ("fsdp2-loss-chunk", {"dp": 2}, {"fsdp": True, "loss_chunk": 8}),
            ("autocast-tp2", {"tp": 2}, {})]}


@pytest.mark.parametrize("name,degrees,pkw", BF16.get(WORLD, []), ids=[x[0] for x in BF16.get(WORLD, [])])
def test_saved_activations_in_bf16_match_the_plan(comm, name, degrees, pkw):
    """:func:`test_saved_activations_match_the_plan` in bf16 under FSDP: the trainer gathers bf16
    weights (no autocast copies, a bf16 residual stream; its RMSNorm keeps an fp32 copy of its
    input). It failed by 13.7% before the norm's copy was counted."""
    import dataclasses

    pcfg = ParallelConfig(**pkw)
    train = dataclasses.replace(TRAIN, bf16=True)
    trainer = build_llm_trainer(MODEL, train, pcfg, **degrees)
    model = trainer.model.parts[0]
    account = SavedBytes({}, [model])
    x, y = trainer.local_batch(0)
    x, y = x[:TRAIN.micro_batch], y[:TRAIN.micro_batch]
    with trainer.model.loss_context():
        with torch.autocast("cpu", dtype=torch.bfloat16), account:
            loss = model(x, targets=y) if trainer.model.computes_loss else trainer.model.loss_fn(model(x), y)
        loss.backward()
    lay = _plan_layout(degrees, pcfg, MODEL)
    lay = dataclasses.replace(lay, precision="bf16", loss_chunk=pcfg.loss_chunk)
    want, _ = activation_bytes(MODEL, lay, 0, rank_state(MODEL, lay, 0))
    got = sum(account.take()[0].values())
    assert got == pytest.approx(want, rel=0.02), f"rank {comm.rank}: saved {got} B, planned {want:.0f} B"
    trainer.close()
