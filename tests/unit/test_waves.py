"""The waves of an adaptive campaign (issue 25): recorded before they run, read back by a
restarted driver so it runs the same simulations and proposes on as the first would have."""

from __future__ import annotations

import json
import os

import pytest

from hpcml.ensemble.sampling import Breed, Halton, SimStats
from hpcml.ensemble.waves import WAVES_FILE, WavePlan
from hpcml.errors import ConfigError

BOUNDS = {"k": (0.1, 10.0), "q": (-1.0, 1.0)}


def _sampler():
    return Breed(bounds=BOUNDS, seed=11, log={"k"}, ramp_waves=1, r_end=0.5)


def _feedback(sims):
    """Loss high where q > 0.5: what a trainer would report on those simulations."""
    return {str(i): SimStats(params=p, loss=5.0 if p["q"] > 0.5 else 0.1, samples=4) for i, p in sims}


def _run(run_dir, waves, stop_after=None):
    run_dir.mkdir(exist_ok=True)
    plan = WavePlan(run_dir, _sampler(), budget=50, size=12)
    out = []
    for _ in range(waves):
        out += plan.next_wave(_feedback(plan.simulations()), feedback_step=len(out))
        if stop_after is not None and len(plan.waves) == stop_after:
            break
    return plan, out


def test_a_restarted_driver_runs_the_recorded_waves_and_proposes_on_the_same(tmp_path):
    whole, all_sims = _run(tmp_path / "a", 5)
    assert [len(w["ids"]) for w in whole.waves] == [12, 12, 12, 12, 2] and whole.done
    assert [i for i, _ in all_sims] == list(range(50))
    first, _ = _run(tmp_path / "b", 5, stop_after=2)  # the driver dies after two waves
    again = WavePlan(tmp_path / "b", _sampler(), budget=50, size=12)  # a new driver, a fresh sampler
    assert again.simulations() == whole.simulations()[:24]
    rest = []
    while not again.done:
        rest += again.next_wave(_feedback(again.simulations()), feedback_step=0)
    assert again.simulations() == whole.simulations()
    assert again.next_wave({}) == []
    # the adaptive waves went where the loss is: q > 0.5 is a quarter of the space
    late = [p for _, p in whole.simulations()[12:]]
    assert sum(p["q"] > 0.5 for p in late) / len(late) > 0.4


def test_a_torn_last_line_is_dropped_and_a_foreign_record_refused(tmp_path):
    plan, _ = _run(tmp_path, 2)
    path = tmp_path / WAVES_FILE
    good = path.read_bytes()
    path.write_bytes(good + b'{"wave": 2, "ids": [24')  # killed while appending wave 2
    again = WavePlan(tmp_path, _sampler(), budget=50, size=12)
    assert len(again.waves) == 2 and again.simulations() == plan.simulations()
    lines = good.decode().splitlines()
    w = json.loads(lines[1])
    w["ids"] = [i + 1 for i in w["ids"]]  # numbered with a gap
    path.write_text(lines[0] + "\n" + json.dumps(w) + "\n")
    with pytest.raises(ConfigError, match=r"waves\.jsonl, line 2: not the next wave of this record \(wave 1, "
                                          r"simulations numbered on from 12\)$"):
        WavePlan(tmp_path, _sampler(), budget=50, size=12)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ConfigError, match=r"waves\.jsonl: not a regular file$"):
        WavePlan(tmp_path, _sampler(), budget=50, size=12)


def test_bad_plans_and_samplers_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^WavePlan budget=0: expected an integer >= 1$"):
        WavePlan(tmp_path, Halton(BOUNDS), budget=0, size=4)
    with pytest.raises(ConfigError, match=r"^WavePlan sampler=3: expected a Sampler"):
        WavePlan(tmp_path, 3, budget=4, size=4)

    class Short(Halton):
        def propose(self, n, feedback):
            return super().propose(n - 1, feedback)

    short = WavePlan(tmp_path, Short(BOUNDS), budget=4, size=4)
    with pytest.raises(ConfigError, match=r"^the sampler proposed 3 parameter sets for a wave of 4"):
        short.next_wave({})
    assert not (tmp_path / WAVES_FILE).exists()  # nothing recorded of a wave that was refused
    assert short.sampler.state_dict()["drawn"] == 0  # and the sampler is where it was
