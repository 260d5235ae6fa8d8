"""A Hugging Face Llama loaded into a parallel layout: step-0 logits equal transformers' on the
same tokens (fp32, 1e-5), and each rank read only its own pieces (any rank count)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml.interop import hf
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.recipe import build_llm_trainer

pytest.importorskip("transformers")

from tests.hf_reference import hf_logits, make_llama  # noqa: E402

WORLD = MPI.COMM_WORLD.Get_size()
TRAIN = TrainConfig(steps=1, global_batch=4, micro_batch=1, seq_len=16, progress=False)
TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
LAYOUTS = {
    2: [("tp2", {"tp": 2}, {}), ("pp2", {"pp": 2}, {}), ("fsdp2", {"dp": 2}, {"fsdp": True}),
        ("tp2-qwen2", {"tp": 2}, {}), ("tp2-qwen2-fused", {"tp": 2}, {})],
    4: [("tp2xfsdp2", {"tp": 2}, {"fsdp": True}), ("pp2xtp2-fused", {"pp": 2, "tp": 2}, {})],
}


@pytest.fixture(scope="module")
def hf_model(comm):
    """A random HF Llama (grouped-query, vocabulary 250: hpcml pads it to 256) and a Qwen2 (the
    same with q, k, v biases) on rank 0's disk, and their logits on TOKENS, for all ranks."""
    root = tempfile.mkdtemp(prefix="hpcml_hf_") if comm.rank == 0 else None
    want = {k: hf_logits(make_llama(Path(root) / k, kv_heads=2, qwen2=k == "qwen2"), TOKENS)
            for k in ("llama", "qwen2")} if comm.rank == 0 else None
    root, want = comm.bcast((root, want))
    yield Path(root), want
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(root)


def full_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    """The whole model's logits on every rank: one forward per stage, hidden states passed down the pipeline."""
    grid, part = trainer.grid, trainer.model.parts[0]
    pp, stage = grid.layout.pp, grid.coords["pp"]
    comm = grid.comm_for("pp")
    with torch.no_grad():
        h = tokens if stage == 0 else torch.from_numpy(comm.recv(source=stage - 1))
        out = part(h)
        out = out.full_tensor() if isinstance(out, DTensor) else out
    if stage < pp - 1:
        comm.send(out.numpy(), dest=stage + 1)
    return torch.from_numpy(comm.bcast(out.numpy() if stage == pp - 1 else None, root=pp - 1))


@pytest.mark.parametrize("name,degrees,pkw", LAYOUTS.get(WORLD, []), ids=[x[0] for x in LAYOUTS.get(WORLD, [])])
def test_step0_logits_equal_transformers(comm, hf_model, name, degrees, pkw):
    root, wants = hf_model
    kind = "qwen2" if "qwen2" in name else "llama"
    hf_dir, want = root / kind, wants[kind]
    fused = {"fused_qkv": True, "fused_mlp": True} if "fused" in name else {}
    untie = {"tie_embeddings": False}
    trainer = build_llm_trainer(hf.config_from_hf(hf_dir, **fused, **untie), TRAIN, ParallelConfig(**pkw), **degrees)
    report = hf.load_hf_into(trainer, hf_dir)
    got = full_logits(trainer, TOKENS)[..., :250]
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    read = comm.allgather(report.bytes_read)
    assert max(read) < 0.75 * report.hf_bytes, read  # no rank read the whole model
    assert sum(read) >= report.hf_bytes  # ... and together they read all of it
    assert trainer.step == 0
    trainer.close()
