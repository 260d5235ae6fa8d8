"""Issue 25 end to end: a Campaign runs its simulations in waves, each asked of the sampler
with the trainer's feedback. Real Parsl, real simulation processes, a real training process
-- all of them a user's own (scripts written into tmp_path, not hpcml's kernels or trainer):
the trainer reports a high loss wherever q > 0.5, and the later waves go there. A driver
killed between waves and run again with resume runs the recorded waves as they were, every
simulation completed exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

parsl = pytest.importorskip("parsl")

from hpcml.ensemble.campaign import Campaign, SimSpec, TrainingJob  # noqa: E402
from hpcml.ensemble.breed import Breed  # noqa: E402
from hpcml.ensemble.sampling import Halton  # noqa: E402
from hpcml.errors import ConfigError  # noqa: E402

SIM = textwrap.dedent("""
    import argparse, json, time
    p = argparse.ArgumentParser()
    p.add_argument("--sim-id", type=int, required=True)
    p.add_argument("--params-json", required=True)
    a = p.parse_args()
    time.sleep(0.3)
    print("HPCML_SIM_RESULT " + json.dumps({"params": json.loads(a.params_json)}), flush=True)
""")

# The user's trainer: for every simulation whose spec is in the run directory, a loss that is
# high where q > 0.5 (where its surrogate would be wrong), published as hpcml's trainer does.
TRAINER = textwrap.dedent("""
    import glob, json, os, time
    run_dir, campaign, run = os.environ["HPCML_RUN_DIR"], os.environ["HPCML_CAMPAIGN_ID"], os.environ["HPCML_RUN_ID"]
    done, step = os.environ["HPCML_SIMS_DONE_FILE"], 0
    while not os.path.exists(done):
        sims = {}
        for path in glob.glob(os.path.join(run_dir, "sims", "sim_*", "spec.json")):
            spec = json.load(open(path))
            p = spec["params"]
            sims[str(spec["sim_id"])] = {"params": [p["k"], p["q"]], "loss": 5.0 if p["q"] > 0.5 else 0.1,
                                         "samples": 3, "age": 0}
        step += 1
        tmp = os.path.join(run_dir, ".feedback.tmp")
        metrics = {"val_rel_l2": 1.0 / max(1, len(sims)), "loss": 0.5}  # better with every simulation
        json.dump({"campaign": campaign, "run": run, "step": step, "params": ["k", "q"], "sims": sims,
                   "metrics": metrics}, open(tmp, "w"))
        os.replace(tmp, os.path.join(run_dir, "feedback.json"))
        time.sleep(0.1)
""")

DRIVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from test_active_learning import campaign_run
    campaign_run(sys.argv[1], resume=sys.argv[3] == "resume")
""")

BOUNDS = {"k": (0.1, 10.0), "q": (-1.0, 1.0)}


def _make(tmp: Path):
    script = tmp / "sim.py"
    script.write_text(SIM)

    def make(sim_id: int, params: dict) -> SimSpec:
        return SimSpec(sim_id=sim_id, params=params, argv=[sys.executable, str(script)], ranks=1)
    return make


def campaign_run(run_dir: str, resume: bool = False, target=None, fixed=()):
    run_dir = Path(run_dir)
    tmp = run_dir.parent
    (tmp / "trainer.py").write_text(TRAINER)
    sampler = Breed(bounds=BOUNDS, seed=3, log={"k"}, r_start=0.0, r_end=0.75, ramp_waves=1, sigma=0.02,
                    parents=0.3)
    c = Campaign(run_dir=run_dir, config=lambda: parsl.Config(
        executors=[parsl.ThreadPoolExecutor(label="sims", max_threads=4)], retries=0),
        sim_launch="", max_concurrent=4, progress=False)
    return c.run_adaptive(_make(tmp), sampler, budget=12, wave=4, wave_trigger=1.0, resume=resume, target=target,
                          sims=fixed, training=TrainingJob(argv=[sys.executable, str(tmp / "trainer.py")], stream=False,
                                               nodes=1))


def _waves(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "waves.jsonl").read_text().splitlines()]


def _completed_once(run_dir: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in (run_dir / "provenance.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["status"] == "ok":
            counts[r["sim_id"]] = counts.get(r["sim_id"], 0) + 1
    return counts


def test_waves_follow_the_trainers_feedback(tmp_path):
    run_dir = tmp_path / "run"
    res = campaign_run(str(run_dir))
    assert res.ok and sorted(res.completed) == list(range(12)), res
    waves = _waves(run_dir)
    assert [w["ids"] for w in waves] == [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    assert waves[0]["feedback_sims"] == 0 and waves[2]["feedback_sims"] >= 4  # the later waves saw the trainer
    assert waves[0]["params"] == Halton(BOUNDS, seed=3, log={"k"}).propose(4, {})  # no feedback yet: the base
    static = sum(p["q"] > 0.5 for p in Halton(BOUNDS, seed=3, log={"k"}).propose(12, {})[4:])
    later = sum(p["q"] > 0.5 for w in waves[1:] for p in w["params"])
    assert static == 1 and later >= 4, later  # 5 of the 8 bred around parents with q > 0.5
    assert _completed_once(run_dir) == {i: 1 for i in range(12)}
    assert json.loads((run_dir / "campaign_id.json").read_text())["simulations"]["adaptive"] is True
    png = (run_dir / "waves.png").read_bytes()  # where the sampler went, coloured by wave and by loss
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_a_driver_killed_between_waves_resumes_the_same_waves(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    p = subprocess.Popen([sys.executable, str(driver), str(run_dir), str(Path(__file__).parent), "new"], env=env,
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (run_dir / "waves.jsonl").exists() or len(_waves(run_dir)) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the driver, its trainer and its simulations
    p.wait()
    before = _waves(run_dir)
    assert len(before) == 2
    res = campaign_run(str(run_dir), resume=True)
    assert res.ok and sorted(set(res.completed) | set(res.skipped)) == list(range(12)), res
    after = _waves(run_dir)
    assert after[:2] == before and len(after) == 3
    assert _completed_once(run_dir) == {i: 1 for i in range(12)}
    assert len(res.skipped) >= 1  # what completed before the kill was not run again


def test_a_target_error_reached_ends_the_campaign_early(tmp_path):
    """The user's trainer reports a held-out error of 1 / (simulations it knows): with a
    target of 0.15 the third wave is never proposed (8 simulations give 0.125); the eight
    finish, the trainer gets its done record, and the campaign ends ok."""
    run_dir = tmp_path / "run"
    res = campaign_run(str(run_dir), target=("val_rel_l2", 0.15))
    assert res.ok and sorted(res.completed) == list(range(8)) and res.total == 8, res
    lines = [json.loads(line) for line in (run_dir / "waves.jsonl").read_text().splitlines()]
    assert [w.get("wave") for w in lines[:2]] == [0, 1]
    assert lines[2]["end"].startswith("val_rel_l2 0.125 <= 0.15 at training step ") and lines[2]["proposed"] == 8
    assert sorted(json.loads((run_dir / "sims_done.json").read_text())["completed"]) == list(range(8))


def test_fixed_simulations_run_besides_the_waves(tmp_path):
    """Held-out simulations (a fixed design, ids from the budget up) run once beside the waves
    and are part of the campaign's definition: a resume with other ones is refused, and ids
    that collide with the waves' are refused before anything is written."""
    run_dir, make = tmp_path / "run", _make(tmp_path)
    held = [make(12 + i, {"k": 1.0, "q": q}) for i, q in enumerate((-0.5, 0.5))]
    res = campaign_run(str(run_dir), fixed=held)
    assert res.ok and sorted(res.completed) == list(range(14)) and res.total == 14, res
    assert [w["ids"] for w in _waves(run_dir)] == [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    assert _completed_once(run_dir) == {i: 1 for i in range(14)}
    assert json.loads((run_dir / "sims" / "sim_00013" / "spec.json").read_text())["params"] == {"k": 1.0, "q": 0.5}
    defined = json.loads((run_dir / "campaign_id.json").read_text())["simulations"]
    assert (defined["count"], defined["adaptive"]) == (14, True)
    with pytest.raises(ConfigError, match=r"defined with other simulations \(14 adaptive simulations, digest "
                                          r"\w+; given 13 adaptive simulations"):
        campaign_run(str(run_dir), resume=True, fixed=held[:1])
    with pytest.raises(ConfigError, match=r"^fixed simulation id\(s\) \[3\] of run_adaptive's sims collide with the "
                                          r"waves' ids 0 to 11: expected ids >= budget=12$"):
        campaign_run(str(tmp_path / "other"), fixed=[make(3, {"k": 1.0, "q": 0.0})])
    assert not (tmp_path / "other").exists()
    res = campaign_run(str(run_dir), resume=True, fixed=held)  # unchanged: nothing runs again
    assert res.ok and sorted(res.skipped) == list(range(14)) and _completed_once(run_dir) == {i: 1 for i in range(14)}


class WorstNeighbour:
    """A user's own sampler, not hpcml's: the first wave on a diagonal, then each new point a
    step away from the simulation with the highest reported loss (its own RNG, its own state)."""

    def __init__(self, seed: int = 0):
        import random

        self.seed, self.calls, self.random = seed, 0, random.Random(seed)

    def propose(self, n, feedback):
        self.calls += 1
        if not feedback:
            return [{"k": 0.1 + 9.9 * (i + 0.5) / n, "q": -1.0 + 2.0 * (i + 0.5) / n} for i in range(n)]
        worst = max(feedback.values(), key=lambda s: (s.loss, s.params["q"]))
        out = []
        for _ in range(n):
            k = min(10.0, max(0.1, worst.params["k"] * (1 + 0.2 * self.random.uniform(-1, 1))))
            q = min(1.0, max(-1.0, worst.params["q"] + 0.05 * self.random.uniform(-1, 1)))
            out.append({"k": k, "q": q})
        return out

    def state_dict(self):
        return {"seed": self.seed, "calls": self.calls, "random": repr(self.random.getstate())}

    def load_state_dict(self, state):
        import ast

        self.seed, self.calls = state["seed"], state["calls"]
        self.random.setstate(ast.literal_eval(state["random"]))


def test_a_users_own_sampler_runs_adaptively(tmp_path):
    """The same campaign with a sampler of the user's own: after the first wave every point is
    near the worst simulation the trainer reported (q > 0.5), and the record holds its state."""
    (tmp_path / "trainer.py").write_text(TRAINER)
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, config=lambda: parsl.Config(
        executors=[parsl.ThreadPoolExecutor(label="sims", max_threads=4)], retries=0),
        sim_launch="", max_concurrent=4, progress=False)
    res = c.run_adaptive(_make(tmp_path), WorstNeighbour(seed=5), budget=8, wave=4, wave_trigger=1.0,
                         training=TrainingJob(argv=[sys.executable, str(tmp_path / "trainer.py")], stream=False,
                                              nodes=1))
    assert res.ok and sorted(res.completed) == list(range(8)), res
    waves = _waves(run_dir)
    assert waves[0]["params"][3]["q"] == pytest.approx(0.75) and waves[1]["sampler"]["calls"] == 2
    assert all(p["q"] > 0.65 for p in waves[1]["params"]), waves[1]["params"]  # around the worst: q = 0.75
