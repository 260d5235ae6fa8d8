"""Data parallelism that knows the nodes (issue 46), at 4 ranks laid out as 2 nodes x 2 (the
grid's node map, ``node_name``): hybrid sharding (HSDP) and hpZ train exactly as one process
(fp64, 1e-10) on the reference transformer and a MoE model; the bytes their collectives send
inside and across nodes are FSDP's shares; a checkpoint moves between HSDP, FSDP and DDP
bitwise; a node map that cannot hold the layout is refused on every rank before any collective."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch.distributed.tensor import DTensor

from hpcml import ckpt
from hpcml.errors import ConfigError
from hpcml.grid import ProcessGrid
from hpcml.grid.layout import Layout
from hpcml.models.transformer import Transformer, TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.train import TrainConfig
from hpcml.train.checkpointing import load_trainer, save_trainer
from hpcml.train.recipe import build_llm_trainer
from tests.reference import assert_trains_as_one_process

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = [pytest.mark.skipif(WORLD != 4, reason="4 ranks as 2 nodes x 2"), pytest.mark.usefixtures("fp64_default")]
MODEL = TransformerConfig(vocab_size=120, dim=32, n_layers=3, n_heads=4, ffn_hidden=40, max_seq_len=16)
MOE = TransformerConfig.preset("tiny-moe", n_layers=2, moe_shared_hidden=32, max_seq_len=16,
                              moe_grouped_mm=False)  # (grouped_mm takes no fp64: the per-expert loop)
TRAIN = TrainConfig(steps=3, global_batch=8, micro_batch=2, seq_len=16, progress=False)
TOL = 1e-10

LAYOUTS = [("hsdp-node", {"dp": 4}, {"dp_replicate": "node"}, MODEL),
           ("hpz", {"dp": 4}, {"hpz": True}, MODEL),
           ("hsdp-cp2xdp2", {"cp": 2}, {"dp_replicate": 2}, MODEL),
           ("hsdp-tp2xdp2", {"tp": 2}, {"dp_replicate": 2}, MODEL),
           ("moe-hsdp-node", {"dp": 4}, {"dp_replicate": "node"}, MOE),
           ("moe-hpz", {"dp": 4}, {"hpz": True}, MOE)]


REAL_NODES = os.environ.get("HPCML_TEST_REAL_NODES") == "1"
"""Run by tests/slurm on two Slurm nodes (2 ranks each): the launcher's node map, not one made up."""


def grid_of(degrees: dict, node=None) -> ProcessGrid:
    """4 ranks, ranks 0-1 on one node and 2-3 on the other (or ``node``'s map)."""
    rank = MPI.COMM_WORLD.Get_rank()
    if node is not None:
        return ProcessGrid(Layout.from_degrees(WORLD, degrees), node_name=node(rank))
    grid = ProcessGrid(Layout.from_degrees(WORLD, degrees), node_name=None if REAL_NODES else f"node{rank // 2}")
    names = grid.node_names
    assert names == [names[0]] * 2 + [names[2]] * 2 and names[0] != names[2], names  # 2 nodes x 2
    return grid


def trainer_of(model: TransformerConfig, degrees: dict, pkw: dict, train: TrainConfig = TRAIN):
    """FSDP unless ``pkw`` says ``fsdp=False``."""
    return build_llm_trainer(model, train, ParallelConfig(**{"fsdp": True, **pkw}), grid=grid_of(degrees))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.fixture(autouse=True, scope="module")
def _quiet_dtensor():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@pytest.mark.parametrize("name,degrees,pkw,model", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_hybrid_layouts_equal_one_process_in_fp64(comm, name, degrees, pkw, model):
    assert_trains_as_one_process(trainer_of(model, degrees, pkw), model, TRAIN, TOL)


def _fp32_runs(kinds: dict[str, dict], steps: int, train: TrainConfig = TRAIN) -> dict[str, list[dict]]:
    """Each of ``kinds`` trained ``steps`` steps in fp32 on dp 4 (2 nodes x 2): its metrics."""
    train = TrainConfig(**{**train.__dict__, "steps": steps})
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    runs = {}
    try:
        for name, pkw in kinds.items():
            trainer = trainer_of(MODEL, {"dp": 4}, pkw, train)
            runs[name] = trainer.fit()
            trainer.close()
    finally:
        torch.set_default_dtype(before)
    return runs


KINDS = {"fsdp": {}, "hsdp": {"dp_replicate": "node"}, "hpz": {"hpz": True}, "qwz": {"qwz": True},
         "qgz": {"qgz": True}, "zeropp": {"hpz": True, "qwz": True, "qgz": True},
         "fsdp-bf16-reduce": {"reduce_dtype": "bf16"},
         "hsdp-bf16-reduce": {"dp_replicate": "node", "reduce_dtype": "bf16"}}


def test_bytes_inside_and_across_nodes_are_the_planners_exactly(comm):
    """Per rank and step, fp32, as the collectives count them: FSDP over 2 nodes x 2 sends a third
    of its bytes inside the node (1 of its 3 peers); HSDP's all-gathers and reduce-scatters stay
    inside and only the all-reduce across replicas crosses (a third of FSDP's: P/2 against 1.5 P);
    hpZ's backward all-gathers stay inside (2/3); a bf16 reduction halves HSDP's crossing; every kind
    equals ``hpcml.plan``'s count."""
    from hpcml.plan.candidate import PlanLayout
    from hpcml.plan.traffic import dp_bytes

    runs = _fp32_runs(KINDS, 2)
    got = {k: {b: r[1][b] for b in ("dp_bytes_intra_node", "dp_bytes_inter_node")} for k, r in runs.items()}
    assert all(r[0]["dp_bytes_inter_node"] == r[1]["dp_bytes_inter_node"] for r in runs.values())  # a step's
    fsdp, hsdp, hpz = got["fsdp"], got["hsdp"], got["hpz"]
    assert fsdp["dp_bytes_inter_node"] == 2 * fsdp["dp_bytes_intra_node"] > 0
    assert hsdp["dp_bytes_inter_node"] / fsdp["dp_bytes_inter_node"] == pytest.approx(1 / 3, rel=0.1)
    assert hpz["dp_bytes_inter_node"] / fsdp["dp_bytes_inter_node"] == pytest.approx(2 / 3, rel=0.1)
    # gradients reduced in bf16: the reduce-scatter's (and HSDP's all-reduce's) bytes halve, the all-gathers' stay
    assert sum(got["fsdp-bf16-reduce"].values()) < sum(fsdp.values())
    assert got["hsdp-bf16-reduce"]["dp_bytes_inter_node"] * 2 == hsdp["dp_bytes_inter_node"]
    for name, pkw in KINDS.items():
        lay = PlanLayout(model=MODEL, gpus=4, gpu="a100-80gb", seq_len=TRAIN.seq_len, global_batch=TRAIN.global_batch,
                         micro_batch=TRAIN.micro_batch, zero=3, precision="fp32", gpus_per_node=2,
                         **{k: (2 if v == "node" else v) for k, v in pkw.items()})
        assert got[name] == dp_bytes(MODEL, lay, 2), name


def test_gradients_reduce_scattered_each_micro_batch_or_once_a_step_as_the_planner_counts(comm):
    """Two micro-batches a rank, fp32: FSDP2 reduce-scatters each micro-batch's gradients by default
    (``grad_sync`` microbatch) and once a step with ``grad_sync step``; both train the same model
    (the sum of the reductions is the reduction of the sum) and send exactly the planner's bytes:
    one reduce-scatter of the model's gradients more a step by default."""
    from hpcml.plan.candidate import PlanLayout
    from hpcml.plan.traffic import dp_bytes

    train = TrainConfig(**{**TRAIN.__dict__, "global_batch": 16})
    runs = _fp32_runs({"microbatch": {}, "step": {"grad_sync": "step"}}, 2, train)
    got = {k: {b: r[1][b] for b in ("dp_bytes_intra_node", "dp_bytes_inter_node")} for k, r in runs.items()}
    assert [m["loss"] for m in runs["step"]] == pytest.approx([m["loss"] for m in runs["microbatch"]], rel=1e-5)
    for sync in ("microbatch", "step"):
        lay = PlanLayout(model=MODEL, gpus=4, gpu="a100-80gb", seq_len=train.seq_len, global_batch=16,
                         micro_batch=train.micro_batch, zero=3, precision="fp32", gpus_per_node=2, grad_sync=sync)
        assert lay.microbatches == 2 and got[sync] == dp_bytes(MODEL, lay, 2), sync
    params = sum(p.numel() for p in Transformer(MODEL).parameters())
    extra = sum(got["microbatch"].values()) - sum(got["step"].values())  # one more reduce-scatter: 3/4 of it sent
    assert params * 4 * 3 / 4 <= extra <= 1.1 * params * 4 * 3 / 4, (extra, params)  # (dim-0 padding to 4 ranks)


def test_hsdp_all_reduces_across_nodes_once_a_step_whatever_the_micro_batches(comm):
    """HSDP with two micro-batches a rank, fp32: each micro-batch's gradients are reduce-scattered
    inside the node, and summed there; the all-reduce across the nodes runs once, after the last
    (FSDP2's ``set_requires_all_reduce``): the bytes across nodes a step are those of one
    micro-batch's step (half what an all-reduce each micro-batch sent), inside the node two
    reduce-scatters, equal to the planner's count; the losses equal FSDP's."""
    from hpcml.plan.candidate import PlanLayout
    from hpcml.plan.traffic import dp_bytes

    two = TrainConfig(**{**TRAIN.__dict__, "global_batch": 16})
    runs = _fp32_runs({"hsdp": {"dp_replicate": "node"}, "fsdp": {}}, 2, two)
    one = _fp32_runs({"hsdp": {"dp_replicate": "node"}}, 1)["hsdp"]
    got = {k: r[1]["dp_bytes_inter_node"] for k, r in runs.items()}
    assert got["hsdp"] == one[0]["dp_bytes_inter_node"] > 0  # one all-reduce a step: as with one micro-batch
    assert [m["loss"] for m in runs["hsdp"]] == pytest.approx([m["loss"] for m in runs["fsdp"]], rel=1e-5)
    lay = PlanLayout(model=MODEL, gpus=4, gpu="a100-80gb", seq_len=two.seq_len, global_batch=16,
                     micro_batch=two.micro_batch, zero=3, precision="fp32", gpus_per_node=2, dp_replicate=2)
    assert lay.microbatches == 2
    want = dp_bytes(MODEL, lay, 2)
    assert {b: runs["hsdp"][1][b] for b in want} == want
    each = dp_bytes(MODEL, PlanLayout.from_dict({**lay.to_dict(), "framework": "torchtitan"}), 2)
    assert each["dp_bytes_inter_node"] == 2 * want["dp_bytes_inter_node"]  # an all-reduce each micro-batch: twice


def test_hsdp_with_micro_batches_equals_one_process_in_fp64(comm):
    """The shards summed inside the node across micro-batches, all-reduced once: the same model."""
    two = TrainConfig(**{**TRAIN.__dict__, "global_batch": 16})
    assert_trains_as_one_process(trainer_of(MODEL, {"dp": 4}, {"dp_replicate": "node"}, two), MODEL, two, TOL)


@pytest.mark.parametrize("zero", [3, 2])
def test_fsdp_under_a_pipeline_sends_what_the_planner_counts(comm, zero):
    """pp 2 x dp 2 (each stage's data ranks on one node), four micro-batches, fp32:
    torch.distributed.pipelining reshards and reduces after the last backward only, so a stage is
    gathered once a step (ZeRO-2) or once more in each backward (ZeRO-3: m + 1) and its gradients
    reduce-scattered once; every rank's bytes equal ``hpcml.plan``'s count for its stage."""
    from hpcml.plan.candidate import PlanLayout
    from hpcml.plan.traffic import dp_bytes

    train = TrainConfig(**{**TRAIN.__dict__, "steps": 2, "micro_batch": 1})
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        trainer = trainer_of(MODEL, {"pp": 2, "dp": 2}, {"reshard_after_forward": zero == 3}, train)
        history, stage = trainer.fit(), trainer.grid.coords["pp"]
        trainer.close()
    finally:
        torch.set_default_dtype(before)
    got = {b: history[1][b] for b in ("dp_bytes_intra_node", "dp_bytes_inter_node")}
    lay = PlanLayout(model=MODEL, gpus=4, gpu="a100-80gb", seq_len=TRAIN.seq_len, global_batch=TRAIN.global_batch,
                     micro_batch=1, pp=2, zero=zero, precision="fp32", gpus_per_node=2)
    assert lay.microbatches == 4 and got["dp_bytes_intra_node"] > 0
    assert got == dp_bytes(MODEL, lay, 2, stage), (stage, got)


@pytest.fixture(scope="module")
def shared_dir(comm):
    return Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-hsdp-") if comm.rank == 0 else None))


@pytest.mark.parametrize("saver,loader", [("hsdp", "fsdp"), ("fsdp", "hsdp"), ("hsdp", "ddp"), ("ddp", "hpz")])
def test_a_checkpoint_moves_between_hsdp_fsdp_and_ddp_bitwise(comm, shared_dir, saver, loader):
    kinds = {"hsdp": {"dp_replicate": "node"}, "fsdp": {}, "hpz": {"hpz": True}, "ddp": {"fsdp": False}}
    root = shared_dir / f"{saver}-{loader}"
    trainer = trainer_of(MODEL, {"dp": 4}, kinds[saver])
    trainer.fit(2)
    result = save_trainer(trainer, root)
    fresh = trainer_of(MODEL, {"dp": 4}, kinds[loader], TrainConfig(**{**TRAIN.__dict__, "seed": 9}))
    report = load_trainer(fresh, root)
    assert fresh.step == 2 and report.step == 2
    with ckpt.Checkpoint(result.path) as ck:
        for tname, t in fresh.state_tensors().items():
            if not tname.startswith("rank_state/"):
                assert torch.equal(_full(t).cpu(), ckpt.read_tensor(ck, tname)), tname
    fresh.data = trainer.data
    assert fresh.train_step()["loss"] == pytest.approx(trainer.train_step()["loss"], rel=TOL)
    trainer.close()
    fresh.close()


@pytest.mark.parametrize("pkw,node,match", [
    ({"dp_replicate": 3}, lambda r: f"node{r // 2}", "dp_replicate 3 does not divide dp 4"),
    ({"dp_replicate": "node"}, lambda r: f"node{r % 2}", r"dp_replicate 'node': the data ranks \[0, 1, 2, 3\] lie on "
                                                          r"nodes \['node0', 'node1', 'node0', 'node1'\]"),
    ({"hpz": True}, lambda r: f"node{r}", "hpz with one data rank per node"),
    ({"hpz": True}, lambda r: f"node{r % 2}", "hpz: the data ranks"),
    ({"qgz": True}, lambda r: f"node{r % 2}", "qgz: the data ranks"),
    ({"hpz": True, "tp": 2}, lambda r: f"node{r // 2}", "hpz with tp 2, pp 1, pop 1: torch's hpZ"),
])
def test_a_node_map_that_cannot_hold_the_layout_is_refused_on_every_rank(comm, pkw, node, match):
    pkw = dict(pkw)
    grid = grid_of({"tp": pkw.pop("tp")} if "tp" in pkw else {"dp": 4}, node)
    with pytest.raises(ConfigError, match=match):
        build_llm_trainer(MODEL, TRAIN, ParallelConfig(fsdp=True, **pkw), grid=grid)


def test_quantized_collectives_are_within_half_a_step_of_each_block(comm):
    """qwZ's all-gather: every rank gets the same values, each within half a quantization step of
    its block; qgZ's reduce-scatter: the exact sum to within the rounding of the 2 nodes' partial
    sums (half a step of each block of each), with only int8 crossing nodes."""
    from hpcml.parallel.hsdp import CommBytes
    from hpcml.parallel.zeropp import collectives, quantize

    grid = grid_of({"dp": 4})
    grid.init_torch()
    group = grid.torch.mesh.get_group("dp")
    counter = CommBytes(grid)
    gather, scatter = collectives(grid, ParallelConfig(fsdp=True, qwz=True, qgz=True, quant_block=16), counter)
    torch.manual_seed(comm.rank)
    shard = torch.randn(40) * (1 + comm.rank)
    out = gather.allocate((160,), dtype=torch.float64, device=torch.device("cpu"))
    assert gather(out, shard, group) is None
    exact = torch.cat(comm.allgather(shard))
    _, scale = quantize(exact.view(4, 40)[comm.rank], 16)
    assert (out - exact).abs().max() <= 0.5 * max(float(s.max()) for s in comm.allgather(scale)) + 1e-12
    assert all(torch.equal(o, out) for o in comm.allgather(out))  # every rank computes with the same weights
    grads = torch.randn(160) * 0.01
    got = torch.empty(40)
    counter.take()
    scatter(got, grads.clone(), group, torch.distributed.ReduceOp.SUM)
    sent = counter.take()
    want = sum(comm.allgather(grads)).view(4, 40)[comm.rank]
    step = 2 * sum(comm.allgather(grads)).abs().max() / 127  # a node's partial sum, two ranks' values
    assert float((got - want).abs().max()) <= float(step), float((got - want).abs().max())
    # inside the node: the 2 nodes' chunks of 40 fp64 to 1 peer; across: 40 int8 (padded to 3 blocks
    # of 16) and 3 fp32 scales to 1 peer
    assert sent == {"dp_bytes_intra_node": 2 * 40 * 8, "dp_bytes_inter_node": 48 + 3 * 4}


def test_zeropp_sends_under_a_quarter_of_fsdps_bytes_across_nodes_and_trains_alike(comm):
    """hpZ + qwZ + qgZ against FSDP in fp32, 20 steps: across nodes <= 0.25x FSDP's bytes, the
    loss within 0.1% of FSDP's at every fifth step."""
    runs = _fp32_runs({"fsdp": {}, "zeropp": KINDS["zeropp"]}, 20)
    f, z = runs["fsdp"], runs["zeropp"]
    assert z[-1]["dp_bytes_inter_node"] <= 0.25 * f[-1]["dp_bytes_inter_node"]
    assert [m["loss"] for m in z[::5]] == pytest.approx([m["loss"] for m in f[::5]], rel=1e-3)
    assert [m["loss"] for m in z] != [m["loss"] for m in f]  # quantized: not the same run
    assert f[-1]["loss"] < f[0]["loss"] - 0.2
