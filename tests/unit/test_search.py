"""Issue 45, item 4: what a search decides, with nothing launched (hpcml.ensemble.asha), and
what its driver reads and refuses (hpcml.ensemble.search) -- the run with Parsl and MPI is
tests/workflows/test_search.py."""

from __future__ import annotations

import json
import math
import random

import pytest

from hpcml.ensemble import Search, SearchConfig, SearchError
from hpcml.ensemble.asha import Asha, configurations
from hpcml.errors import ConfigError

SPACE = {"lr": [1e-4, 3e-4, 1e-3, 3e-3], "wd": [0.0, 0.1]}


def test_rungs_grow_by_eta_and_end_at_max_steps():
    assert SearchConfig(space=SPACE, min_steps=4, max_steps=36, eta=3).rungs == [4, 12, 36]
    assert SearchConfig(space=SPACE, min_steps=4, max_steps=50, eta=3).rungs == [4, 12, 36, 50]
    assert SearchConfig(space=SPACE, min_steps=5, max_steps=5, eta=2).rungs == [5]
    assert SearchConfig(space=SPACE, method="grid", min_steps=4, max_steps=36).rungs == [36]
    assert SearchConfig(space=SPACE, method="random", trials=3, min_steps=4, max_steps=36).rungs == [36]


def test_configurations_are_the_grid_or_seeded_draws_within_their_ranges():
    grid = configurations(SearchConfig(space=SPACE))
    assert len(grid) == 8 and grid[0] == {"lr": 1e-4, "wd": 0.0} and grid[-1] == {"lr": 3e-3, "wd": 0.1}
    space = {"lr": {"low": 1e-5, "high": 1e-2, "log": True}, "layers": {"low": 2, "high": 8, "int": True},
             "opt": ["adam", "sgd"]}
    a = configurations(SearchConfig(space=space, method="random", trials=200, seed=7))
    assert a == configurations(SearchConfig(space=space, method="random", trials=200, seed=7))
    assert a != configurations(SearchConfig(space=space, method="random", trials=200, seed=8))
    assert all(1e-5 <= c["lr"] <= 1e-2 and 2 <= c["layers"] <= 8 and isinstance(c["layers"], int) for c in a)
    assert {c["opt"] for c in a} == {"adam", "sgd"}
    below = sum(c["lr"] < 3.2e-4 for c in a)  # log-uniform: half the draws below the geometric middle
    assert 70 < below < 130


@pytest.mark.parametrize("kw,says", [
    (dict(method="hyperband"), "method='hyperband': expected one of asha, grid, random"),
    (dict(mode="lowest"), "mode='lowest': expected 'min' or 'max'"),
    (dict(space={}), "space={}: expected a dict"),
    (dict(space={"lr": []}), "space['lr']=[]: expected a non-empty list"),
    (dict(space={"lr": "0.1"}), "space['lr']='0.1': expected a non-empty list"),
    (dict(space={"lr": [float("nan")]}), "space['lr']: value nan must be a finite number"),
    (dict(space={"my-lr": [1]}), "space: name 'my-lr' must be an identifier"),
    (dict(space={"lr": {"low": 1, "high": 1}}), "expected {'low': a, 'high': b} with finite a < b"),
    (dict(space={"lr": {"low": 0, "high": 1, "log": True}}), "log=True needs low > 0, got 0"),
    (dict(space={"lr": {"low": 0.1, "high": 1}}), "trials=None takes the whole grid, but lr is a range"),
    (dict(space={"lr": {"low": 0.1, "high": 1}}, method="grid", trials=4), "method='grid' needs lists"),
    (dict(min_steps=10, max_steps=5), "min_steps=10 > max_steps=5"),
    (dict(min_steps=True), "min_steps=True: expected an int >= 1"),
    (dict(eta=1), "eta=1: ASHA keeps the top 1/eta of a rung, so eta must be >= 2"),
    (dict(trials=0), "trials=0: expected an int >= 1 or None"),
    (dict(metric=""), "metric='': expected the name"),
])
def test_a_wrong_config_is_one_line_naming_the_value(kw, says):
    with pytest.raises(ConfigError) as e:
        SearchConfig(**{"space": SPACE, **kw})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_grid_with_a_trial_count_that_is_not_its_size_is_refused():
    with pytest.raises(ConfigError, match="method='grid': trials=3 but the grid has 8 points"):
        configurations(SearchConfig(space=SPACE, method="grid", trials=3))


def _simulate(cfg: SearchConfig, loss, at_once: int, seed: int = 0) -> Asha:
    """Run ASHA's decisions with ``at_once`` jobs in flight ending in a random order."""
    n = len(configurations(cfg))
    state, rng, running = Asha(cfg, n), random.Random(seed), []
    while True:
        while len(running) < at_once and (job := state.next_job()) is not None:
            state.start(*job)
            running.append(job)
        if not running:
            return state
        t, rung = running.pop(rng.randrange(len(running)))
        state.report(t, rung, loss(t, cfg.rungs[rung]))


def test_asha_halves_each_rung_finds_the_best_and_saves_most_of_the_grids_steps():
    """A landscape where trial t's final loss is its rank among 81 trials and early losses
    predict it with noise: synchronous-like (1 at a time) and asynchronous (8 in flight)."""
    cfg = SearchConfig(space={"i": list(range(81))}, min_steps=1, max_steps=81, eta=3, seed=0)
    final = {t: (t * 37) % 81 for t in range(81)}  # 0 is best: trial 0
    noise = random.Random(5)
    jitter = {(t, s): noise.gauss(0, 1.0) * 8 / s for t in range(81) for s in cfg.rungs}

    def loss(t: int, steps: int) -> float:
        return final[t] + jitter[(t, steps)]

    for at_once in (1, 8):
        state = _simulate(cfg, loss, at_once)
        counts = [len(s) for s in state.scores]
        assert counts[0] == 81 and all(a >= b for a, b in zip(counts, counts[1:])) and counts[-1] >= 1, counts
        assert counts[1] < 81 // 2  # promotions on partial results take a few more than a third
        best, rung = state.best()
        assert rung == len(cfg.rungs) - 1 and final[best] <= 1, (best, final[best])
        used = state.trial_steps()
        assert used == sum(max(cfg.rungs[r] for r in range(5) if t in state.scores[r]) for t in range(81))
        assert 1 - used / (81 * 81) >= 0.8, used


def test_a_diverged_trial_is_never_promoted_and_a_failed_one_never_again():
    cfg = SearchConfig(space={"i": list(range(6))}, min_steps=1, max_steps=4, eta=2)
    state = Asha(cfg, 6)
    for t in range(6):
        state.start(t, 0)
    state.report(0, 0, math.nan)
    state.report(1, 0, 5.0)
    state.fail(2, 0, "exit 1")
    for t, v in ((3, 4.0), (4, 3.0), (5, 9.0)):
        state.report(t, 0, v)
    promoted = []
    while (job := state.next_job()) is not None:
        state.start(*job)
        promoted.append(job)
    assert promoted == [(4, 1), (3, 1)] and state.ranked(0)[-1] == 0  # the top 2 of 5 scored; NaN last
    state.report(4, 1, 1.0)
    state.report(3, 1, 2.0)
    assert state.next_job() == (4, 2)
    state.start(4, 2)
    assert state.next_job() is None and not state.finished
    state.report(4, 2, 0.5)
    assert state.finished and state.best() == (4, 2) and 2 in state.failed


def test_mode_max_ranks_the_largest_first():
    cfg = SearchConfig(space={"i": [0, 1, 2, 3]}, min_steps=1, max_steps=2, eta=2, mode="max", metric="acc")
    state = Asha(cfg, 4)
    for t, v in enumerate((0.1, 0.9, 0.5, 0.7)):
        state.report(t, 0, v)
    assert state.ranked(0) == [1, 3, 2, 0] and state.next_job() == (1, 1)


def _search(tmp_path, **kw):
    argv = ["python", "train.py", "--lr", "{lr}", "--steps", "{steps}", "--run-dir", "{trial_dir}"]
    return Search(**{"config": SearchConfig(space=SPACE, min_steps=2, max_steps=8, eta=2, metric="loss"),
                     "argv": argv, "run_dir": tmp_path / "run", **kw})


def test_the_command_fills_every_placeholder_and_a_wrong_one_is_refused(tmp_path):
    s = _search(tmp_path)
    assert s.command(3, 1) == ["python", "train.py", "--lr", "0.0003", "--steps", "4", "--run-dir",
                               str(tmp_path / "run" / "trials" / "trial_0003")]
    spec = s.spec(3, 1)
    assert spec.command() == s.command(3, 1) and spec.sim_id == 3 * 3 + 1 and spec.stream is False
    with pytest.raises(ConfigError, match=r"argv names \{lrate\}: the placeholders are \{steps\}"):
        _search(tmp_path, argv=["train.py", "--lr", "{lrate}", "--steps", "{steps}"])
    with pytest.raises(ConfigError, match="argv has no {steps}"):
        _search(tmp_path, argv=["train.py", "--lr", "{lr}"])
    with pytest.raises(ConfigError, match="max_concurrent=0: expected an int >= 1"):
        _search(tmp_path, max_concurrent=0)
    with pytest.raises(ConfigError, match="argv must be a non-empty list of strings"):
        _search(tmp_path, argv="train.py --steps {steps}")
    with pytest.raises(ConfigError, match="nosuchsite"):
        _search(tmp_path, site="nosuchsite")
    assert not (tmp_path / "run").exists()  # nothing created by a refused search


def test_trials_of_different_layouts_run_on_their_own_ranks(tmp_path):
    """``ranks="{ranks}"``: a search over layouts, each trial's jobs on the ranks its
    configuration names (and its degrees through argv); the site sized for the largest."""
    argv = ["python", "train.py", "--tp", "{tp}", "--steps", "{steps}", "--run-dir", "{trial_dir}"]
    cfg = SearchConfig(space={"ranks": [2, 4], "tp": [1, 2]}, min_steps=2, max_steps=8, eta=2, metric="loss")
    s = Search(config=cfg, argv=argv, run_dir=tmp_path / "run", ranks="{ranks}")
    got = {(t["ranks"], t["tp"]): (s.spec(i, 0).ranks, s.spec(i, 2).command()[3]) for i, t in enumerate(s.trials)}
    assert got == {(r, tp): (r, str(tp)) for r in (2, 4) for tp in (1, 2)}
    assert max(s.trial_ranks(i) for i in range(len(s.trials))) == 4
    for ranks, message in (("{nope}", r"ranks='\{nope\}': the space has no 'nope' \(it has \['ranks', 'tp'\]\)"),
                           ("{tp}x", r"ranks='\{tp\}x': expected an int >= 1 or '\{name\}' of a hyperparameter"),
                           (0, "ranks=0: expected an int >= 1")):
        with pytest.raises(ConfigError, match=message):
            Search(config=cfg, argv=argv, run_dir=tmp_path / "run", ranks=ranks)
    odd = SearchConfig(space={"ranks": [2, 2.5], "tp": [1]}, min_steps=2, max_steps=8, eta=2, metric="loss")
    with pytest.raises(ConfigError, match=r"ranks='\{ranks\}': its values 2.5 are not whole numbers >= 1"):
        Search(config=odd, argv=argv, run_dir=tmp_path / "run", ranks="{ranks}")
    assert not (tmp_path / "run").exists()


def test_the_score_is_the_metric_at_the_rungs_last_step_of_an_untrusted_file(tmp_path):
    s = _search(tmp_path)
    d = s.trial_dir(1)
    d.mkdir(parents=True)
    lines = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 5.0}, {"step": 2, "lr": 1.0}, {"step": 3, "loss": 1.0}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 2, "lo')
    assert s.score(1, 0) == 5.0  # rung 0 = 2 steps; the torn last line passed over
    with (d / "metrics.jsonl").open("a") as f:
        f.write('\n{"step": 2, "loss": NaN}\n' + "x" * 100_000 + "\n")  # a diverged retry; a huge line skipped
    assert math.isnan(s.score(1, 0))
    with pytest.raises(SearchError, match=r"trial 1 \(\{'lr': 0.0001, 'wd': 0.1\}\) ended rung 1 without a 'loss' "
                                          r"at step 4 in .*metrics.jsonl: its program must write that metric"):
        s.score(1, 1)
    (tmp_path / "outside.jsonl").write_text(json.dumps({"step": 2, "loss": 0.0}) + "\n")
    other = s.trial_dir(2)
    other.mkdir()
    (other / "metrics.jsonl").symlink_to(tmp_path / "outside.jsonl")
    with pytest.raises(ConfigError):  # never read through a link
        s.score(2, 0)
    (tmp_path / "elsewhere").mkdir()
    s.trial_dir(3).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="trial_0003 is a symbolic link, not a directory of the search"):
        s._make_trial_dir(3)  # its checkpoints would go elsewhere
    s._make_trial_dir(4)
    assert s.trial_dir(4).is_dir() and not s.trial_dir(4).is_symlink()


def test_a_trial_whose_program_did_not_resume_is_named(tmp_path):
    s = _search(tmp_path)
    d = s.trial_dir(0)
    d.mkdir(parents=True)
    steps = [1, 2, 1, 2, 3, 4]  # rung 0 (2 steps), then rung 1 from scratch
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "loss": 1.0 / k}) + "\n" for k in steps))
    assert s.score(0, 1) == 0.25 and s.restarted == [0]
    resumed = s.trial_dir(1)
    resumed.mkdir()
    steps = (1, 1, 2, 3, 4)
    (resumed / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "loss": 1.0}) + "\n" for k in steps))
    assert s.score(1, 1) == 1.0 and s.restarted == [0]  # killed in rung 0 before its end: a restart is no loss


def test_a_tampered_record_or_a_changed_search_is_refused_on_resume(tmp_path):
    s = _search(tmp_path)
    s.run_dir.mkdir()
    s._check_definition()
    s._record({"trial": 1, "rung": 0, "status": "ok", "score": 2.5, "steps": 2})
    s._record({"trial": 2, "rung": 0, "status": "failed", "why": "exit 1"})
    recs = s._recorded()
    assert [(r["trial"], r["status"]) for r in recs] == [(1, "ok"), (2, "failed")] and recs[0]["score"] == 2.5
    for bad in ({"trial": 99, "rung": 0, "status": "ok", "score": 1.0}, {"trial": 1, "rung": 7, "status": "ok"},
                {"trial": True, "rung": 0, "status": "ok", "score": 1}, {"trial": 1, "rung": 0, "status": "ok",
                                                                        "score": "low"}):
        (s.run_dir / "search.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(ConfigError, match="is not a search record of this search"):
            s._recorded()
    other = _search(tmp_path, config=SearchConfig(space=SPACE, min_steps=2, max_steps=16, eta=2, metric="loss"))
    with pytest.raises(ConfigError, match=r"holds a search defined otherwise \(max_steps differ\)"):
        other._check_definition()
