"""The agreement rules of ProcessGrid and torch_dist.init, on gathered views of many ranks
(what the one allgather returns): the MPI suite runs them at 2, 3 and 4 ranks; here, the
cases a CPU-only build cannot make (two backends) and wider worlds, without MPI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpcml.errors import ConfigError, GridError, LaunchError
from hpcml.grid import mpi, torch_dist

DP6 = "pp(1) x dp(6) x cp(1) x tp(1), combos [['dp', 'cp']]"
TP2 = "pp(1) x dp(3) x cp(1) x tp(2), combos [['dp', 'cp']]"


def test_grid_views_that_agree_pass_and_any_difference_names_the_ranks():
    mpi._agree([(DP6, None)] * 6)
    with pytest.raises(GridError) as info:
        mpi._agree([(TP2, None), (DP6, None), (TP2, None)] + [(DP6, None)] * 3)
    assert str(info.value) == (f"ProcessGrid arguments differ across ranks: rank(s) 0, 2 gave {TP2}; rank(s) 1, 3, "
                               f"4, 5 gave {DP6}; every rank must pass the same degrees and combos")


def test_a_bad_argument_anywhere_is_every_ranks_error():
    bad = "cannot infer dp: tp(4) * pp(1) = 4 does not divide world size 6"
    with pytest.raises(GridError) as info:
        mpi._agree([(DP6, None)] * 2 + [(None, bad)] * 4)
    assert str(info.value) == f"ProcessGrid arguments on rank 2: {bad} (and on rank(s) 3-5)"
    with pytest.raises(GridError) as info:  # the same mistake everywhere: its own message
        mpi._agree([(None, bad)] * 6)
    assert str(info.value) == bad


def _view(backend: str = "gloo", device: str = "cpu", joined: tuple | None = None, problem=None) -> tuple:
    setup = f"gave backend {backend} on {device.split(':')[0]}, {'in' if joined else 'not in'} a process group"
    return (device, problem, setup, joined, "", 0)


GRID4 = SimpleNamespace(world_size=4)


def test_torch_setups_that_differ_raise_one_config_error():
    """nccl on three ranks and gloo on one (a node without a GPU) once hung in the rendezvous."""
    torch_dist._agree(GRID4, [_view()] * 4)
    with pytest.raises(ConfigError) as info:
        torch_dist._agree(GRID4, [_view("nccl", f"cuda:{r}") for r in range(3)] + [_view()])
    assert str(info.value) == ("torch.distributed set-ups differ across ranks: rank(s) 0-2 gave backend nccl on cuda, "
                               "not in a process group; rank(s) 3 gave backend gloo on cpu, not in a process group; "
                               "every rank must pass the same backend and see the same kind of device")
    with pytest.raises(ConfigError, match=r"rank\(s\) 0 gave backend gloo on cpu, in a process group; rank\(s\) 1-3"):
        torch_dist._agree(GRID4, [_view(joined=(0, 4))] + [_view()] * 3)
    with pytest.raises(LaunchError) as info:
        torch_dist._agree(GRID4, [_view(joined=(r, 2 if r == 1 else 4)) for r in range(4)])
    assert str(info.value) == "torch.distributed already initialised as rank 1 of 2 on MPI rank 1 of 4"


def test_a_torch_problem_on_one_rank_keeps_its_kind_on_every_rank():
    addr = ("LaunchError", "network interface 'hsn9' has no IPv4 address (No such device); interfaces here: lo")
    with pytest.raises(LaunchError) as info:
        torch_dist._agree(GRID4, [_view(problem=addr)] + [_view()] * 3)
    assert str(info.value) == f"torch.distributed on rank 0: {addr[1]}"
    with pytest.raises(ConfigError) as info:
        torch_dist.check_backend("bogus")
    assert str(info.value).startswith("backend 'bogus': this torch build has ")
    bogus = ("ConfigError", str(info.value))
    with pytest.raises(ConfigError) as info:
        torch_dist._agree(GRID4, [_view(problem=bogus)] * 4)
    assert str(info.value) == bogus[1]
