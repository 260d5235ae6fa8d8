"""The pure grid layout: coordinates, groups and validation, at world sizes far beyond this machine."""

from __future__ import annotations

import numpy as np
import pytest

from hpcml.errors import GridError, HpcmlError
from hpcml.grid.layout import DENSE_AXES, EXPERT_AXES, Layout


def test_megatron_order_tp_dp_pp_on_8():
    lay = Layout(world_size=8, tp=2, pp=2)
    assert lay.dp == 2
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("cp") == [[r] for r in range(8)]


def test_matches_device_mesh_rank_map():
    # DeviceMesh lays ranks out as arange(N).view(shape), last dim innermost.
    lay = Layout(world_size=48, pp=2, dp=3, cp=2, tp=4)
    mesh = np.arange(48).reshape(2, 3, 2, 4)
    for rank in range(48):
        c = lay.coords(rank)
        assert mesh[c["pp"], c["dp"], c["cp"], c["tp"]] == rank
        assert lay.rank_of(**c) == rank
    # a tp group is a row of the last dim; a dp group varies only the dp index
    assert lay.groups("tp")[0] == mesh[0, 0, 0].tolist()
    assert lay.group_of(13, "dp") == mesh[0, :, 1, 1].tolist()


def test_combined_axes_gradient_group():
    lay = Layout(world_size=16, dp=2, cp=2, tp=2, pp=2)
    groups = lay.groups(("dp", "cp"))
    assert groups[0] == [0, 2, 4, 6]  # tp=0, pp=0; cp stride 2, dp stride 4
    assert groups == lay.groups(("cp", "dp"))  # order of names does not matter
    assert sorted(r for g in groups for r in g) == list(range(16))
    for rank in range(16):
        assert lay.group_of(rank, ("dp", "cp")) == groups[lay.group_index(rank, ("dp", "cp"))]


@pytest.mark.parametrize("world,degrees", [(8, {"tp": 2, "pp": 2}), (512, {"tp": 8, "cp": 2, "pp": 4}),
                                           (24, {"tp": 3, "dp": -1, "pp": 2}), (32, {"ep": 2, "tp": 4})])
def test_groups_partition_the_world(world, degrees):
    lay = Layout.from_degrees(world, degrees)
    for axes in [(a,) for a in lay.axis_names] + [("dp", "cp"), ("tp", "cp"), ("pp", "dp", "cp", "tp")]:
        arr = lay.group_array(axes)
        assert arr.shape == (world // np.prod([getattr(lay, a) for a in axes]),
                             np.prod([getattr(lay, a) for a in axes]))
        assert sorted(arr.ravel().tolist()) == list(range(world))
        for rank in (0, world // 3, world - 1):
            members = lay.group_of(rank, axes)
            assert rank in members and members == arr[lay.group_index(rank, axes)].tolist()
            arrangement = DENSE_AXES if all(a in DENSE_AXES for a in axes) else EXPERT_AXES
            others = {a for a in arrangement if a not in axes}
            assert all({k: v for k, v in lay.coords(m).items() if k in others} ==
                       {k: v for k, v in lay.coords(rank).items() if k in others} for m in members)


def test_inference_and_defaults():
    assert Layout(world_size=8).dp == 8
    assert Layout(world_size=8, tp=-1, dp=2).tp == 4
    assert Layout(world_size=8, pp=-1, tp=2).dp == 1  # dp defaults to 1 when another axis is inferred
    assert Layout(world_size=6, tp=3, pp=2).degrees == {"pp": 2, "dp": 1, "cp": 1, "tp": 3}
    assert "ep" in Layout(world_size=4, ep=2).axis_names and "ep" not in Layout(world_size=4).axis_names


def test_repr_rebuilds():
    lay = Layout(world_size=16, tp=2, cp=2, pp=2)
    again = eval(repr(lay), {"Layout": Layout})
    assert again == lay and again.dp == 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=8, tp=3, pp=2, dp=1), "tp(3) * dp(1) * pp(2) = 6 != world size 8"),
    (dict(world_size=8, tp=3, pp=2), "cannot infer dp: tp(3) * pp(2) = 6 does not divide world size 8; "
     "8 ranks fit pp(2) (dp takes the rest), or run on a multiple of 6 ranks"),
    (dict(world_size=2, tp=2, pp=2), "cannot infer dp: tp(2) * pp(2) = 4 does not divide world size 2; "
     "2 ranks fit tp(2), or pp(2) (dp takes the rest), or run on a multiple of 4 ranks"),
    (dict(world_size=3, tp=2, cp=2), "cannot infer dp: tp(2) * cp(2) * pp(1) = 4 does not divide world size 3; "
     "3 ranks fit only dp(3), or run on a multiple of 4 ranks"),
    (dict(world_size=8, tp=0), "degree of tp must be a positive integer or -1 (inferred), got 0"),
    (dict(world_size=8, pp=-2), "degree of pp must be a positive integer or -1 (inferred), got -2"),
    (dict(world_size=8, dp=-1, pp=-1), "only one axis degree may be -1 (inferred), got -1 for pp and dp"),
    (dict(world_size=0), "world size must be a positive integer, got 0"),
    (dict(world_size=8, tp=2, cp=2, dp=3), "tp(2) * cp(2) * dp(3) * pp(1) = 12 != world size 8"),
])
def test_bad_layouts_say_the_numbers(kwargs, message):
    with pytest.raises(GridError) as info:
        Layout(**kwargs)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError) and isinstance(info.value, HpcmlError)


def test_unknown_axis_and_rank_checks():
    with pytest.raises(GridError, match="unknown axis 'xp': expected one of pp, dp, ep, cp, tp, etp"):
        Layout.from_degrees(8, {"xp": 2})
    lay = Layout(world_size=8, tp=2)
    with pytest.raises(GridError, match="rank 8 outside world size 8"):
        lay.coords(8)
    with pytest.raises(GridError, match="coordinate tp=2 outside degree 2"):
        lay.rank_of(tp=2)


def test_json_form():
    d = Layout(world_size=8, tp=2, pp=2).to_dict()
    assert d == {"world_size": 8, "axes": {"pp": 2, "dp": 2, "cp": 1, "tp": 2},
                 "groups": {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                            "cp": [[r] for r in range(8)], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}}


def test_131072_ranks():
    # Timing lives in benchmarks/grid_layout.py; here only the values at that scale.
    lay = Layout(world_size=131072, tp=8, cp=4, pp=16)
    dpcp = lay.group_array(("dp", "cp"))
    for axis in lay.axis_names:
        lay.group_array(axis)
    members = lay.group_of(99_999, ("dp", "cp"))
    assert dpcp.shape == (128, 1024) and len(members) == 1024 and 99_999 in members
    assert members == dpcp[lay.group_index(99_999, ("dp", "cp"))].tolist()
