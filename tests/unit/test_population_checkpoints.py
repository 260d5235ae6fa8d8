"""A population's checkpoints as the campaign driver and a user meet them (issue 45): what a
resumed campaign need not run again is what the step every member holds keeps, and the best
member's model becomes the run's own ``checkpoints/``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpcml import ckpt
from hpcml.train.online_state import common_step, member_roots, simulations_kept
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
