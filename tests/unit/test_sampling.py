"""Samplers of the next simulations (issue 25): static designs continued across waves, the
Breed-style adaptive sampler, resuming from a state dict, a user's own sampler, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcml.ensemble import sampling
from hpcml.ensemble.breed import Breed
from hpcml.ensemble.sampling import FullFactorial, Halton, LatinHypercube, SimStats, Sobol
from hpcml.errors import ConfigError

BOUNDS = {"k": (0.1, 10.0), "q": (-1.0, 1.0)}


def _inside(points, bounds=BOUNDS):
    return all(bounds[k][0] <= p[k] <= bounds[k][1] for p in points for k in bounds)


@pytest.mark.parametrize("cls", [Halton, Sobol])
def test_a_sequence_continues_across_waves_and_after_a_restart(cls):
    whole = cls(BOUNDS, seed=3, log={"k"}).propose(12, {})
    s = cls(BOUNDS, seed=3, log={"k"})
    first = s.propose(5, {})
    state = json.loads(json.dumps(s.state_dict()))  # what the campaign checkpoints
    again = cls(BOUNDS, seed=3, log={"k"})
    again.load_state_dict(state)
    assert first + again.propose(7, {}) == whole
    assert _inside(whole) and len({(p["k"], p["q"]) for p in whole}) == 12
    # log-uniform k: about half the points below the geometric middle 1.0
    many = cls(BOUNDS, seed=0, log={"k"}).propose(256, {})
    assert 0.4 < np.mean([p["k"] < 1.0 for p in many]) < 0.6


def test_halton_fills_the_space_better_than_random():
    pts = Halton({"a": (0, 1), "b": (0, 1)}, seed=1).propose(64, {})
    cells = {(int(p["a"] * 8), int(p["b"] * 8)) for p in pts}
    assert len(cells) >= 48  # uniform random leaves ~ 64 * (1 - 1/e) = 40 of the 64 cells


def test_latin_hypercube_per_wave_is_stratified_and_reproducible():
    s = LatinHypercube(BOUNDS, seed=2)
    w0, w1 = s.propose(10, {}), s.propose(10, {})
    assert w0 != w1
    for wave in (w0, w1):  # one point per tenth of q
        assert sorted(int((p["q"] + 1) / 2 * 10) for p in wave) == list(range(10))
    r = LatinHypercube(BOUNDS, seed=2)
    r.load_state_dict({"kind": "latin_hypercube", "seed": 2, "wave": 1})
    assert r.propose(10, {}) == w1


def test_full_factorial_is_handed_out_in_order_then_refuses():
    s = FullFactorial(BOUNDS, {"k": 2, "q": 3})
    got = s.propose(4, {}) + s.propose(2, {})
    assert [(p["k"], p["q"]) for p in got] == [(0.1, -1.0), (0.1, 0.0), (0.1, 1.0), (10.0, -1.0), (10.0, 0.0),
                                              (10.0, 1.0)]
    with pytest.raises(ConfigError, match=r"^full_factorial: 1 points asked, 0 of 6 left$"):
        s.propose(1, {})


def _feedback(points, loss):
    return {f"sim_{i:04d}": SimStats(params=p, loss=loss(p), samples=10) for i, p in enumerate(points)}


@pytest.mark.parametrize("spread, share", [(1, (0.70, 0.85)), (16, (0.35, 0.50))])
def test_breed_draws_its_share_around_the_high_loss_parents_inside_the_bounds(spread, share):
    """One corner of the space is hard (loss 10 within 0.15 of (k=10, q=1)); once R has
    ramped to 0.75, Melissa's plain draw puts three quarters of a wave there, none outside
    the bounds, and none piled onto the faces (a clipped Gaussian would put half of them
    there). With spread=16 the corner fills up to the spacing of the rest of the top 20%'s
    neighbourhoods, and the rest of its children go there: ~40%, against the base design's 1%."""
    bounds = {"a": (0.0, 1.0), "b": (0.0, 1.0)}
    hard = lambda p: 10.0 if (1 - p["a"]) ** 2 + (1 - p["b"]) ** 2 < 0.15 ** 2 else 0.1  # noqa: E731
    s = Breed(bounds=bounds, seed=5, r_start=0.0, r_end=0.75, ramp_waves=2, sigma=0.05, parents=0.2,
              spread=spread)
    seen = Halton(bounds, seed=99).propose(200, {})
    seen += [{"a": 0.97, "b": 0.95}, {"a": 0.93, "b": 0.99}]
    fb = _feedback(seen, hard)
    ratios = []
    for wave in range(3):
        pts = s.propose(400, fb)
        ratios.append(s.last["r"])
        assert len(pts) == 400 and _inside(pts, bounds)
    assert ratios == [0.0, 0.375, 0.75]
    near = [p for p in pts if (1 - p["a"]) ** 2 + (1 - p["b"]) ** 2 < 0.25 ** 2]
    assert share[0] <= len(near) / 400 <= share[1], len(near)  # 300 bred + the base design's share of the corner
    on_face = [p for p in pts if p["a"] == 1.0 or p["b"] == 1.0]
    assert on_face == []


def test_breed_spreads_its_children_over_the_hard_region_instead_of_piling_them_on_its_parents():
    """The hard region is a band (b < 0.1) that the first 40 simulations touch at 4 points.
    Melissa's plain draw (spread=1) puts each child next to one of those 4; spread=16 keeps
    the same parents but takes the draw farthest from every simulation so far, so the
    children cover the band: their distance to the nearest other simulation is half as large
    again, and they fill more of its tenths along a."""
    bounds = {"a": (0.0, 1.0), "b": (0.0, 1.0)}
    seen = Halton(bounds, seed=3).propose(40, {})
    fb = _feedback(seen, lambda p: 10.0 if p["b"] < 0.1 else 0.1)
    assert sum(p["b"] < 0.1 for p in seen) == 4
    out = {}
    for spread in (1, 16):
        s = Breed(bounds=bounds, seed=2, r_end=1.0, ramp_waves=0, sigma=0.1, parents=0.1, spread=spread)
        kids = np.array([[p["a"], p["b"]] for p in s.propose(24, fb)])
        everything = np.concatenate([np.array([[p["a"], p["b"]] for p in seen]), kids])
        d = np.linalg.norm(kids[:, None] - everything[None], axis=2)
        d[np.arange(len(kids)), len(seen) + np.arange(len(kids))] = np.inf  # not itself
        out[spread] = (float(d.min(axis=1).mean()), len({int(a * 10) for a, b in kids if b < 0.2}),
                       float(np.mean(kids[:, 1] < 0.25)))
    (plain_gap, plain_cells, plain_in), (gap, cells, inside) = out[1], out[16]
    assert gap > 1.3 * plain_gap, out  # 1.5x
    assert cells > plain_cells, out
    assert inside >= 0.8 and plain_in >= 0.8, out  # both stay on the band


def test_breed_without_usable_feedback_is_its_base_design():
    s = Breed(bounds=BOUNDS, seed=4, r_start=0.5)
    assert s.propose(8, {}) == Halton(BOUNDS, seed=4).propose(8, {})
    nan = {"s0": SimStats(params={"k": 1.0, "q": 0.0}, loss=float("nan"))}
    assert s.propose(8, nan) == Halton(BOUNDS, seed=4).propose(16, {})[8:]
    assert s.last == {"wave": 1, "r": 0.0, "bred": 0, "parents": 0}


def test_a_resumed_breed_proposes_the_same_wave():
    fb = _feedback(Halton(BOUNDS, seed=7).propose(30, {}), lambda p: abs(p["q"]) * p["k"])
    s = Breed(bounds=BOUNDS, seed=1, ramp_waves=1, log={"k"})
    s.propose(10, fb)
    state = json.loads(json.dumps(s.state_dict()))
    want = s.propose(10, fb)
    r = Breed(bounds=BOUNDS, seed=1, ramp_waves=1, log={"k"})
    r.load_state_dict(state)
    assert r.propose(10, fb) == want
    r.load_state_dict(state)  # the order the feedback comes in does not matter
    assert r.propose(10, dict(reversed(list(fb.items())))) == want


class EdgeSampler:
    """A user's own sampler: the midpoint of q's upper half, k from a list, nothing else."""

    def __init__(self):
        self.i = 0

    def propose(self, n, feedback):
        out = [{"k": 1.0 + (self.i + j) % 3, "q": 0.5} for j in range(n)]
        self.i += n
        return out

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def test_a_users_sampler_is_a_sampler_and_can_be_breeds_base():
    assert isinstance(EdgeSampler(), sampling.Sampler)
    assert not isinstance(object(), sampling.Sampler)
    s = Breed(bounds=BOUNDS, base=EdgeSampler(), r_start=0.0, ramp_waves=4)
    assert s.propose(3, {}) == [{"k": 1.0, "q": 0.5}, {"k": 2.0, "q": 0.5}, {"k": 3.0, "q": 0.5}]
    assert s.state_dict() == {"kind": "breed", "seed": 0, "wave": 1, "base": {"i": 3}}


@pytest.mark.parametrize("make,says", [
    (lambda: Breed(bounds=BOUNDS, r_end=1.5), r"^Breed\.r_end=1\.5: expected a fraction in \[0, 1\]$"),
    (lambda: Breed(bounds=BOUNDS, sigma=0), r"^Breed\.sigma=0: expected a width in \(0, 1\] of each axis$"),
    (lambda: Breed(bounds=BOUNDS, parents=0.0), r"^Breed\.parents=0\.0: expected a fraction in \(0, 1\]$"),
    (lambda: Breed(bounds=BOUNDS, ramp_waves=-1), r"^Breed\.ramp_waves=-1: expected an integer >= 0$"),
    (lambda: Breed(bounds=BOUNDS, base=object()), r"^Breed\.base=<object object at .*>: expected a Sampler"),
    (lambda: Breed(bounds={"k": (1, 1)}), r"^bounds\['k'\]: lo 1\.0 must be < hi 1\.0$"),
    (lambda: Halton(BOUNDS).propose(-1, {}), r"^propose\(n=-1\): expected an integer >= 0$"),
    (lambda: Halton(BOUNDS, seed=1).load_state_dict({"kind": "halton", "seed": 2, "drawn": 3}),
     r"^halton\.load_state_dict: the state was drawn with seed 2, this sampler has seed 1$"),
    (lambda: Halton(BOUNDS).load_state_dict({"kind": "sobol", "seed": 0, "drawn": 3}),
     r"^halton\.load_state_dict: expected \{'kind': 'halton', drawn, seed\}"),
    (lambda: Breed(bounds=BOUNDS).propose(2, {"s": SimStats(params={"k": 1.0}, loss=1.0)}),
     r"^feedback\['s'\] lacks the parameters \['q'\] of the bounds$"),
    (lambda: Breed(bounds=BOUNDS).propose(2, {"s": {"k": 1.0, "q": 0.0}}),
     r"^feedback\['s'\] is a dict, expected SimStats$"),
    (lambda: SimStats(params={}, loss="high"), r"^SimStats\.loss='high': expected a number"),
    (lambda: sampling.static("random", BOUNDS), r"^sampler 'random' unknown: expected one of halton, sobol"),
])
def test_bad_input_is_one_line_naming_the_value(make, says):
    with pytest.raises(ConfigError, match=says):
        make()


def _fb(tmp_path, rec):
    p = tmp_path / "feedback.json"
    p.write_text(json.dumps(rec))
    return p


def test_read_feedback_gives_sim_stats_and_refuses_what_does_not_fit(tmp_path):
    from hpcml.ensemble.waves import read_feedback

    assert read_feedback(tmp_path / "none.json") == (0, {})  # the trainer has not published yet
    good = {"campaign": "c", "run": "r", "step": 30, "params": ["k", "q"],
            "sims": {"3": {"params": [1.0, 0.5], "loss": 0.25, "samples": 12, "age": 4},
                     "7": {"params": [2.0, -0.5], "loss": None, "samples": 2, "age": None}}}
    step, sims = read_feedback(_fb(tmp_path, good), campaign="c", run="r")
    assert step == 30 and sims["3"] == SimStats(params={"k": 1.0, "q": 0.5}, loss=0.25, samples=12, age=4)
    assert sims["7"].loss != sims["7"].loss and sims["7"].age == 0  # never evaluated: NaN, not a parent
    s = Breed(bounds=BOUNDS, r_start=1.0, r_end=1.0, ramp_waves=0, seed=0)
    pts = s.propose(50, sims)  # all bred around sim 3, the only parent
    assert s.last["parents"] == 1 and _inside(pts)
    bad = [
        ({**good, "run": "old"}, r"written for run 'old', this is 'r'$"),
        ({**good, "step": -1}, r"expected \{'step': int, 'params': \[names\], 'sims': \{...\}\}$"),
        ({**good, "sims": {"3": {**good["sims"]["3"], "params": [1.0]}}}, r"simulation '3': ValueError: 1 parameters "
                                                                           r"for 2 names$"),
        ({**good, "sims": {"3": {**good["sims"]["3"], "samples": -2}}}, r"simulation '3': .*SimStats\.samples=-2"),
        ({**good, "sims": {"3": {"loss": 1.0}}}, r"simulation '3': KeyError: 'params'$"),
    ]
    for rec, says in bad:
        with pytest.raises(ConfigError, match=says):
            read_feedback(_fb(tmp_path, rec), campaign="c", run="r")
    big = _fb(tmp_path, {**good, "pad": "x" * 5000})
    with pytest.raises(ConfigError, match="feedback.json"):
        read_feedback(big, max_bytes=4096)  # refused before parsing


def test_feedback_config_is_checked_in_one_line():
    from hpcml.train.feedback import SimFeedback
    from hpcml.train.online import OnlineConfig

    with pytest.raises(ConfigError, match=r"^feedback every=0: expected an integer >= 1"):
        SimFeedback(path=None, every=0, comm=None)
    with pytest.raises(ConfigError, match=r"^OnlineConfig\.feedback_every=0: expected an integer >= 1$"):
        OnlineConfig(feedback_file="f.json", feedback_every=0)
    fb = SimFeedback(path=None, every=5, comm=None, param_names=("k", "q"))
    good = {"params": [1.0, 0.5], "loss": 0.2, "samples": 3, "at": 10}
    fb.load_state({"sims": {"4": good}}, step=10)  # a checkpoint from before fresh losses: none
    good = {**good, "fresh": None, "surprise": None}
    assert fb.sims == {4: good}
    fb.load_state({"sims": {"4": {**good, "fresh": 0.5, "surprise": 2.5}}}, step=10)
    assert fb.sims[4]["fresh"] == 0.5 and fb.sims[4]["surprise"] == 2.5
    fb.load_state({"sims": {"4": good}}, step=10)
    for bad in ({"x": good}, {"4": {**good, "params": [1.0]}}, {"4": {**good, "loss": float("nan")}},
                {"4": {**good, "fresh": -1.0}}, {"4": {**good, "surprise": float("inf")}},
                {"4": {**good, "fresh": "high"}},
                {"4": {**good, "params": [float("inf"), 0.0]}}, {"4": {**good, "samples": -1}},
                {"4": {**good, "at": 11}}, {"4": {"params": [1.0, 0.5]}}):
        with pytest.raises(ConfigError, match=r"^the checkpoint's feedback table does not fit"):
            fb.load_state({"sims": bad}, step=10)
    assert fb.sims == {4: good}  # a refused table changes nothing


class _Losses:
    """A trainer's ``sample_losses`` as the feedback calls it: a fixed loss per simulation."""

    def __init__(self, by_sim):
        self.by_sim, self.calls = by_sim, 0

    def sample_losses(self, batch):
        self.calls += 1
        return [self.by_sim[s.sim] for s in batch]


def test_fresh_loss_is_measured_once_before_a_simulation_is_trained_on():
    """A simulation's first batch is scored before the step trains on it (out of sample), once;
    surprise is that over the last training loss, the batch's own mean at the first step."""
    from mpi4py import MPI

    from hpcml.stream.buffer import Sample
    from hpcml.train.feedback import SimFeedback

    def sample(sim, step=0):
        return Sample(sim, step, 0.0, np.array([float(sim), 0.5], np.float32), np.zeros((1, 2, 2), np.float32))

    fb = SimFeedback(path=None, every=1000, comm=MPI.COMM_SELF, param_names=("k", "q"))
    trainer = _Losses({0: 2.0, 1: 4.0, 2: 9.0})
    first = [sample(0), sample(0, 1), sample(1)]
    assert fb.novel(first)
    fb.fresh(trainer, first)  # the first step: the reference is this batch's mean loss, 8/3
    fb.step(trainer, first, 1)
    assert (fb.sims[0]["fresh"], fb.sims[1]["fresh"]) == (2.0, 4.0)
    assert fb.sims[0]["surprise"] == pytest.approx(2.0 / (8 / 3)) and fb.sims[0]["samples"] == 2
    assert not fb.novel([sample(0), sample(1)])
    fb.metrics["loss"] = 0.5  # the training loss of the step before
    trainer.by_sim[0] = 0.01  # trained on now: its in-sample loss no longer moves its fresh one
    fb.fresh(trainer, [sample(0), sample(2)])
    assert (fb.sims[0]["fresh"], fb.sims[2]["fresh"], fb.sims[2]["surprise"]) == (2.0, 9.0, 18.0)
    fb.publish(2)
    state = fb.state()
    assert state["sims"]["2"]["surprise"] == 18.0 and state["loss"] == 0.5
    again = SimFeedback(path=None, every=1000, comm=MPI.COMM_SELF, param_names=("k", "q"))
    again.load_state(state, step=2)  # a resumed run: the next new simulation's surprise is over the saved loss
    trainer.by_sim[3] = 2.0
    again.fresh(trainer, [sample(3)])
    assert again.sims[3]["surprise"] == 4.0
    with pytest.raises(ConfigError, match=r"does not fit \(ValueError: loss inf: expected a finite number\)"):
        again.load_state({**state, "loss": float("inf")}, step=2)


def test_breed_by_surprise_breeds_around_the_simulations_it_was_most_wrong_about():
    """score="surprise": parents by out-of-sample surprise, not by the in-sample loss (which
    here points the other way); a simulation without one is no parent."""
    bounds = {"k": (0.0, 1.0), "q": (0.0, 1.0)}
    fb = {"0": SimStats(params={"k": 0.1, "q": 0.1}, loss=9.0, surprise=0.5),
          "1": SimStats(params={"k": 0.9, "q": 0.9}, loss=0.1, surprise=6.0),
          "2": SimStats(params={"k": 0.5, "q": 0.5}, loss=5.0)}
    by_surprise = Breed(bounds=bounds, seed=0, r_start=1.0, r_end=1.0, ramp_waves=0, sigma=0.02, parents=0.5,
                        score="surprise")
    assert all(p["k"] > 0.8 and p["q"] > 0.8 for p in by_surprise.propose(6, fb))
    by_loss = Breed(bounds=bounds, seed=0, r_start=1.0, r_end=1.0, ramp_waves=0, sigma=0.02, parents=0.2)
    assert all(p["k"] < 0.2 and p["q"] < 0.2 for p in by_loss.propose(6, fb))
    with pytest.raises(ConfigError, match=r"^Breed\.score='fresh': expected 'loss' or 'surprise'$"):
        Breed(bounds=bounds, score="fresh")
    with pytest.raises(ConfigError, match=r"^SimStats\.surprise='x': expected a number or None$"):
        SimStats(params={"k": 0.1}, loss=1.0, surprise="x")
