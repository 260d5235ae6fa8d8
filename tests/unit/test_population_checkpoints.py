"""A population's checkpoints as the campaign driver and a user meet them (issue 45): what a
resumed campaign need not run again is what the step every member holds keeps, and the best
member's model becomes the run's own ``checkpoints/``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpcml import ckpt
from hpcml.ckpt.format import common_step
from hpcml.train.online_state import member_roots, simulations_kept
from hpcml.train.population_online import BEST_RECORD, export_best


def _save(root, step: int, keys: list[tuple[int, int]], w: float = 0.0) -> None:
    """A member's checkpoint at ``step`` whose stream state has taken ``keys`` ((sim, output))."""
    seen = torch.tensor(keys, dtype=torch.int64).reshape(-1, 2)
    ckpt.save(root, step, {"model/w": torch.full((3, 4), w), "stream/rank_00000/seen": seen})


def test_common_step_is_the_newest_every_member_holds():
    assert common_step([[2, 4, 5], [2, 4], [1, 2, 4, 6]]) == 4
    assert common_step([[2], [3]]) is None and common_step([]) is None and common_step([[7]]) == 7


def test_a_resumed_campaign_keeps_what_the_step_every_member_holds_keeps(tmp_path):
    """Member 1 lost its newest save: both resume at step 4, so simulation 2 (taken by member 0
    only at step 5) runs again; one trainer's root keeps its latest; links are no members."""
    root = tmp_path / "checkpoints"
    _save(root / "member_0", 4, [(0, 0), (0, 1)])
    _save(root / "member_0", 5, [(0, 0), (0, 1), (2, 0), (2, 1)])
    _save(root / "member_1", 4, [(1, 0), (1, 1), (3, 0)])
    outputs = {0: 2, 1: 2, 2: 2, 3: 2}
    assert [p.name for p in member_roots(root)] == ["member_0", "member_1"]
    assert simulations_kept(root, outputs) == {0, 1}  # 2: only in member 0's step 5; 3: one output of two
    os.symlink(root / "member_0", root / "member_2")
    assert [p.name for p in member_roots(root)] == ["member_0", "member_1"]
    _save(root / "member_1", 5, [(1, 0), (1, 1), (3, 0), (3, 1)])
    assert simulations_kept(root, outputs) == {0, 1, 2, 3}
    one = tmp_path / "one"
    assert simulations_kept(one, outputs) == set()  # nothing saved: everything runs again
    _save(one, 3, [(5, 0), (5, 1)])
    assert simulations_kept(one, {5: 2}) == {5}


def test_the_best_members_model_becomes_the_runs_checkpoint(tmp_path):
    """After the last step the best member's newest step is linked into ``checkpoints/`` with
    ``latest`` and ``best.json``: loading the run's checkpoints gives that member's weights; a
    later export replaces its own earlier one; a step that one trainer saved there is never
    replaced."""
    root = tmp_path / "checkpoints"
    _save(root / "member_0", 6, [(0, 0)], w=1.0)
    _save(root / "member_1", 6, [(1, 0)], w=2.0)
    dst = export_best(root, 1)
    assert dst == root / "step_00000006" and (root / "latest").read_text().strip() == "step_00000006"
    assert json.loads((root / BEST_RECORD).read_text()) == {"member": 1, "step_dir": "step_00000006"}
    assert torch.equal(ckpt.read_tensors(root, "model/")["model/w"], torch.full((3, 4), 2.0))
    shard = root / "member_1" / "step_00000006" / "rank_00000.h5"
    assert os.stat(dst / "rank_00000.h5").st_ino == os.stat(shard).st_ino  # a link, not a copy
    from hpcml.ckpt.checked import Checkpoint

    with Checkpoint(root) as ck:  # the manifest's digests hold for the linked files
        assert ck.verify() == []
    assert export_best(root, 0) == dst  # its own earlier export: replaced
    assert torch.equal(ckpt.read_tensors(root, "model/")["model/w"], torch.full((3, 4), 1.0))
    assert simulations_kept(root, {0: 1, 1: 1}) == {0, 1}  # the members still decide what a resume keeps
    _save(root / "member_1", 8, [(1, 0)], w=3.0)
    assert export_best(root, 1) == root / "step_00000008"  # a later step: the earlier export removed
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000008"]
    assert (root / "member_1" / "step_00000006" / "rank_00000.h5").is_file()  # the member's own untouched
    other = tmp_path / "reused"
    _save(other, 6, [(9, 0)], w=5.0)  # one trainer's save in a run directory used twice
    _save(other / "member_0", 6, [(0, 0)], w=1.0)
    assert export_best(other, 0) is None
    assert torch.equal(ckpt.read_tensors(other, "model/")["model/w"], torch.full((3, 4), 5.0))


def test_export_refuses_a_member_without_a_checkpoint(tmp_path):
    with pytest.raises(Exception, match="no checkpoint at"):
        export_best(tmp_path, 0)


def _steps(root) -> list[int]:
    from hpcml.ckpt.format import steps_of

    return steps_of(root)


def test_a_members_rotation_spares_the_step_every_member_holds(tmp_path):
    """keep=1 in two members saving in lock-step: member 0's save of step 4 finishes while
    member 1's is killed. Member 0 must keep step 2 (the step both hold, which the population
    resumes from); once member 1 holds step 4 too, the next save lets step 2 go. A plain
    keep=1 would have left the members no step in common."""
    from hpcml.ckpt.format import Keep

    root = tmp_path / "checkpoints"
    m0, m1 = root / "member_0", root / "member_1"
    keep = Keep(last=1, group=(m0, m1))
    for m in (m0, m1):
        _save(m, 2, [])
    ckpt.save(m0, 4, {"model/w": torch.zeros(3)}, keep=keep)  # member 1's save of step 4: killed
    assert (_steps(m0), _steps(m1)) == ([2, 4], [2])
    assert common_step([_steps(m0), _steps(m1)]) == 2
    ckpt.save(m1, 4, {"model/w": torch.zeros(3)}, keep=keep)  # resumed at 2, saved 4: the common step moves on
    assert (_steps(m0), _steps(m1)) == ([2, 4], [4])
    ckpt.save(m0, 6, {"model/w": torch.zeros(3)}, keep=keep)
    assert _steps(m0) == [4, 6]  # 2 rotated out; 4 spared until member 1 holds 6
    ckpt.save(m0, 8, {"model/w": torch.zeros(3)}, keep=2)  # a plain keep: the newest two, nothing spared
    assert _steps(m0) == [6, 8]
    with pytest.raises(ValueError, match=r"Keep\(last=0\): expected a whole number >= 1 of steps to keep"):
        Keep(last=0)


def test_members_holding_saves_but_no_common_step_are_refused_not_started_anew(tmp_path):
    """Starting anew would rotate every member's saves out: refused in one line naming each
    member's steps, before torch's work (the same rule in the job's collective resume); a
    population resized from 2 members is told what resumes its saves; none saved: a fresh start."""
    from hpcml.errors import ConfigError
    from hpcml.train.online_state import resume_common
    from hpcml.train.recipe_checks import resume_point

    root = tmp_path / "checkpoints"
    assert resume_point(root, pop=2) is None  # nothing saved: a fresh start
    _save(root / "member_0", 4, [])
    _save(root / "member_1", 2, [])
    with pytest.raises(ConfigError) as e:
        resume_point(root, pop=2)
    assert str(e.value) == (f"{root}: the 2 members hold no checkpoint step in common (their steps: member_0 4; "
                            f"member_1 2): a population resumes only from a step every member holds, and starting "
                            f"anew would rotate these saves out; to start over, give another checkpoint directory or "
                            f"move these members' step directories aside (they stay readable by hpcml ckpt ls)")
    assert _steps(root / "member_0") == [4] and _steps(root / "member_1") == [2]
    with pytest.raises(ConfigError, match=r"member_2 none; member_3 none\): .*they are the saves of 2 members: a "
                                          r"population of 2 resumes them"):
        resume_common([[2, 4], [4], [], []], root)
    assert resume_common([[2, 4], [2]], root) == 2 and resume_common([[], []], root) is None
    _save(root / "member_1", 4, [])
    assert resume_point(root, pop=2, steps=10) == (4, f"{root} (every member's step_00000004)")
