"""Checkpoints on real MPI: save under each training layout, load under others, bitwise;
strict-mode errors and corruption raised on every rank; bf16 round trip."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import h5py
import pytest
import torch
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml import ckpt
from hpcml.errors import CheckpointError
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.checkpointing import _tensors, load_trainer, save_trainer
from hpcml.train.recipe import build_llm_trainer
from tests.mpi.test_parallel_train import LAYOUTS

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig.preset("tiny")
TRAIN = TrainConfig(steps=4, global_batch=8, micro_batch=1, seq_len=32, progress=False)
CASES = [c for c in LAYOUTS.get(WORLD, []) if c[0] in {"dp4", "fsdp4", "tp2xdp2", "tp2xfsdp2", "pp2xdp2", "cp2xdp2",
                                                       "tp2xpp2", "cp2xtp2", "pp2xfsdp2-interleaved",
                                                       "dp2", "fsdp2", "tp2", "pp2", "cp2"}]


@pytest.fixture(scope="module")
def shared_dir(comm):
    name = comm.bcast(tempfile.mkdtemp(prefix="hpcml-ckpt-") if comm.rank == 0 else None)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return Path(name)


def _global(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_save_here_load_elsewhere_bitwise(comm, shared_dir, i):
    name, degrees, pkw = CASES[i]
    root = shared_dir / f"save-{name}"
    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(**pkw), **degrees)
    trainer.fit(2)
    result = save_trainer(trainer, root)
    # what this rank holds is exactly what the index presents, bitwise
    with h5py.File(result.path / "index.h5", "r") as index:
        for tname, t in _tensors(trainer).items():
            if tname.startswith("rank_state/"):
                continue
            local, gshape, offset = ckpt.state.local_piece(t)
            stored = ckpt.read_tensor(index, tname)
            assert tuple(stored.shape) == gshape, tname
            box = tuple(slice(o, o + s) for o, s in zip(offset, local.shape))
            assert torch.equal(stored[box] if box else stored, local.cpu()), tname
    # load under another layout (a fresh model with another seed; the rotation makes every layout a loader once)
    # and compare reassembled tensors
    for other in (CASES[(i + 3) % len(CASES)],):
        _, odeg, opkw = other
        fresh = build_llm_trainer(MODEL, TrainConfig(**{**TRAIN.__dict__, "seed": 9}), ParallelConfig(**opkw), **odeg)
        report = load_trainer(fresh, root)
        assert fresh.step == 2 and report.step == 2 and report.layout == trainer.grid.layout.degrees
        assert report.read_amplification <= 1.25, report.read_amplification  # tiny tensors; large: benchmarks
        with h5py.File(result.path / "index.h5", "r") as index:
            for tname, t in _tensors(fresh).items():
                if not tname.startswith("rank_state/"):
                    assert torch.equal(_global(t), ckpt.read_tensor(index, tname)), (other[0], tname)
        # and training goes on from there: one more step gives the saver's next loss
        fresh.data = trainer.data
        assert fresh.train_step()["loss"] == pytest.approx(_next_loss(trainer), rel=1e-4), other[0]


_NEXT: dict[int, float] = {}


def _next_loss(trainer) -> float:
    key = id(trainer)
    if key not in _NEXT:
        _NEXT[key] = trainer.train_step()["loss"]
    return _NEXT[key]


def test_strict_errors_on_every_rank(comm, shared_dir):
    root = shared_dir / "strict"
    tensors = {"model/a": torch.arange(6.0).reshape(2, 3), "model/b": torch.ones(4)}
    ckpt.save(root, 1, tensors, comm=comm)
    with pytest.raises(CheckpointError) as info:
        ckpt.load(root, {"model/a": torch.zeros(3, 2), "model/c": torch.zeros(1)}, comm=comm)
    msg = str(info.value)
    assert "missing ['model/c']" in msg and "unexpected ['model/b']" in msg
    assert "mis-shaped ['model/a: checkpoint [2, 3], model [3, 2]']" in msg
    assert comm.allgather(msg) == [msg] * WORLD
    target = {"model/a": torch.zeros(2, 3)}
    report = ckpt.load(root, target, strict=False, comm=comm)
    assert report.unexpected == ["model/b"] and torch.equal(target["model/a"], tensors["model/a"])


def test_bf16_round_trip_and_storage(comm, shared_dir):
    root = shared_dir / "bf16"
    torch.manual_seed(1)
    value = torch.randn(8, 5).to(torch.bfloat16)
    # each rank holds a row block of a global tensor, as a plain tensor named per rank
    rows = value[comm.rank::WORLD]
    ckpt.save(root, 3, {"model/w": value, f"rank_state/rank_{comm.rank:05d}/rows": rows}, comm=comm)
    back = {"model/w": torch.zeros(8, 5, dtype=torch.bfloat16)}
    ckpt.load(root, back, comm=comm)
    assert torch.equal(back["model/w"].view(torch.int16), value.view(torch.int16))
    with h5py.File(ckpt.resolve(root) / "index.h5", "r") as f:
        assert f["model/w"].dtype == "uint16" and f["model/w"].attrs["dtype"] == "bfloat16"


def test_corrupt_and_truncated_shards_are_named(comm, shared_dir):
    root = shared_dir / "corrupt"
    big = torch.arange(WORLD * 4096, dtype=torch.float32).reshape(WORLD, 4096)
    mine = {f"model/p{r}": big[r] + r for r in range(WORLD)}
    # rank r holds p_r only: each shard has data the others need
    ckpt.save(root, 1, {f"model/p{comm.rank}": mine[f"model/p{comm.rank}"]}, comm=comm)
    path = ckpt.resolve(root)
    comm.Barrier()
    if comm.rank == 0:
        shard = path / "rank_00001.h5" if WORLD > 1 else path / "rank_00000.h5"
        data = bytearray(shard.read_bytes())
        pos = data.find((big[1 if WORLD > 1 else 0] + (1 if WORLD > 1 else 0))[100:104].numpy().tobytes())
        assert pos > 0
        data[pos:pos + 4] = b"\xff\xff\xff\xff"
        shard.write_bytes(bytes(data))
    comm.Barrier()
    target = {f"model/p{r}": torch.zeros(4096) for r in range(WORLD)}
    with pytest.raises(CheckpointError) as info:
        ckpt.load(root, target, comm=comm)
    assert "rank_0000" in str(info.value) and "failed" in str(info.value)
    comm.Barrier()
    if comm.rank == 0:
        shard = path / "rank_00000.h5"
        shard.write_bytes(shard.read_bytes()[:-100])
    comm.Barrier()
    with pytest.raises(CheckpointError) as info:
        ckpt.load(root, target, comm=comm)
    assert f"shard {path / 'rank_00000.h5'} is" in str(info.value) and "truncated" in str(info.value)


def test_async_save_snapshots_then_overlaps(comm, shared_dir):
    """The checkpoint holds the values at save() time even though training changes them at once
    (torch DCP's async_save once wrote post-update values, pytorch#144657)."""
    root = shared_dir / "async"
    saver = ckpt.AsyncSaver(comm)
    w = torch.full((WORLD * 256, 512), float(comm.rank))
    rows = slice(comm.rank * 256, (comm.rank + 1) * 256)
    mine = w[rows]
    blocked = saver.save(root, 1, {f"model/shard{comm.rank}": mine})
    mine.add_(100.0)  # the next optimizer step, while the writer runs
    assert saver.wait().path == root / "step_00000001"
    assert saver.wait() is None  # nothing in flight any more
    back = {f"model/shard{r}": torch.zeros(256, 512) for r in range(WORLD)}
    ckpt.load(root, back, comm=comm)
    assert [float(back[f"model/shard{r}"].mean()) for r in range(WORLD)] == [float(r) for r in range(WORLD)]
    assert blocked < 30.0
    # a second save while one is in flight waits for the first, and both commit
    saver.save(root, 2, {f"model/shard{comm.rank}": mine})
    saver.save(root, 3, {f"model/shard{comm.rank}": mine * 2}, keep=2)
    saver.wait()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    ckpt.load(root, back, comm=comm)
    assert float(back["model/shard0"].mean()) == 200.0


def test_collective_single_file_mode(comm, shared_dir):
    """All ranks write one shared.h5 through MPI-IO; the same reader loads it on another layout."""
    root = shared_dir / "single"
    degrees = {"tp": 2} if WORLD % 2 == 0 else {}
    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(fsdp=WORLD > 2), **degrees)
    trainer.fit(1)
    tensors = {n: t for n, t in _tensors(trainer).items() if not n.startswith("rank_state/")}
    result = ckpt.save(root, 1, tensors, comm=comm, single_file=True, layout=trainer.grid.layout.degrees)
    assert sorted(p.name for p in result.path.iterdir()) == ["index.h5", "shared.h5"]
    fresh = build_llm_trainer(MODEL, TrainConfig(**{**TRAIN.__dict__, "seed": 4}), ParallelConfig(), dp=WORLD)
    target = ckpt.training_tensors(fresh.model.named_parameters(), fresh.optimizer, create=True)
    report = ckpt.load(root, target, comm=comm)
    assert report.read_amplification == 1.0
    with h5py.File(result.path / "index.h5", "r") as index:
        for name, t in target.items():
            assert torch.equal(_global(t), ckpt.read_tensor(index, name)), name
        assert index["model/output.weight"].is_virtual  # a virtual view onto shared.h5
    # what the saver held is what was written
    with h5py.File(result.path / "shared.h5", "r") as f:
        for name, t in tensors.items():
            local, _, offset = ckpt.state.local_piece(t)
            box = tuple(slice(o, o + s) for o, s in zip(offset, local.shape)) if local.dim() else (slice(0, 1),)
            assert torch.equal(torch.from_numpy(f[name][box]).reshape(local.shape), local), name
