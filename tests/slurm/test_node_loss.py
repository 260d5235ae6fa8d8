"""Losing a node: a 2-node job (`--nodes 1-2`, requeue) loses n2; Slurm requeues it on n1
alone; it resumes from the latest checkpoint on the layout that fits (tp2 x dp2 -> tp2) and
finishes with the losses of an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.slurm.scenarios import LLM, PY, node_loss, reference_losses, sh

STEPS, EVERY = 16, 4


def test_losing_a_node_continues_on_the_survivor(tmp_path):
    expected = reference_losses(4, "--tp", "2", "--steps", str(STEPS), "--seed", "0")
    r = node_loss(tmp_path, steps=STEPS, every=EVERY, fail_after=6)
    assert (r["state"], r["restarts"], r["runs"], r["nodes_after"]) == ("COMPLETED", 1, 2, "n1"), r
    assert r["layouts"][-1] == {"pp": 1, "dp": 1, "cp": 1, "tp": 2}  # tp kept, dp what one node leaves
    assert r["resumed_at"] % EVERY == 1 and 0 <= r["steps_lost"] <= EVERY
    assert sorted(r["losses"]) == list(range(1, STEPS + 1))
    got = [r["losses"][s] for s in range(1, STEPS + 1)]
    assert got == pytest.approx(expected, rel=1e-4)  # another layout after the loss: same model, same batch


def test_a_layout_that_cannot_fit_the_ranks_left_says_what_would():
    out = sh("srun", "-N1", "-n2", "--mpi=pmi2", PY, LLM, "--tp", "2", "--pp", "2", "--steps", "2", timeout=180)
    assert out.returncode == 2
    ours = [line for line in out.stderr.splitlines() if not line.startswith("srun:")]
    assert ours == ["llm_pretrain: error: cannot infer dp: tp(2) * pp(2) = 4 does not divide world size 2; "
                    "2 ranks fit tp(2), or pp(2) (dp takes the rest), or run on a multiple of 4 ranks"]
