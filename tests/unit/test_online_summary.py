"""A finished campaign resumed (its trainer resumed at its last step, taking none) keeps the final
loss the earlier job wrote: a newcomer saw ``"final_loss": null`` replace 0.00248."""

from __future__ import annotations

import json

from hpcml.train.online_report import earlier_final_loss


def test_the_earlier_jobs_final_loss_is_kept_only_for_its_own_campaign_and_step(tmp_path):
    f = tmp_path / "train_summary.json"
    assert earlier_final_loss(str(f), campaign="c1", step=150) is None  # none written yet
    f.write_text(json.dumps({"campaign": "c1", "run": "r1", "gradient_steps": 150, "final_loss": 0.00248}))
    assert earlier_final_loss(str(f), campaign="c1", step=150) == 0.00248  # another driver run, same campaign
    assert earlier_final_loss(str(f), campaign="c2", step=150) is None
    assert earlier_final_loss(str(f), campaign="c1", step=200) is None
    assert earlier_final_loss(None, campaign="c1", step=150) is None
    for bad in ('{"campaign": "c1", "gradient_steps": 150, "final_loss": true}', "[1, 2]", "not json",
                '{"campaign": "c1", "gradient_steps": 150, "final_loss": "0.1"}'):
        f.write_text(bad)
        assert earlier_final_loss(str(f), campaign="c1", step=150) is None, bad
    f.write_bytes(b" " * (2 << 20))  # larger than a summary: not read
    assert earlier_final_loss(str(f), campaign="c1", step=150) is None
