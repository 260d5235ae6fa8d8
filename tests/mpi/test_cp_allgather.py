"""All-gather context parallelism (``ParallelConfig(cp_kind="allgather")``): equal to one process
in fp64 to 1e-10 at 2 and 4 ranks, also with fewer key/value heads than cp ranks (which Ulysses
refuses), with tp, FSDP and the GPT blocks; its memory against the planner's count is in
tests/mpi/test_plan_exact.py."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml.errors import ConfigError
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.recipe import build_llm_trainer
from tests.reference import reference_run

WORLD = MPI.COMM_WORLD.Get_size()
ONE_KV = TransformerConfig(vocab_size=120, dim=32, n_layers=3, n_heads=4, n_kv_heads=1, max_seq_len=32)
GPT = TransformerConfig(vocab_size=120, dim=32, n_layers=3, n_heads=4, max_seq_len=32, activation="gelu",
                        norm="layernorm", bias=True)
TRAIN = TrainConfig(steps=3, global_batch=8, micro_batch=2, seq_len=16, progress=False)
TOL = 1e-10
AG = {"cp_kind": "allgather"}
LAYOUTS = {
    4: [("cp4-1kv", ONE_KV, {"cp": 4}, AG), ("cp2xtp2", GPT, {"cp": 2, "tp": 2}, AG),
        ("cp2xfsdp2-1kv", ONE_KV, {"cp": 2}, {**AG, "fsdp": True}), ("cp2xpp2", GPT, {"cp": 2, "pp": 2}, AG)],
    2: [("cp2-1kv", ONE_KV, {"cp": 2}, AG), ("cp2-gpt-ac", GPT, {"cp": 2}, {**AG, "activation_checkpointing": True})],
}


pytestmark = pytest.mark.usefixtures("fp64_default")


@pytest.mark.parametrize("name,model,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_allgather_cp_equals_one_process_in_fp64(comm, name, model, degrees, pkw):
    ref_losses, ref_norms, ref_params = reference_run(model, TRAIN)
    trainer = build_llm_trainer(model, TRAIN, ParallelConfig(**pkw), **degrees)
    history = trainer.fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=TOL)
    assert [m["grad_norm"] for m in history] == pytest.approx(ref_norms, rel=TOL)
    for pname, p in trainer.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert float((full.detach() - ref_params[pname]).norm() / ref_params[pname].norm()) < TOL, pname
    trainer.close()


def test_ulysses_refuses_what_allgather_runs(comm):
    """One kv head on cp = WORLD: Ulysses cannot split it, in one line on every rank before a collective."""
    with pytest.raises(ConfigError, match="n_kv_heads 1 / tp 1 = 1 heads per rank is not divisible by cp"):
        build_llm_trainer(ONE_KV, TRAIN, ParallelConfig(), cp=WORLD)
    with pytest.raises(ConfigError, match="FPDT's chunks go through Ulysses"):
        ParallelConfig(cp_kind="allgather", fpdt_chunk=4)
