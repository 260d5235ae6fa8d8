"""A rank's share of its host's CPUs (hpcml.grid.cpus): unbound ranks that outnumber their
CPUs, each in a session of its own, are pinned round-robin; bound, partly overlapping, few
enough ranks, or ranks sharing sessions are left alone."""

from __future__ import annotations

import pytest

from hpcml.errors import GridError
from hpcml.grid.cpus import bind_policy, share


def plans(views, policy="auto", sessions=None):
    """Each rank in a session of its own (as Hydra starts them) unless ``sessions`` says."""
    sessions = sessions or range(100, 100 + len(views))
    return [share(r, [(h, m, s) for (h, m), s in zip(views, sessions)], policy=policy) for r in range(len(views))]


def test_four_unbound_ranks_on_two_cpus_are_pinned_round_robin():
    got = plans([("h", [0, 1])] * 4)
    assert [p.cpus for p in got] == [(0,), (1,), (0,), (1,)]
    assert [p.sharers for p in got] == [2, 2, 2, 2] and all(p.pinned for p in got)


def test_five_ranks_on_two_cpus_share_unevenly():
    got = plans([("h", [2, 3])] * 5)
    assert [p.cpus for p in got] == [(2,), (3,), (2,), (3,), (2,)]
    assert [p.sharers for p in got] == [3, 2, 3, 2, 3]


def test_ranks_that_fit_their_cpus_are_left_unbound():
    got = plans([("h", [0, 1, 2, 3])] * 2)
    assert [(p.cpus, p.sharers, p.pinned) for p in got] == [((0, 1, 2, 3), 2, False)] * 2


def test_ranks_bound_at_launch_are_left_alone():
    got = plans([("h", [0]), ("h", [1]), ("h", [0]), ("h", [1])])
    assert [(p.cpus, p.sharers, p.pinned) for p in got] == [((0,), 2, False), ((1,), 2, False)] * 2


def test_partly_overlapping_masks_are_left_alone():
    got = plans([("h", [0, 1]), ("h", [1, 2]), ("h", [0, 1]), ("h", [1, 2])])
    assert not any(p.pinned for p in got) and [p.sharers for p in got] == [4, 4, 4, 4]


def test_another_host_with_a_colliding_hash_is_not_a_sharer():
    views = [("a", [0, 1]), ("b", [0, 1]), ("a", [0, 1]), ("b", [0, 1])]
    got = plans(views)
    assert not any(p.pinned for p in got) and [p.sharers for p in got] == [2, 2, 2, 2]


def test_ranks_of_one_session_are_left_unbound():
    """srun -N1 -n4: one slurmstepd session, one scheduler group, which shares its CPUs fairly."""
    got = plans([("h", [0, 1])] * 4, sessions=[7] * 4)
    assert [(p.cpus, p.sharers, p.pinned) for p in got] == [((0, 1), 4, False)] * 4


def test_ranks_of_two_sessions_on_one_host_are_left_unbound():
    """Two slurmd on one host: a session per node. Pinned round-robin, each group would be
    split over both CPUs against the other (checkpoint commits up to 250 s instead of 0.3 s)."""
    got = plans([("h", [0, 1])] * 4, sessions=[7, 7, 9, 9])
    assert not any(p.pinned for p in got) and [p.sharers for p in got] == [4] * 4


def test_policy_none_leaves_oversubscribed_ranks_unbound():
    got = plans([("h", [0, 1])] * 4, policy="none")
    assert [(p.cpus, p.sharers, p.pinned) for p in got] == [((0, 1), 4, False)] * 4


def test_bind_policy_from_the_environment(monkeypatch):
    monkeypatch.delenv("HPCML_CPU_BIND", raising=False)
    assert bind_policy() == "auto"
    monkeypatch.setenv("HPCML_CPU_BIND", "None")
    assert bind_policy() == "none"
    monkeypatch.setenv("HPCML_CPU_BIND", "cores")
    with pytest.raises(GridError, match=r"^HPCML_CPU_BIND='cores': expected one of auto, none$"):
        bind_policy()
