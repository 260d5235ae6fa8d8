"""The output layer and loss a chunk of positions at a time (``ParallelConfig.loss_chunk``): equal
to one process in fp64 (1e-10) on dp, FSDP (each sync), tp, cp and a tied embedding; the memory
account of a step holds no whole logits, as the planner counts it; what cannot chunk is refused on
every rank before any collective."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from hpcml.errors import ConfigError
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.recipe import build_llm_trainer
from tests.reference import assert_trains_as_one_process

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = pytest.mark.usefixtures("fp64_default")
MODEL = TransformerConfig.preset("tiny")
TRAIN = TrainConfig(steps=3, global_batch=8, micro_batch=2, seq_len=32, progress=False)
TOL = 1e-10

LAYOUTS = {
    2: [("dp2", {"dp": 2}, {}), ("fsdp2", {"dp": 2}, {"fsdp": True}),
        ("fsdp2-step", {"dp": 2}, {"fsdp": True, "grad_sync": "step"}), ("tp2", {"tp": 2}, {}),
        ("cp2", {"cp": 2}, {}), ("cp2-allgather", {"cp": 2}, {"cp_kind": "allgather"})],
    4: [("tp2xfsdp2", {"tp": 2}, {"fsdp": True}), ("cp2xdp2", {"cp": 2}, {})],
}


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
@pytest.mark.parametrize("chunk", [4, 8])
def test_a_chunked_loss_trains_as_one_process(comm, name, degrees, pkw, chunk):
    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(loss_chunk=chunk, **pkw), **degrees)
    assert trainer.model.computes_loss
    assert_trains_as_one_process(trainer, MODEL, TRAIN, TOL)


@pytest.mark.skipif(WORLD != 2, reason="dp 2")
def test_a_tied_embedding_takes_both_gradients(comm):
    model = TransformerConfig.preset("tiny", tie_embeddings=True)
    assert_trains_as_one_process(build_llm_trainer(model, TRAIN, ParallelConfig(loss_chunk=8), dp=2), model, TRAIN, TOL)


BAD = [
    ({"pp": WORLD}, {"loss_chunk": 8}, TrainConfig(global_batch=8, micro_batch=1),
     "loss_chunk 8 with pp {w}: the pipeline's schedule computes the loss itself; the chunked loss runs without a "
     "pipeline"),
    ({"cp": WORLD}, {"loss_chunk": 12}, TRAIN,
     "seq_len 32 is not divisible by cp {w} x loss_chunk 12 = {c} (the loss runs over whole chunks of each rank's "
     "positions)"),
]


@pytest.mark.parametrize("degrees,pkw,train,message", BAD, ids=["pp", "divides"])
def test_what_cannot_chunk_is_refused_on_every_rank_before_collectives(comm, degrees, pkw, train, message):
    with pytest.raises(ConfigError) as info:
        build_llm_trainer(MODEL, train, ParallelConfig(**pkw), **degrees)
    got = str(info.value)
    assert got == message.format(w=WORLD, c=WORLD * 12)
    assert comm.allgather(got) == [got] * WORLD
