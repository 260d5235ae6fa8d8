"""Checkpoints on real MPI: save under each training layout, load under others, bitwise;
strict-mode errors and corruption raised on every rank; bf16 round trip; fused QKV
sub-parameters re-split under a tp change."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import h5py
import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hpcml import ckpt
from hpcml.ckpt import tools
from hpcml.ckpt.state import fused_attrs
from hpcml.errors import CheckpointError
from hpcml.grid import ProcessGrid
from hpcml.models.transformer import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.checkpointing import load_trainer, save_trainer
from hpcml.train.recipe import build_llm_trainer
from tests.mpi.helpers import needs_world
from tests.mpi.test_parallel_train import LAYOUTS

WORLD = MPI.COMM_WORLD.Get_size()
MODEL = TransformerConfig.preset("tiny")
TRAIN = TrainConfig(steps=4, global_batch=8, micro_batch=2, seq_len=32, progress=False)
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
    with ckpt.Checkpoint(result.path) as ck:  # opened once: each open checks the manifest and every shard's digest
        for tname, t in trainer.state_tensors().items():
            if tname.startswith("rank_state/"):
                continue
            local, gshape, offset = ckpt.state.local_piece(t)
            stored = ckpt.read_tensor(ck, tname)
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
        with ckpt.Checkpoint(result.path) as ck:
            for tname, t in fresh.state_tensors().items():
                if not tname.startswith("rank_state/"):
                    assert torch.equal(_global(t), ckpt.read_tensor(ck, tname)), (other[0], tname)
        # and training goes on from there: one more step gives the saver's next loss
        fresh.data = trainer.data
        # (no cache keyed by id(trainer): ids are reused after collection, differently on each rank,
        # so one rank skipped this step while the others waited in its collectives: a hang)
        fresh_loss = fresh.train_step()["loss"]
        assert fresh_loss == pytest.approx(trainer.train_step()["loss"], rel=1e-4), other[0]


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


def test_errors_on_one_rank_before_the_plan_fail_every_rank(comm, shared_dir):
    """A save whose root cannot be made (only rank 0 makes it), or with a dtype only one rank
    holds that cannot be stored, fails on every rank with one message; nothing hangs and the
    file in the way is untouched."""
    blocker = shared_dir / "a_file"
    if comm.rank == 0:
        blocker.write_text("keep me")
    comm.Barrier()
    for saver in (lambda r, s, t: ckpt.save(r, s, t, comm=comm), ckpt.AsyncSaver(comm).save):
        with pytest.raises(CheckpointError) as info:
            saver(blocker, 1, {"model/a": torch.ones(2)})
        msg = str(info.value)
        assert "rank 0: FileExistsError" in msg and comm.allgather(msg) == [msg] * WORLD
    odd = {"model/a": torch.ones(2)} | ({"model/z": torch.ones(2, dtype=torch.complex64)}
                                        if comm.rank == WORLD - 1 else {})
    with pytest.raises(CheckpointError) as info:
        ckpt.save(shared_dir / "odd", 1, odd, comm=comm)
    assert "complex64" in str(info.value) and comm.allgather(str(info.value)) == [str(info.value)] * WORLD
    assert blocker.read_text() == "keep me" and not (shared_dir / "odd" / "latest").exists()


def test_any_error_of_one_ranks_load_fails_every_rank(comm, shared_dir, monkeypatch):
    """A load that fails on one rank with something other than a CheckpointError (a newcomer's
    expand()ed target raised torch's RuntimeError there) is raised on every rank: the others
    waited for it forever. A meta target is refused on the rank that holds it, and so on all."""
    from hpcml.ckpt import reader

    ckpt.save(shared_dir / "any", 1, {"model/a": torch.arange(4.0)}, comm=comm)
    real = reader._load

    def broken(*a, **k):
        if comm.rank == WORLD - 1:
            raise RuntimeError("a fault no check foresaw")
        return real(*a, **k)
    monkeypatch.setattr(reader, "_load", broken)
    with pytest.raises(CheckpointError) as info:
        ckpt.load(shared_dir / "any", {"model/a": torch.zeros(4)}, comm=comm)
    msg = str(info.value)
    assert msg == f"rank {WORLD - 1}: RuntimeError: a fault no check foresaw" and comm.allgather(msg) == [msg] * WORLD
    monkeypatch.setattr(reader, "_load", real)
    target = {"model/a": torch.empty(4, device="meta") if comm.rank == 0 else torch.zeros(4)}
    with pytest.raises(CheckpointError, match="'model/a' is on the meta device"):
        ckpt.load(shared_dir / "any", target, comm=comm)


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
        assert f.attrs["format_version"] == "2.0"


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
    assert "rank_0000" in str(info.value) and "fails its CRC-32: corrupted or replaced" in str(info.value)
    comm.Barrier()
    if comm.rank == 0:
        shard = path / "rank_00000.h5"
        shard.write_bytes(shard.read_bytes()[:-100])
    comm.Barrier()
    with pytest.raises(CheckpointError) as info:
        ckpt.load(root, target, comm=comm)
    assert f"{path / 'rank_00000.h5'} is" in str(info.value) and "truncated" in str(info.value)


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
    assert sorted(p.name for p in root.iterdir()) == [".hpcml-lock", "latest", "step_00000002", "step_00000003"]
    ckpt.load(root, back, comm=comm)
    assert float(back["model/shard0"].mean()) == 200.0
    # overlap: the copy runs in the background; after wait_staged() the tensors may change
    saver.save(root, 4, {f"model/shard{comm.rank}": mine}, overlap=True)
    saver.wait_staged()
    mine.add_(1000.0)
    saver.close()
    ckpt.load(root, back, comm=comm)
    assert [float(back[f"model/shard{r}"].mean()) for r in range(WORLD)] == [100.0 + r for r in range(WORLD)]
    assert (root / "latest").read_text().strip() == "step_00000004"


def test_collective_single_file_mode(comm, shared_dir):
    """All ranks write one shared.h5 through MPI-IO; the same reader loads it on another layout."""
    root = shared_dir / "single"
    # tp at 2 ranks, FSDP at 4 (tp x FSDP's first optimizer step on 2 oversubscribed cores costs
    # torch's DTensor sharding propagation a minute while the other ranks spin in MPI)
    degrees = {"tp": 2} if WORLD == 2 else {}
    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(fsdp=WORLD > 2), **degrees)
    trainer.fit(1)
    tensors = {n: t for n, t in trainer.state_tensors().items() if not n.startswith("rank_state/")}
    result = ckpt.save(root, 1, tensors, comm=comm, single_file=True, layout=trainer.grid.layout.degrees)
    assert sorted(p.name for p in result.path.iterdir()) == ["index.h5", "manifest.json", "shared.h5"]
    fresh = build_llm_trainer(MODEL, TrainConfig(**{**TRAIN.__dict__, "seed": 4}), ParallelConfig(), dp=WORLD)
    target = ckpt.training_tensors(fresh.model.named_parameters(), fresh.optimizer, create=True)
    report = ckpt.load(root, target, comm=comm)
    assert report.read_amplification == 1.0
    with ckpt.Checkpoint(result.path) as ck:
        for name, t in target.items():
            assert torch.equal(_global(t), ckpt.read_tensor(ck, name)), name
    with h5py.File(result.path / "index.h5", "r") as index:
        assert index["model/output.weight"].is_virtual  # a virtual view onto shared.h5
    # what the saver held is what was written
    with h5py.File(result.path / "shared.h5", "r") as f:
        for name, t in tensors.items():
            local, _, offset = ckpt.state.local_piece(t)
            box = tuple(slice(o, o + s) for o, s in zip(offset, local.shape)) if local.dim() else (slice(0, 1),)
            assert torch.equal(torch.from_numpy(f[name][box]).reshape(local.shape), local), name
    # signed: rank 0 tags every chunk of shared.h5 as it describes it; a keyed reader checks them
    key = b"s" * 32
    signed = ckpt.save(shared_dir / "single-signed", 1, tensors, comm=comm, single_file=True, key=key)
    with ckpt.Checkpoint(signed.path, key=key) as ck:
        pieces = [p for t in ck.tensors.values() for p in t["pieces"]]
        assert all(len(p["mac"]) == 32 * len(p["at"]) for p in pieces) and ck.manifest["data_mac"]["salt"]
        assert ck.verify() == []
        name = "model/output.weight"
        assert torch.equal(ckpt.read_tensor(ck, name), ckpt.read_tensor(ckpt.Checkpoint(result.path), name))


# --- fused sub-parameters: a GQA QKV projection, q = 8 heads, k = v = 2 heads of hd = 32 ---
# (dim 64 float32: every sub-parameter slice at tp 1, 2, 4 is whole 16-row storage chunks)
DIM, WIDTHS = 64, [8 * 32, 2 * 32, 2 * 32]
FUSED = fused_attrs({"qkv.weight": WIDTHS})
NAMES = ["model/qkv.weight", "optim/qkv.weight/exp_avg", "optim/qkv.weight/exp_avg_sq"]


def _logical() -> dict[str, torch.Tensor]:
    """The true fused tensors cat([wq, wk, wv]) (weight and both AdamW moments), the same on every rank."""
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(sum(WIDTHS), DIM, generator=g) for n in NAMES}


def _tp_shard(logical: torch.Tensor, r: int, n: int, widths: list[int] = WIDTHS) -> torch.Tensor:
    """What tp rank r of n holds of a fused column-parallel weight: [wq_r; wk_r; wv_r]."""
    return torch.cat([w.chunk(n)[r] for w in logical.split(widths)])


def _fused_module(tp: int | None) -> tuple[dict[str, torch.Tensor], int, int]:
    """A Linear(DIM -> q+k+v) with zeroed AdamW state: on tp ranks of a tp x dp grid its
    weight is DTensor Shard(0) built from [wq_r; wk_r; wv_r]; ``None``: a plain module.
    Returns (checkpoint tensors, tp rank, tp size)."""
    model = nn.ModuleDict({"qkv": nn.Linear(DIM, sum(WIDTHS), bias=False)})
    r, n = 0, 1
    if tp is not None:
        mesh = ProcessGrid(tp=tp).init_torch().mesh["tp"]
        r, n = mesh.get_local_rank(), tp
        local = torch.zeros(sum(WIDTHS) // tp, DIM)
        model.qkv.weight = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    optimizer = torch.optim.AdamW(model.parameters())
    return ckpt.training_tensors(model.named_parameters(), optimizer, create=True), r, n


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


SAVE_TPS = [WORLD] + ([2] if WORLD == 4 else [])  # tp = world, and tp2 x dp2 (dp replicas written once)


@needs_world(2, 4)
@pytest.mark.parametrize("save_tp", SAVE_TPS, ids=[f"save-tp{t}" for t in SAVE_TPS])
def test_fused_qkv_stored_logical_and_resplit_on_any_tp(comm, shared_dir, save_tp):
    root = shared_dir / f"fused-tp{save_tp}"
    logical = _logical()
    src, r, n = _fused_module(save_tp)
    with torch.no_grad():
        for name in NAMES:
            _local(src[name]).copy_(_tp_shard(logical[name], r, n))
        src["optim/qkv.weight/step"].fill_(3.0)
    result = ckpt.save(root, 5, src, comm=comm, tensor_attrs=FUSED)
    if comm.rank == 0:
        # plain h5py sees the true fused tensors, whatever tp saved them
        with h5py.File(result.path / "index.h5", "r") as f:
            assert f.attrs["format_version"] == "2.0"
            for name in NAMES:
                assert (f[name][()] == logical[name].numpy()).all(), name
                assert f[name].attrs["fused_widths"].tolist() == WIDTHS and f[name].attrs["fused_dim"] == 0
                # one piece per sub-parameter slice, each written once (by one of its dp replicas)
                assert len(json.loads(f[name].attrs["chunks"])) == 3 * save_tp, name
            assert f["model/qkv.weight"][WIDTHS[0]:WIDTHS[0] + WIDTHS[1]].tobytes() == \
                logical["model/qkv.weight"].split(WIDTHS)[1].numpy().tobytes()  # wk, by slicing on widths
        assert tools.verify(result.path) == []
        assert tools.inspect(result.path)["tensors"]["model/qkv.weight"]["fused_widths"] == WIDTHS
        # tp = 1 on one rank alone: the plain module gets the logical tensors
        plain, _, _ = _fused_module(None)
        report = ckpt.load(root, plain, tensor_attrs=FUSED)
        assert report.read_amplification == 1.0
        for name in NAMES:
            assert torch.equal(plain[name], logical[name]), name
    if save_tp == WORLD and h5py.get_config().mpi:  # the collective single-file mode writes the same logical rows
        single = ckpt.save(shared_dir / f"fused-single-tp{save_tp}", 5, src, comm=comm, tensor_attrs=FUSED,
                           single_file=True)
        if comm.rank == 0:
            with h5py.File(single.path / "index.h5", "r") as f:
                assert all((f[name][()] == logical[name].numpy()).all() for name in NAMES)
    # every other target layout: tp = 1 on every rank, tp 2, tp 4
    for tp in [None] + [t for t in (2, 4) if WORLD % t == 0]:
        dst, r, n = _fused_module(tp)
        report = ckpt.load(root, dst, comm=comm, tensor_attrs=FUSED if tp != 2 else None)  # None: as stored
        assert report.read_amplification <= 1.1, (tp, report.read_amplification)
        for name in NAMES:
            assert torch.equal(_local(dst[name]), _tp_shard(logical[name], r, n)), (tp, name)
        assert float(dst["optim/qkv.weight/step"]) == 3.0


@needs_world(2, 4)
def test_fused_declarations_that_do_not_fit_fail_on_every_rank(comm, shared_dir):
    root = shared_dir / "fused-bad"
    logical = _logical()
    src, r, n = _fused_module(WORLD)
    with torch.no_grad():
        for name in NAMES:
            _local(src[name]).copy_(_tp_shard(logical[name], r, n))
    ckpt.save(root, 1, src, comm=comm, tensor_attrs=FUSED)
    # the model declares other widths: strict load fails everywhere, naming the tensor
    dst, _, _ = _fused_module(WORLD)
    other = fused_attrs({"qkv.weight": [128, 128, 128]})
    with pytest.raises(CheckpointError) as info:
        ckpt.load(root, dst, comm=comm, tensor_attrs=other)
    msg = str(info.value)
    assert ("model/qkv.weight: checkpoint fused_widths [256, 64, 64] on dim 0, "
            "model fused_widths [128, 128, 128] on dim 0") in msg
    assert comm.allgather(msg) == [msg] * WORLD
    report = ckpt.load(root, dst, comm=comm, tensor_attrs=other, strict=False)  # loads the rest, reports these
    assert sorted(m.split(":")[0] for m in report.mismatched) == sorted(NAMES)
    # a save whose declaration does not fit raises on every rank, also where the tensor is not held
    bad = {"model/qkv.weight": {"fused_widths": [256, 64, 60]}}
    mine = {"model/qkv.weight": src["model/qkv.weight"]} if comm.rank == 0 \
        else {f"model/other{comm.rank}": torch.ones(2)}
    with pytest.raises(CheckpointError) as info:
        ckpt.save(root, 2, mine, comm=comm, tensor_attrs=bad)
    msg = str(info.value)
    assert ("fused tensor model/qkv.weight: fused_widths [256, 64, 60] sum to 380, "
            "but its size on fused_dim 0 is 384") in msg
    assert comm.allgather(msg) == [msg] * WORLD
    # uneven sub-parameter shards are refused
    uneven = fused_attrs({"qkv.weight": [256 + 1, 64, 64 - 1]})
    with pytest.raises(CheckpointError, match=f"not all divisible by its {WORLD} tensor-parallel shards"):
        ckpt.save(root, 3, src, comm=comm, tensor_attrs=uneven)
    assert not (root / "step_00000002").exists() and not (root / "step_00000003").exists()


# GQA: q 64, k = v 32 rows; w13 [128, 128]; Qwen2's q, k, v biases, fused as the weight
FUSED_MODEL = TransformerConfig.preset("tiny", fused_qkv=True, fused_mlp=True, qkv_bias=True)
FUSED_TRAIN = TrainConfig(**{**TRAIN.__dict__, "steps": 2, "global_batch": 4})
FUSED_CASES = {2: [("tp2", {"tp": 2}, {}, ("dp2", {"dp": 2}, {}))],
               4: [("tp2xfsdp2", {"tp": 2}, {"fsdp": True}, ("tp4", {"tp": 4}, {}))]}.get(WORLD, [])


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_transformer_trains_saves_and_resumes_on_another_tp(comm, shared_dir, case):
    """The reference transformer with fused wqkv and w13: tensor parallel trains like one
    process, the checkpoint holds the logical weights, and another layout resumes from it."""
    from tests.reference import reference_run

    name, degrees, pkw, (_, odeg, opkw) = case
    ref_losses, _, ref_params = reference_run(FUSED_MODEL, FUSED_TRAIN)
    trainer = build_llm_trainer(FUSED_MODEL, FUSED_TRAIN, ParallelConfig(**pkw), **degrees)
    assert [m["loss"] for m in trainer.fit()] == pytest.approx(ref_losses, rel=1e-4)
    result = save_trainer(trainer, shared_dir / f"fused-model-{name}")
    fused = [n for n in trainer.state_tensors() if ("wqkv" in n or "w13" in n) and not n.endswith("/step")]
    assert len(fused) == 3 * 3 * FUSED_MODEL.n_layers  # wqkv weight and bias, w13: each with exp_avg, exp_avg_sq
    with h5py.File(result.path / "index.h5", "r") as index, ckpt.Checkpoint(result.path) as ck:
        for pname in ("layers.0.attention.wqkv.weight", "layers.3.feed_forward.w13.weight",
                      "layers.1.attention.wqkv.bias"):
            logical = ckpt.read_tensor(ck, f"model/{pname}")  # the unparallelised model's weight
            assert float((logical - ref_params[pname]).norm() / ref_params[pname].norm()) < 1e-4, pname
        tp_rank, tp = trainer.grid.coords["tp"], trainer.grid.layout.tp
        for tname in fused:  # what this rank holds is [w_a rows of rank r; w_b rows of rank r; ...] of the logical
            t = trainer.state_tensors()[tname]
            mine = _tp_shard(ckpt.read_tensor(ck, tname), tp_rank, tp, index[tname].attrs["fused_widths"].tolist())
            local, _, offset = ckpt.state.local_piece(t)
            assert torch.equal(mine[offset[0] - tp_rank * mine.shape[0]:][:local.shape[0]], local), tname
    fresh = build_llm_trainer(FUSED_MODEL, TrainConfig(**{**FUSED_TRAIN.__dict__, "seed": 9}), ParallelConfig(**opkw),
                              **odeg)
    report = load_trainer(fresh, result.path)
    assert report.read_amplification <= 1.25, report.read_amplification  # tiny tensors, 1 KiB storage chunks
    with h5py.File(result.path / "index.h5", "r") as index, ckpt.Checkpoint(result.path) as ck:
        tp_rank, tp = fresh.grid.coords["tp"], fresh.grid.layout.tp
        for tname in fused:
            want = _tp_shard(ckpt.read_tensor(ck, tname), tp_rank, tp, index[tname].attrs["fused_widths"].tolist())
            assert torch.equal(fresh.state_tensors()[tname].to_local() if tp > 1
                               else _global(fresh.state_tensors()[tname]), want), tname
    fresh.data = trainer.data
    assert fresh.train_step()["loss"] == pytest.approx(trainer.train_step()["loss"], rel=1e-4)


@pytest.mark.parametrize("how", ["evaluate", "forward"])
def test_an_fsdp_save_right_after_a_forward_without_backward_holds_every_moment(comm, shared_dir, how):
    """A forward with no backward (a validation at the step a checkpoint is due, a user's own
    prediction) leaves FSDP's root -- embeddings, final norm, output -- gathered as plain full
    tensors until the next backward. A save then lost those parameters' optimizer moments and
    the checkpoint could not be resumed ("missing optim/tok_embeddings.weight/exp_avg, ..."),
    and the next step died ("Trying to resize storage that is not resizable"): llm_pretrain.py
    --fsdp with --val-data and a checkpoint due at a validation step."""
    from hpcml.train.data import SyntheticTokens

    trainer = build_llm_trainer(MODEL, TRAIN, ParallelConfig(fsdp=True), dp=WORLD)
    trainer.fit(2)
    val = SyntheticTokens(vocab_size=MODEL.vocab_size, seq_len=TRAIN.seq_len, seed=5)
    if how == "evaluate":
        trainer.evaluate(val, 1)
        assert all(isinstance(p, DTensor) for _, p in trainer.model.named_parameters())  # left as it found them
    else:  # a forward of the user's own: nothing reshards it but the save
        with torch.no_grad():
            trainer.model.parts[0](trainer.local_batch(0, val)[0])
    full = {n: _global(t).clone() for n, t in trainer.state_tensors().items() if not n.startswith("rank_state/")}
    assert any(n.startswith("optim/tok_embeddings.weight/") for n in full)
    save_trainer(trainer, shared_dir / f"fsdp-after-{how}")
    fresh = build_llm_trainer(MODEL, TrainConfig(**{**TRAIN.__dict__, "seed": 9}), ParallelConfig(fsdp=True), dp=WORLD)
    load_trainer(fresh, shared_dir / f"fsdp-after-{how}")
    got = {n: _global(t) for n, t in fresh.state_tensors().items() if not n.startswith("rank_state/")}
    assert set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)
    trainer.fit(3)  # and training goes on: the next step once died freeing storage the save had pinned
    assert trainer.step == 3 == fresh.fit(3)[-1]["step"]
