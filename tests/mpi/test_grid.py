"""ProcessGrid on real MPI (2 and 4 ranks): sub-communicators, node map, torch bootstrap."""

from __future__ import annotations

import logging
import os
import time

import pytest
from mpi4py import MPI

from hpcml.errors import GridError
from hpcml.grid import Layout, ProcessGrid
from hpcml.grid.check import check_grid
from tests.mpi.helpers import needs_world

WORLD = MPI.COMM_WORLD.Get_size()
# the launcher's CPU mask, read at collection, before the session's grid may pin this rank
LAUNCH_CPUS = sorted(os.sched_getaffinity(0))


def layouts_for(world: int) -> list[dict]:
    found = [{}, {"tp": world}, {"pp": world}, {"cp": world}, {"ep": world}]
    if world == 4:
        found += [{"tp": 2}, {"tp": 2, "pp": 2}, {"cp": 2, "tp": 2}, {"cp": 2}, {"pp": 2, "cp": 2},
                  {"ep": 2}, {"ep": 2, "tp": 2}, {"ep": 2, "cp": 2}, {"ep": 2, "tp": 2, "etp": 1}]
    return found


@pytest.mark.parametrize("degrees", layouts_for(WORLD), ids=str)
def test_subcommunicators_match_layout(comm, degrees):
    grid = ProcessGrid(**degrees)
    try:
        for axes in [(a,) for a in grid.layout.axis_names] + [("dp", "cp")]:
            assert grid.comm_ranks(axes) == grid.group(axes)
            assert grid.comm_for(axes).Get_size() == len(grid.group(axes))
        # the rank's position in its tp communicator is its tp coordinate
        assert grid.comm_for("tp").Get_rank() == grid.coords["tp"]
        assert grid.comm_for("pp").Get_rank() == grid.coords["pp"]
        # every rank's view of the partition, gathered, is the layout's partition
        tp_groups = {tuple(g) for g in comm.allgather(grid.group("tp"))}
        assert sorted(tp_groups) == sorted(tuple(g) for g in grid.layout.groups("tp"))
        results = check_grid(grid)
        assert all(r.mpi == r.expected for r in results)
    finally:
        grid.free()


def test_node_map_single_node(comm):
    grid = ProcessGrid()
    assert grid.nodes == [MPI.Get_processor_name()]
    assert (grid.local_rank, grid.local_size, grid.node) == (comm.rank, WORLD, 0)
    grid.free()


@needs_world(4)
def test_node_map_and_tp_spanning_warning(comm):
    # two ranks per (pretend) node: tp=2 stays inside nodes, tp=4 spans them.
    fake = f"node{comm.rank // 2}"
    inside = ProcessGrid(tp=2, node_name=fake)
    assert inside.nodes == ["node0", "node1"]
    assert (inside.node, inside.local_rank, inside.local_size) == (comm.rank // 2, comm.rank % 2, 2)
    spanning_records = []
    handler = logging.Handler()
    handler.emit = spanning_records.append
    logging.getLogger("hpcml").addHandler(handler)
    try:
        spanning = ProcessGrid(tp=4, node_name=fake)
    finally:
        logging.getLogger("hpcml").removeHandler(handler)
    messages = [r.getMessage() for r in spanning_records if "span nodes" in r.getMessage()]
    assert messages == (["1 of 1 tp groups span nodes (e.g. ranks [0, 1, 2, 3]): tensor-parallel traffic will "
                         "cross the network; put tp within a node"] if comm.rank == 0 else [])
    inside.free()
    spanning.free()


def test_bad_layout_raises_on_every_rank_before_any_collective(comm):
    with pytest.raises(GridError) as info:
        ProcessGrid(tp=3, dp=1)
    message = str(info.value)
    # the job is still healthy: every rank raised the same error and can still communicate
    assert comm.allgather(message) == [message] * WORLD
    assert message == f"tp(3) * dp(1) * pp(1) = 3 != world size {WORLD}"
    with pytest.raises(GridError, match="layout is for world size 16"):
        ProcessGrid(Layout(world_size=16))


def test_describe_table(comm):
    grid = ProcessGrid(tp=2 if WORLD % 2 == 0 else 1)
    text = grid.describe()
    lines = text.splitlines()
    assert lines[0].startswith(f"ProcessGrid: {WORLD} ranks = pp(1) x dp({WORLD // 2}) x cp(1) x tp(2) on 1 node(s)")
    assert lines[1].split() == ["rank", "node", "local", "pp", "dp", "cp", "tp"]
    assert lines[2 + WORLD - 1].split()[3:] == ["0", str(WORLD // 2 - 1), "0", "1"]
    assert "  tp: [[0, 1]" in text and "  dp x cp: " in text
    grid.free()


@pytest.fixture(scope="module")
def torch_grid():
    grid = ProcessGrid(tp=2) if WORLD % 2 == 0 else ProcessGrid()
    grid.init_torch()  # reuses the session's process group, builds this layout's mesh
    return grid


def test_torch_bootstrap_from_mpi(comm, torch_grid, torch_bootstrap):
    import torch
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, WORLD)
    assert torch_bootstrap.master_addr == "127.0.0.1"  # one node: loopback
    assert torch_bootstrap.master_port > 0
    assert comm.allgather(torch_bootstrap.master_port) == [torch_bootstrap.master_port] * WORLD
    mesh = torch_grid.torch.mesh
    assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert mesh.mesh.flatten().tolist() == list(range(WORLD))
    for axis in mesh.mesh_dim_names:
        assert sorted(dist.get_process_group_ranks(mesh.get_group(axis))) == torch_grid.group(axis)
    t = torch.tensor([float(comm.rank)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == float(sum(torch_grid.group("tp")))
    results = check_grid(torch_grid)
    assert [r.torch for r in results if len(r.axes) == 1] == [r.expected for r in results if len(r.axes) == 1]


def test_torch_backend_bad_on_one_rank_raises_the_same_error_on_every_rank(comm, torch_bootstrap):
    """Issue 12: a backend this build lacks on one rank raised there alone while the others
    waited in the rendezvous until the timeout; init's one allgather comes first now."""
    from hpcml.errors import ConfigError

    grid = ProcessGrid()
    try:
        with pytest.raises(ConfigError) as info:
            grid.init_torch(backend="nccl" if comm.rank == WORLD - 1 else None)
        msg = str(info.value)
        assert comm.allgather(msg) == [msg] * WORLD
        assert msg == (f"torch.distributed on rank {WORLD - 1}: backend 'nccl': this torch build has gloo (nccl "
                       f"needs a CUDA build of torch and a GPU)")
        assert grid.init_torch().backend == "gloo"  # nothing was left half-made
    finally:
        grid.free()


@pytest.mark.skipif(WORLD != 4, reason="4 ranks")
def test_expert_mesh_folds_ep_over_dp(comm, torch_bootstrap):
    """Issue 13: ep 2 with tp 2 on 4 ranks: dense dp keeps both tp groups' partners, the
    experts' mesh (pp, edp, ep, etp) is Megatron's "tp-ep-dp-pp" over the same ranks."""
    import torch.distributed as dist

    grid = ProcessGrid(tp=2, ep=2)
    try:
        grid.init_torch()
        em = grid.torch.expert_mesh
        assert em.mesh_dim_names == ("pp", "edp", "ep", "etp") and em.mesh.shape == (1, 1, 2, 2)
        assert sorted(dist.get_process_group_ranks(em.get_group("ep"))) == [comm.rank % 2, comm.rank % 2 + 2]
        assert sorted(dist.get_process_group_ranks(grid.torch.mesh.get_group("dp"))) \
            == [comm.rank % 2, comm.rank % 2 + 2]
        assert grid.coords == {"pp": 0, "dp": comm.rank // 2, "cp": 0, "tp": comm.rank % 2, "ep": comm.rank // 2,
                               "edp": 0}
        assert all(r.ok and r.torch is not None for r in check_grid(grid) if len(r.axes) == 1)
    finally:
        grid.free()


def test_describe_shows_devices_after_torch(torch_grid):
    lines = torch_grid.describe().splitlines()
    assert "torch backend gloo" in lines[0]
    assert lines[1].split()[-1] == "device" and lines[2].split()[-1] == "cpu"


def test_threads_per_rank_share_the_hosts_cpus(comm):
    """Ranks on one host with the same CPUs split them (srun tells a process nothing of its
    neighbours; 4 ranks x 2 threads on 2 cores ran 5x slower). Unbound ranks that outnumber
    their CPUs were pinned round-robin by the first grid (the session's), so that none starves
    while another spins in MPI; fewer ranks keep every CPU."""
    grid = ProcessGrid()
    n = len(LAUNCH_CPUS)
    assert comm.allgather(LAUNCH_CPUS) == [LAUNCH_CPUS] * WORLD, \
        "this test expects mpiexec to bind nothing (every rank sees every core of this one host)"
    if WORLD > n > 1:
        assert sorted(os.sched_getaffinity(0)) == [LAUNCH_CPUS[comm.rank % n]]
        assert (grid.cpus, grid.cpu_sharers) == (1, len(range(comm.rank % n, WORLD, n)))
        assert grid.threads_per_rank == 1
    else:
        assert sorted(os.sched_getaffinity(0)) == LAUNCH_CPUS
        assert (grid.cpus, grid.cpu_sharers) == (n, WORLD)
        assert grid.threads_per_rank == max(1, n // WORLD)
    grid.free()


def _raised_everywhere(comm, **kw) -> str:
    """Build a grid with this rank's ``kw``; the GridError message, the same on every rank."""
    with pytest.raises(GridError) as info:
        ProcessGrid(**kw)
    msg = str(info.value)
    assert comm.allgather(msg) == [msg] * WORLD and "\n" not in msg
    return msg


def test_rank_dependent_arguments_raise_the_same_error_on_every_rank(comm):
    """Issue 12: tp=2 on rank 0 only built inconsistent groups with no error; rank-dependent
    combos hung. One allgather of every rank's resolved arguments comes first."""
    rest = "1" if WORLD == 2 else f"1-{WORLD - 1}"
    msg = _raised_everywhere(comm, **({"tp": 2} if comm.rank == 0 else {}))
    assert msg == (f"ProcessGrid arguments differ across ranks: rank(s) 0 gave pp(1) x dp({WORLD // 2}) x cp(1) x "
                   f"tp(2), combos [['dp', 'cp']]; rank(s) {rest} gave pp(1) x dp({WORLD}) x cp(1) x tp(1), combos "
                   f"[['dp', 'cp']]; every rank must pass the same degrees and combos")
    combos = [("dp", "cp")] + ([("tp", "dp")] if comm.rank % 2 else [])
    msg = _raised_everywhere(comm, combos=combos)
    assert msg.startswith("ProcessGrid arguments differ across ranks: rank(s) 0") and "combos [['dp', 'cp'], " \
        "['dp', 'tp']]" in msg
    # a degree only one rank gets wrong: every rank raises that rank's reason
    msg = _raised_everywhere(comm, **({"tp": 3} if comm.rank == WORLD - 1 else {}))
    assert msg.startswith(f"ProcessGrid arguments on rank {WORLD - 1}: cannot infer dp: tp(3)")
    # the same mistake on every rank keeps its own message
    msg = _raised_everywhere(comm, tp=3)
    assert msg.startswith("cannot infer dp: tp(3)")
    # an argument of the wrong type on one rank (once an AttributeError there, a hang elsewhere)
    msg = _raised_everywhere(comm, layout="tp=2" if comm.rank == 0 else None)
    assert msg == "ProcessGrid arguments on rank 0: layout 'tp=2': expected a Layout (hpcml.grid.Layout) or " \
        "degrees such as tp=2"
    grid = ProcessGrid()  # and the next grid builds: nothing was left half-made
    assert comm.allgather(grid.group("dp")) == [list(range(WORLD))] * WORLD
    grid.free()


def test_the_same_combos_in_any_order_agree_and_build_the_same_groups(comm):
    """The agreement compares a canonical form: order, repeats and plain axes in ``combos``
    do not matter, and every rank builds its Splits in that one order."""
    combos = [("tp", "dp"), ("cp", "dp"), ("dp", "tp"), ("pp",)]
    grid = ProcessGrid(combos=combos[::-1] if comm.rank % 2 else combos)
    try:
        assert list(grid._comms) == [("pp",), ("dp",), ("cp",), ("tp",), ("dp", "cp"), ("dp", "tp")]
        assert grid.comm_ranks(("tp", "dp")) == grid.group(("dp", "tp")) == list(range(WORLD))
    finally:
        grid.free()
    assert _raised_everywhere(comm, combos=[("dp", "cp"), ()]) == ("an empty combination of axes in combos: expected "
                                                                  "one or more of pp, dp, cp, tp, edp, ep, etp")


def test_waiting_for_a_late_rank_costs_no_core_and_reduces_exactly(comm):
    """hpcml.waiting: a rank that waits 1 s for the last one in ``barrier`` spends a few ms of
    CPU, not the second MPICH's blocking Barrier spins away; ``allreduce`` gives the exact max,
    min and sum of ints and arrays on every rank."""
    import numpy as np

    from hpcml import waiting

    late = comm.size - 1
    if comm.rank == late:
        time.sleep(1.0)
    cpu = time.process_time()
    waiting.barrier(comm)
    spent = time.process_time() - cpu
    if comm.rank != late:
        assert spent < 0.3, spent
    assert waiting.allreduce(comm, comm.rank) == comm.size - 1
    assert waiting.allreduce(comm, comm.rank + 5, "min") == 5
    assert waiting.allreduce(comm, 2**40 + comm.rank, "sum") == comm.size * 2**40 + sum(range(comm.size))
    got = waiting.allreduce(comm, np.array([comm.rank, -comm.rank]), "max")
    assert got.tolist() == [comm.size - 1, 0]
