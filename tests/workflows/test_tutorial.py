"""The tutorial's own three files, taken from docs/tutorial-online-training.md as a newcomer
copies them (my_sim.py, my_train.py, my_campaign.py), run as written -- smaller: 4
simulations and 100 steps instead of 16 and 1000. The trainer is its model and one call."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("parsl")

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial-online-training.md"


def _block(starts: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S)
    found = [b for b in blocks if b.lstrip().startswith(starts)]
    assert len(found) == 1, f"the tutorial has {len(found)} python blocks starting with {starts!r}"
    return found[0]


def _smaller(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


@pytest.mark.timeout(300)
def test_the_tutorials_simulation_trainer_and_campaign_run_as_written(tmp_path):
    sim = _block('"""A minimal MPI simulation that streams')
    train = _block('"""Trains a field surrogate on what my_sim.py streams')
    campaign = _block("import sys\nfrom pathlib import Path\n\nfrom hpcml.ensemble import Campaign")
    assert len(train.strip().splitlines()) <= 40  # the trainer is its model and one call
    assert "HPCML_" not in train and "HPCML_" not in campaign and "stream.key" not in campaign
    (tmp_path / "my_sim.py").write_text(sim)
    (tmp_path / "my_train.py").write_text(train)
    campaign = _smaller(campaign, "16, seed=0)", "4, seed=0)")
    campaign = _smaller(campaign, "steps=1000,", "steps=100,")
    (tmp_path / "my_campaign.py").write_text(campaign)
    env = {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "my_campaign.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=280, env=env)
    run = tmp_path / "runs" / "mine"
    assert out.returncode == 0, out.stderr[-3000:] + (run / "train.err").read_text()[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("ok [0, 1, 2, 3] {'expected': 80, "), out.stdout
    summary = json.loads((run / "train_summary.json").read_text())
    outputs = 800 // 40  # my_sim.py's defaults: 800 steps, an output every 40
    assert (summary["status"], summary["samples_expected"], summary["samples_ingested"], summary["samples_missing"]) \
        == ("ok", 4 * outputs, 4 * outputs, 0)
    assert summary["gradient_steps"] == 100 and summary["dropped_messages"] == {}
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 100 and metrics[-1]["loss"] < metrics[0]["loss"]  # it learned
    assert json.loads((run / "campaign.json").read_text())["samples"]["missing"] == 0
    assert "no sample shape configured" not in (run / "train.err").read_text()  # the tutorial gives the grid
