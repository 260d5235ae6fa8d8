"""GPT/MPT/BLOOM blocks in the trainer (GeLU MLP, LayerNorm, biases on every projection and norm,
rotary, learned or ALiBi positions):
every parallel layout equals one process in fp64 to 1e-10 (losses, gradient norms, every
parameter after the steps), at 2 and 4 ranks; the planner prices the same blocks
(tests/mpi/test_plan_exact.py counts their memory)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.recipe import build_llm_trainer
from tests.reference import reference_run

WORLD = MPI.COMM_WORLD.Get_size()
GPT = TransformerConfig(vocab_size=120, dim=32, n_layers=4, n_heads=4, max_seq_len=32, activation="gelu",
                        norm="layernorm", bias=True, tie_embeddings=False)
MPT = TransformerConfig(vocab_size=120, dim=32, n_layers=4, n_heads=4, max_seq_len=16, activation="gelu",
                        norm="layernorm", bias=True, positions="learned", tie_embeddings=True)
ALIBI = TransformerConfig(vocab_size=120, dim=32, n_layers=4, n_heads=4, max_seq_len=16, activation="gelu",
                          norm="layernorm", bias=True, positions="alibi", tie_embeddings=False)
TRAIN = TrainConfig(steps=3, global_batch=8, micro_batch=2, seq_len=16, progress=False)
TOL = 1e-10

LAYOUTS = {
    4: [("fsdp4", {"dp": 4}, {"fsdp": True}), ("tp2xdp2-sp", {"tp": 2}, {"sequence_parallel": True}),
        ("tp2xfsdp2", {"tp": 2}, {"fsdp": True}), ("pp2xdp2", {"pp": 2}, {}), ("cp2xtp2", {"cp": 2, "tp": 2}, {}),
        ("tp4-ac", {"tp": 4}, {"activation_checkpointing": True}),
        ("mpt-cp2xfsdp2", {"cp": 2}, {"fsdp": True}), ("mpt-cp4-allgather", {"cp": 4}, {"cp_kind": "allgather"}),
        ("alibi-cp2xtp2", {"cp": 2, "tp": 2}, {}),
        ("alibi-cp2xtp2-allgather", {"cp": 2, "tp": 2}, {"cp_kind": "allgather"}),
        ("alibi-pp2xfsdp2", {"pp": 2}, {"fsdp": True})],
    2: [("dp2", {"dp": 2}, {}), ("fsdp2", {"dp": 2}, {"fsdp": True}), ("tp2", {"tp": 2}, {}),
        ("pp2", {"pp": 2}, {}), ("cp2", {"cp": 2}, {}), ("mpt-cp2", {"cp": 2}, {}),
        ("mpt-fsdp2", {"dp": 2}, {"fsdp": True}),
        ("alibi-tp2-sp", {"tp": 2}, {"sequence_parallel": True}), ("alibi-cp2", {"cp": 2}, {})],
}


pytestmark = pytest.mark.usefixtures("fp64_default")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within TOL relative -- or 1e-12 absolute for a parameter whose gradient is zero in exact
    arithmetic (the k projection's bias under learned positions: softmax does not see it), which
    Adam moves by rounding noise alone."""
    return float((a - b).norm()) <= TOL * float(b.norm()) + 1e-12


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_gpt_blocks_equal_one_process_in_fp64(comm, name, degrees, pkw):
    """GPT blocks with rotary positions; ``mpt-``: MPT's (learned positions, tied embedding: no tp, no pp);
    ``alibi-``: BLOOM's positions (each tp and Ulysses rank biasing its own heads)."""
    model = MPT if name.startswith("mpt") else ALIBI if name.startswith("alibi") else GPT
    ref_losses, ref_norms, ref_params = reference_run(model, TRAIN)
    assert next(iter(ref_params.values())).dtype == torch.float64
    assert {"layers.0.feed_forward.w1.bias", "layers.0.attention_norm.bias", "layers.0.attention.wo.bias"} \
        <= set(ref_params) and "layers.0.feed_forward.w3.weight" not in ref_params
    assert ("pos_embeddings.weight" in ref_params) == (model is MPT)
    trainer = build_llm_trainer(model, TRAIN, ParallelConfig(**pkw), **degrees)
    history = trainer.fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL)
    assert [m["grad_norm"] for m in history] == pytest.approx(ref_norms, rel=TOL)
    assert history[-1]["loss"] < history[0]["loss"]  # it learns
    seen = []
    for pname, p in trainer.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.dtype == torch.float64 and _close(full.detach(), ref_params[pname]), pname
        seen.append(pname)
    assert {n for names in comm.allgather(seen) for n in names} == set(ref_params)
    trainer.close()
