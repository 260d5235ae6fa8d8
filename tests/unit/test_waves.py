"""The waves of an adaptive campaign (issue 25): recorded before they run, read back by a
restarted driver so it runs the same simulations and proposes on as the first would have."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hpcml.ensemble.breed import Breed
from hpcml.ensemble.sampling import Halton, SimStats
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
    assert path.read_bytes() == good  # the torn piece is cut off: the next wave starts a line of its own
    again.next_wave({})
    assert len(WavePlan(tmp_path, _sampler(), budget=50, size=12).waves) == 3  # and reads back
    path.write_bytes(good)
    lines = good.decode().splitlines()
    w = json.loads(lines[1])
    w["ids"] = [i + 1 for i in w["ids"]]  # numbered with a gap
    path.write_text(lines[0] + "\n" + json.dumps(w) + "\n")
    with pytest.raises(ConfigError, match=r"waves\.jsonl, line 2: not the next wave of this record \(wave 1, "
                                          r"simulations numbered on from 12\)$"):
        WavePlan(tmp_path, _sampler(), budget=50, size=12)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ConfigError, match=r"waves\.jsonl: is a FIFO; expected a regular file"):
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


def test_a_wave_whose_simulations_cannot_be_built_is_not_recorded(tmp_path):
    from hpcml.ensemble.spec import SimSpec
    from hpcml.ensemble.waves import Waves

    def make(sim_id, params):
        if params["q"] > 0.0:
            raise ConfigError(f"my simulation cannot take q={params['q']}")
        return SimSpec(sim_id=sim_id, params=params, argv=["true"])

    w = Waves(make, Halton(BOUNDS, seed=0), budget=8, size=4)
    w.open(tmp_path)
    with pytest.raises(ConfigError, match=r"^my simulation cannot take q="):
        w.propose(None)
    assert not (tmp_path / WAVES_FILE).exists() and w.sampler.state_dict()["drawn"] == 0


def test_breed_skips_parents_it_cannot_place_and_huge_losses_do_not_overflow():
    nan = {"a": SimStats(params={"k": float("nan"), "q": 0.9}, loss=9.0),
           "b": SimStats(params={"k": 1.0, "q": 0.8}, loss=1e308),
           "c": SimStats(params={"k": 2.0, "q": 0.7}, loss=1e308)}
    s = Breed(bounds=BOUNDS, r_start=1.0, r_end=1.0, ramp_waves=0, parents=1.0, log={"k"})
    pts = s.propose(20, nan)
    assert s.last["parents"] == 2 and all(np.isfinite(list(p.values())).all() for p in pts)
    from hpcml.ensemble.sampling import FullFactorial

    with pytest.raises(ConfigError, match=r"^WavePlan budget=7: the sampler has 6 points$"):
        WavePlan("/nonexistent", FullFactorial(BOUNDS, {"k": 2, "q": 3}), budget=7, size=2)


def test_a_streaming_campaign_gives_every_trainer_rank_a_simulation_in_every_wave(tmp_path):
    from hpcml.ensemble.campaign import Campaign, TrainingJob
    from hpcml.ensemble.waves import rank_idle

    assert rank_idle([0, 1, 4], 4) and not rank_idle([4, 1, 2, 7], 4) and rank_idle([], 1)
    c = Campaign(run_dir=tmp_path / "run", config=object(), progress=False)
    job = TrainingJob(argv=["train"], nodes=1, ranks=4, stream=True)
    with pytest.raises(ConfigError, match=r"^waves of 2 for a streaming training job of 4 ranks: a wave must give "
                                          r"every trainer rank a simulation .* use wave >= 4$"):
        c.run_adaptive(lambda i, p: None, Halton(BOUNDS), budget=8, wave=2, training=job)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_target_reached_ends_the_plan_for_good(tmp_path):
    from types import SimpleNamespace

    from hpcml.ensemble.spec import SimSpec
    from hpcml.ensemble.waves import Waves

    def make(i, p):
        return SimSpec(sim_id=i, params=p, argv=["true"])

    fb = tmp_path / "feedback.json"
    contract = SimpleNamespace(feedback_file=fb, campaign="c")
    w = Waves(make, Halton(BOUNDS), budget=12, size=4, target=("val_rel_l2", 0.05))
    w.open(tmp_path)
    fb.write_text(json.dumps({"campaign": "c", "step": 5, "params": ["k", "q"], "sims": {},
                              "metrics": {"val_rel_l2": 0.01}}))
    assert [s.sim_id for s in w.propose(contract)] == [0, 1, 2, 3]  # the first wave is never skipped
    fb.write_text(json.dumps({"campaign": "c", "step": 9, "params": ["k", "q"], "sims": {},
                              "metrics": {"val_rel_l2": 0.2, "loss": 0.1}}))
    assert [s.sim_id for s in w.propose(contract)] == [4, 5, 6, 7]  # not reached: the next wave
    fb.write_text(json.dumps({"campaign": "c", "step": 20, "params": ["k", "q"], "sims": {},
                              "metrics": {"val_rel_l2": 0.04}}))
    assert w.propose(contract) == [] and w.plan.done
    assert w.plan.ended == "val_rel_l2 0.04 <= 0.05 at training step 20"
    again = Waves(make, Halton(BOUNDS), budget=12, size=4, target=("val_rel_l2", 0.05))
    assert [s.sim_id for s in again.open(tmp_path)] == list(range(8))
    assert again.plan.done and again.plan.ended == w.plan.ended  # a resumed driver proposes none either
    with pytest.raises(ConfigError, match=r"^target=0\.05: expected \(metric name, value\)"):
        Waves(make, Halton(BOUNDS), budget=12, size=4, target=0.05)
    lines = (tmp_path / WAVES_FILE).read_text().splitlines()
    (tmp_path / WAVES_FILE).write_text("\n".join([lines[0], lines[2], lines[1]]) + "\n")  # an end mid-record
    with pytest.raises(ConfigError, match=r"line 2: not the next wave"):
        WavePlan(tmp_path, Halton(BOUNDS), budget=12, size=4)
