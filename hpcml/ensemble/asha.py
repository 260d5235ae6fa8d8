"""What a hyperparameter search decides, with nothing launched: the trials' configurations
(a grid, or seeded random draws), the rungs of steps, and the next job -- asynchronous
successive halving (ASHA, Li et al., MLSys 2020) or every trial to the end (grid, random).

ASHA: a trial trains ``min_steps``, then ``min_steps * eta``, ... up to ``max_steps`` (the
rungs), each rung continuing the same trial from its checkpoint. Whenever a slot is free the
next job is the best trial of the highest rung that is in that rung's top ``1/eta`` and not
yet promoted; if none, a new trial at rung 0. A trial the others beat never trains past its
rung, so the search costs a fraction of the grid's steps. The state is rebuilt from the
recorded results alone (a resumed search decides as the interrupted one would have next).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcml.errors import ConfigError
from hpcml.numeric import is_int, is_real

METHODS = ("asha", "grid", "random")


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """``space``: name -> a list of values (a grid axis, or a choice when drawn) or
    ``{"low": a, "high": b, "log": bool, "int": bool}`` (drawn; not on a grid). ``trials``:
    how many configurations are drawn (``random``, ``asha``); None: the whole grid (every
    axis a list). ``metric`` (``mode`` "min" or "max"): the key of the trial's
    ``metrics.jsonl`` record at the rung's last step that scores it."""

    space: Mapping[str, Any]
    method: str = "asha"
    trials: int | None = None
    min_steps: int = 1
    max_steps: int = 1
    eta: int = 3
    seed: int = 0
    metric: str = "val_loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r}: expected one of {', '.join(METHODS)}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"mode={self.mode!r}: expected 'min' or 'max'")
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"metric={self.metric!r}: expected the name of a metrics.jsonl key")
        if not isinstance(self.space, Mapping) or not self.space:
            raise ConfigError(f"space={self.space!r}: expected a dict of name -> values or range")
        for name, axis in self.space.items():
            _check_axis(name, axis)
        for name in ("min_steps", "max_steps", "eta"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected an int >= 1")
        if self.min_steps > self.max_steps:
            raise ConfigError(f"min_steps={self.min_steps} > max_steps={self.max_steps}")
        if self.method == "asha" and self.eta < 2:
            raise ConfigError(f"eta={self.eta}: ASHA keeps the top 1/eta of a rung, so eta must be >= 2")
        if self.trials is not None and (not is_int(self.trials) or self.trials < 1):
            raise ConfigError(f"trials={self.trials!r}: expected an int >= 1 or None (the whole grid)")
        ranges = [n for n, a in self.space.items() if isinstance(a, Mapping)]
        if self.trials is None and ranges:
            raise ConfigError(f"trials=None takes the whole grid, but {', '.join(ranges)} is a range: give "
                              f"trials= (how many configurations to draw) or a list of values")
        if self.method == "grid" and ranges:
            raise ConfigError(f"method='grid' needs lists of values, but {', '.join(ranges)} is a range")

    @property
    def rungs(self) -> list[int]:
        """Steps each rung trains to: ``min_steps * eta**k`` below ``max_steps``, then
        ``max_steps``; one rung (``max_steps``) for grid and random."""
        if self.method != "asha":
            return [self.max_steps]
        out, steps = [], self.min_steps
        while steps < self.max_steps:
            out.append(steps)
            steps *= self.eta
        return [*out, self.max_steps]


def _check_axis(name: object, axis: object) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"space: name {name!r} must be an identifier (it is a {{placeholder}} of the command)")
    if isinstance(axis, Mapping):
        low, high = axis.get("low"), axis.get("high")
        extra = set(axis) - {"low", "high", "log", "int"}
        if extra or not (is_real(low) and is_real(high) and math.isfinite(low) and math.isfinite(high) and low < high):
            raise ConfigError(f"space[{name!r}]={dict(axis)!r}: expected {{'low': a, 'high': b}} with finite a < b "
                              f"(and optionally 'log', 'int')")
        if axis.get("log") and low <= 0:
            raise ConfigError(f"space[{name!r}]: log=True needs low > 0, got {low}")
        return
    if isinstance(axis, (str, bytes)) or not isinstance(axis, Sequence) or not axis:
        raise ConfigError(f"space[{name!r}]={axis!r}: expected a non-empty list of values or a range dict")
    for v in axis:
        if not (isinstance(v, (str, bool)) or (is_real(v) and math.isfinite(v))):
            raise ConfigError(f"space[{name!r}]: value {v!r} must be a finite number, a string or a bool")


def configurations(cfg: SearchConfig) -> list[dict[str, Any]]:
    """The trials' hyperparameters, in trial order: the grid (``trials`` None, or grid method)
    or ``trials`` seeded draws (the same list on every call)."""
    names = list(cfg.space)
    if cfg.trials is None or cfg.method == "grid":
        grid = [dict(zip(names, values)) for values in itertools.product(*(cfg.space[n] for n in names))]
        if cfg.trials is not None and cfg.trials != len(grid):
            raise ConfigError(f"method='grid': trials={cfg.trials} but the grid has {len(grid)} points: "
                              f"leave trials=None")
        return grid
    rng = random.Random(cfg.seed)
    return [{n: _draw(rng, cfg.space[n]) for n in names} for _ in range(cfg.trials)]


def _draw(rng: random.Random, axis: Any) -> Any:
    if not isinstance(axis, Mapping):
        return axis[rng.randrange(len(axis))]
    low, high = float(axis["low"]), float(axis["high"])
    x = math.exp(rng.uniform(math.log(low), math.log(high))) if axis.get("log") else rng.uniform(low, high)
    return int(round(x)) if axis.get("int") else x


@dataclass
class Asha:
    """The search's state: scores per rung, promotions, jobs running. ``next_job`` gives
    ``(trial, rung)`` or None (wait: a running job may yet be promoted); ``finished`` once
    nothing runs and nothing more can start."""

    cfg: SearchConfig
    n_trials: int
    scores: list[dict[int, float]] = field(init=False)
    running: set[tuple[int, int]] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)
    started: int = 0
    """Trials started at rung 0 so far."""
    order: list[int] = field(init=False)
    """The order new trials start in: a seeded shuffle, so a grid listed from its worst
    corner does not fill the first rung's top third with the first (worst) trials seen."""

    def __post_init__(self) -> None:
        self.scores = [{} for _ in self.cfg.rungs]
        self.order = list(range(self.n_trials))
        random.Random(self.cfg.seed).shuffle(self.order)

    def _key(self, score: float) -> float:
        """Smaller is better; NaN (a diverged trial) is worst."""
        if math.isnan(score):
            return math.inf
        return score if self.cfg.mode == "min" else -score

    def ranked(self, rung: int) -> list[int]:
        """The trials scored at ``rung``, best first (ties by trial index)."""
        return sorted(self.scores[rung], key=lambda t: (self._key(self.scores[rung][t]), t))

    def _promotable(self, rung: int) -> int | None:
        done = self.scores[rung]
        top = self.ranked(rung)[:len(done) // self.cfg.eta]
        above = self.scores[rung + 1]
        for t in top:
            if t not in above and (t, rung + 1) not in self.running and t not in self.failed:
                return t
        return None

    def next_job(self) -> tuple[int, int] | None:
        for rung in range(len(self.cfg.rungs) - 2, -1, -1):
            t = self._promotable(rung)
            if t is not None:
                return t, rung + 1
        while self.started < self.n_trials:
            t = self.order[self.started]
            self.started += 1
            if t not in self.scores[0] and t not in self.failed and (t, 0) not in self.running:
                return t, 0
        return None

    def start(self, trial: int, rung: int) -> None:
        self.running.add((trial, rung))

    def report(self, trial: int, rung: int, score: float) -> None:
        self.running.discard((trial, rung))
        self.scores[rung][trial] = float(score)

    def fail(self, trial: int, rung: int, why: str) -> None:
        self.running.discard((trial, rung))
        self.failed[trial] = why

    @property
    def finished(self) -> bool:
        return not self.running and self.next_job_preview() is None

    def next_job_preview(self) -> tuple[int, int] | None:
        """What :meth:`next_job` would give, without taking a new trial."""
        started = self.started
        try:
            return self.next_job()
        finally:
            self.started = started

    def best(self) -> tuple[int, int] | None:
        """``(trial, rung)`` of the best score at the highest rung any trial reached."""
        for rung in range(len(self.cfg.rungs) - 1, -1, -1):
            ranked = self.ranked(rung)
            if ranked:
                return ranked[0], rung
        return None

    def trial_steps(self) -> int:
        """Steps trained in all: each trial to the highest rung it completed (a promotion
        continues from the checkpoint, so a rung costs only its increment)."""
        return sum(max((self.cfg.rungs[r] for r in range(len(self.cfg.rungs)) if t in self.scores[r]), default=0)
                   for t in range(self.n_trials))


__all__ = ["Asha", "METHODS", "SearchConfig", "configurations"]
