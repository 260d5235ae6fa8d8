"""MoE parallel folding: the grid's dense and expert groups are Megatron-core's, on its golden
lists (``tests/unit_tests/test_parallel_state.py``'s layouts) and on a sweep.

Two independent references, both written here from Megatron's definitions:
``masked_orthogonal`` is its RankGenerator (prefix-product strides over an order such as
"tp-cp-dp-pp", first innermost; a group varies the masked axes), and ``past_code`` the
explicit loops its test keeps as "golden_rank_result_from_past_code".
"""

from __future__ import annotations

import itertools
import math

import pytest

from hpcml.errors import GridError
from hpcml.grid.layout import Layout


def masked_orthogonal(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron's generate_masked_orthogonal_rank_groups: groups vary the masked axes."""
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    masked = [i for i, m in enumerate(mask) if m]
    unmasked = [i for i, m in enumerate(mask) if not m]
    group_size = math.prod(sizes[i] for i in masked)
    groups = []
    for g in range(world // group_size):
        base, rest = 0, g
        for i in unmasked:  # innermost first
            base += (rest % sizes[i]) * strides[i]
            rest //= sizes[i]
        members = []
        for k in range(group_size):
            r, rest = base, k
            for i in masked:
                r += (rest % sizes[i]) * strides[i]
                rest //= sizes[i]
            members.append(r)
        groups.append(members)
    return groups


def megatron_groups(world: int, tp: int, pp: int, cp: int, ep: int, etp: int | None = None) -> dict[str, list]:
    """Megatron's decoder generator (tp, cp, dp, pp) and expert generator (etp, ep, edp, pp)."""
    etp = etp or tp
    dp, edp = world // (tp * cp * pp), world // (etp * ep * pp)
    dense = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    expert = {"tp": etp, "ep": ep, "dp": edp, "pp": pp}

    def ranks(sizes: dict[str, int], token: str) -> list[list[int]]:
        wanted = token.split("-")
        return masked_orthogonal(world, list(sizes.values()), [a in wanted for a in sizes])

    out = {name: ranks(dense, name) for name in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "tp-dp-cp")}
    out.update({f"expert:{name}": ranks(expert, name) for name in ("tp", "ep", "tp-ep", "dp", "tp-ep-pp", "pp")})
    return out


OURS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp-cp": ("dp", "cp"), "tp-pp": ("tp", "pp"),
        "tp-dp": ("tp", "dp"), "tp-dp-cp": ("tp", "dp", "cp"), "expert:tp": "etp", "expert:ep": "ep",
        "expert:tp-ep": ("ep", "etp"), "expert:dp": "edp", "expert:tp-ep-pp": ("pp", "ep", "etp"), "expert:pp": "pp"}


def past_code(world: int, tp: int, pp: int, cp: int, ep: int) -> dict[str, list]:
    """The explicit loops Megatron's test compares its RankGenerator with (dense dp, dp-cp,
    cp, tp, pp; expert tp-ep and dp), rewritten as plain arithmetic."""
    dp, edp = world // (tp * pp * cp), world // (tp * pp * ep)
    per_stage = world // pp
    out: dict[str, list] = {"dp": [], "dp-cp": [], "cp": [], "tp": [], "pp": []}
    for p in range(pp):
        start = p * per_stage
        out["dp"] += [list(range(start + j, start + per_stage, cp * tp)) for j in range(cp * tp)]
        out["dp-cp"] += [list(range(start + j, start + per_stage, tp)) for j in range(tp)]
        for d in range(dp):
            s = start + d * tp * cp
            out["cp"] += [list(range(s + k, s + tp * cp, tp)) for k in range(tp)]
    out["tp"] = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    out["pp"] = [list(range(i, world, per_stage)) for i in range(per_stage)]
    # experts: ranks as an array [pp, edp, ep, tp]; tp-ep groups are its rows of ep*tp, dp its edp columns
    index = lambda p, e_dp, e, t: ((p * edp + e_dp) * ep + e) * tp + t  # noqa: E731
    out["expert:tp-ep"] = [[index(p, d, e, t) for e in range(ep) for t in range(tp)]
                           for p in range(pp) for d in range(edp)]
    out["expert:dp"] = [[index(p, d, e, t) for d in range(edp)]
                        for p in range(pp) for e in range(ep) for t in range(tp)]
    return out


# Megatron's test_rank_generator_for_tp_dp_pp: (nodes, gpus per node, tp, pp, cp, ep)
MEGATRON_CASES = [
    (1, 1, 1, 1, 1, 1), (1, 8, 8, 1, 1, 1), (1, 8, 2, 2, 1, 1), (1, 8, 2, 4, 1, 1), (3, 8, 8, 3, 1, 1),
    (4, 8, 2, 4, 1, 1), (8, 8, 8, 8, 1, 1), (8, 8, 2, 1, 1, 4), (8, 8, 2, 2, 2, 4), (8, 8, 2, 1, 4, 8),
    (8, 8, 2, 2, 2, 8), (16, 8, 4, 8, 1, 1), (16, 8, 4, 8, 1, 4), (16, 8, 4, 8, 4, 1), (16, 8, 8, 8, 1, 1),
    (32, 8, 4, 8, 1, 1), (32, 8, 8, 8, 1, 1), (32, 8, 4, 8, 1, 4), (32, 8, 8, 8, 4, 1), (64, 8, 4, 2, 8, 8),
    (64, 8, 4, 8, 1, 1), (64, 8, 8, 8, 1, 1), (96, 8, 4, 8, 1, 1), (128, 8, 4, 2, 8, 8), (128, 8, 4, 8, 1, 1),
    (256, 8, 4, 8, 1, 1), (316, 8, 4, 8, 1, 1), (384, 8, 4, 8, 1, 1), (512, 8, 4, 8, 1, 1), (768, 8, 4, 8, 1, 1),
    (1024, 8, 4, 8, 1, 1), (1280, 8, 4, 8, 1, 1), (1344, 8, 4, 8, 1, 1),
]


@pytest.mark.parametrize("nodes,gpus,tp,pp,cp,ep", MEGATRON_CASES)
def test_megatron_golden_layouts(nodes, gpus, tp, pp, cp, ep):
    world = nodes * gpus
    lay = Layout(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep)
    golden, generated = past_code(world, tp, pp, cp, ep), megatron_groups(world, tp, pp, cp, ep)
    for name, groups in golden.items():
        assert lay.groups(OURS[name]) == groups == generated[name], name
    for name, groups in generated.items():
        assert lay.groups(OURS[name]) == groups, name


def test_sweep_every_layout_of_small_worlds():
    checked = 0
    for world in (1, 2, 4, 6, 8, 12, 16, 24):
        for tp, cp, pp, ep, etp in itertools.product((1, 2, 3, 4), (1, 2), (1, 2, 3), (1, 2, 3, 4, 8), (None, 1, 2)):
            if world % (tp * cp * pp) or (world // pp) % (ep * (etp or tp)):
                with pytest.raises(GridError):
                    Layout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
                continue
            lay = Layout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
            generated = megatron_groups(world, tp, pp, cp, ep, etp)
            for name, groups in generated.items():
                assert lay.groups(OURS[name]) == groups, (world, tp, cp, pp, ep, etp, name)
            # Megatron asserts both generators agree on pp; every rank's coordinates name its groups
            assert generated["pp"] == generated["expert:pp"]
            for rank in range(world):
                c = lay.coords(rank)
                for axis in lay.axis_names:
                    assert lay.group_of(rank, axis) == lay.groups(axis)[lay.group_index(rank, axis)]
                    assert lay.group_of(rank, axis)[c[axis]] == rank
            checked += 1
    assert checked > 300


def test_folding_on_four_ranks_by_hand():
    # ep spans dp: dense dp is all 4 ranks, experts split in 2 groups of 2 consecutive ranks
    lay = Layout(world_size=4, ep=2)
    assert (lay.dp, lay.ep, lay.edp) == (4, 2, 2)
    assert lay.groups("dp") == [[0, 1, 2, 3]]
    assert lay.groups("ep") == [[0, 1], [2, 3]]
    assert lay.groups("edp") == [[0, 2], [1, 3]]
    # with tp 2 the ep group keeps the tp coordinate (etp = tp), and spans dp
    lay = Layout(world_size=8, tp=2, ep=2)
    assert lay.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups(("ep", "etp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # ep over cp x dp: cp 2, dp 2, ep 4
    lay = Layout(world_size=4, cp=2, ep=4)
    assert lay.groups("cp") == [[0, 1], [2, 3]] and lay.groups("ep") == [[0, 1, 2, 3]]
    assert lay.coords(3) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0, "ep": 3, "edp": 0}


def test_expert_axes_errors_name_the_numbers():
    with pytest.raises(GridError, match=r"ep\(3\) \* etp\(1\) = 3 does not divide the 8 ranks of a pipeline stage "
                                         r"\(world size 8 / pp\(1\)\); ep must divide dp \* cp = 8"):
        Layout(world_size=8, ep=3)
    with pytest.raises(GridError, match=r"ep\(4\) \* etp\(2\) = 8 does not divide the 4 ranks"):
        Layout(world_size=8, pp=2, tp=2, ep=4)
    with pytest.raises(GridError, match="degree of ep must be a positive integer, got -1"):
        Layout(world_size=8, ep=-1)
    with pytest.raises(GridError, match="mix the dense arrangement"):
        Layout(world_size=8, ep=2).groups(("dp", "ep"))
    lay = Layout(world_size=8, tp=2, ep=2, etp=1)
    assert eval(repr(lay), {"Layout": Layout}) == lay and lay.axis_names[-1] == "etp"
