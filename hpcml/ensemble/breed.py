"""The adaptive sampler, after Melissa's Breed (Dymchenko, Purandare, Raffin 2024): each wave
partly drawn around the simulations the surrogate fits worst, the rest from a base design
(:mod:`hpcml.ensemble.sampling` has the protocol, the static designs and the state checks)."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from hpcml.ensemble.design import Bounds, check_seed
from hpcml.ensemble.sampling import Cube, Feedback, Halton, Params, Sampler, SimStats, check_count, checked_state
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_real

logger = get_logger(__name__)


@dataclass(kw_only=True)
class Breed:
    """Adaptive sampling after Melissa's Breed: wave ``w`` draws ``round(R_w * n)`` points from
    Gaussians (std ``sigma`` of each axis, in the unit cube) around parents picked among the
    ``parents`` fraction of simulations with the highest ``score``, with probability proportional
    to it (``"loss"``: the training loss, as Melissa's; ``"surprise"``: the out-of-sample loss
    before training on it, relative, see :class:`SimStats`; a simulation without one is no
    parent); the rest come from ``base`` (a Halton sequence by default). ``R_w`` ramps
    linearly from ``r_start`` to ``r_end`` over ``ramp_waves`` waves, so the base design covers
    the space before the sampler trusts the surrogate's errors. A child outside the bounds is
    drawn again (a truncated Gaussian: clipping would pile children on the faces). Each child
    is the farthest, from every simulation in the feedback and the wave's points before it,
    of ``spread`` such draws (1: Melissa's single draw). The first wave, or any wave without
    usable feedback, is all base design."""

    bounds: Bounds
    seed: int = 0
    log: Collection[str] = frozenset()
    r_start: float = 0.0
    r_end: float = 0.5
    """Half bred, half base design once ramped: on heat2d's sharp source this held the tail better
    than three quarters bred (p95 0.68x Halton's against 0.84x, ten seeds, benchmarks.md)."""
    ramp_waves: int = 4
    sigma: float = 0.08
    parents: float = 0.25
    base: Sampler | None = None
    score: str = "loss"
    spread: int = 16
    """Candidates drawn per child, the one farthest from every simulation so far kept (1:
    Melissa's plain draw, whose children pile up around the same few parents)."""
    wave: int = field(default=0, init=False)
    last: dict = field(default_factory=dict, init=False)
    """What the last wave did: ``{"wave", "r", "bred", "parents"}`` (for the report)."""

    def __post_init__(self) -> None:
        check_seed(self.seed)
        self.cube = Cube(self.bounds, self.log)
        for name, ok, want in (("r_start", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
                               ("r_end", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
                               ("ramp_waves", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
                               ("sigma", lambda v: 0 < v <= 1, "a width in (0, 1] of each axis"),
                               ("parents", lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
                               ("spread", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1")):
            v = getattr(self, name)
            if not is_real(v) or not ok(v):
                raise ConfigError(f"Breed.{name}={v!r}: expected {want}")
        if self.score not in ("loss", "surprise"):
            raise ConfigError(f"Breed.score={self.score!r}: expected 'loss' or 'surprise'")
        if self.base is None:
            self.base = Halton(self.bounds, seed=self.seed, log=self.log)
        elif not isinstance(self.base, Sampler):
            raise ConfigError(f"Breed.base={self.base!r}: expected a Sampler (propose, state_dict, load_state_dict)")

    def ratio(self, wave: int) -> float:
        """``R`` of wave ``wave`` (0-based): the fraction bred from high-loss parents."""
        if self.ramp_waves == 0:
            return float(self.r_end)
        return float(self.r_start + (self.r_end - self.r_start) * min(1.0, wave / self.ramp_waves))

    def propose(self, n: int, feedback: Feedback) -> list[Params]:
        n = check_count(n)
        wave, self.wave = self.wave, self.wave + 1
        rng = np.random.default_rng([self.seed, wave])
        parents, weights, known = self._parents(feedback)
        r = self.ratio(wave) if parents is not None else 0.0
        bred = int(round(r * n))
        self.last = {"wave": wave, "r": r, "bred": bred, "parents": 0 if parents is None else len(parents)}
        out = self.base.propose(n - bred, feedback) if n - bred else []
        if bred:
            out += self.cube.points(self._spread(parents, weights, bred, known, out, rng))
        logger.info("wave %d: %d of %d bred around %d parents (R=%.2f), %d from the base design", wave, bred, n,
                    self.last["parents"], r, n - bred)
        return out

    def _parents(self, feedback: Feedback) -> tuple[np.ndarray | None, np.ndarray | None, list[np.ndarray]]:
        """The high-loss parents in the unit cube and their pick probabilities (None: no feedback),
        and every simulation the feedback places, in the unit cube (what a spread child keeps away from)."""
        if not isinstance(feedback, Mapping):
            raise ConfigError(f"feedback must map simulation ids to SimStats, got {type(feedback).__name__}")
        rows, known = [], []
        for sim in sorted(feedback):  # sorted: the same feedback gives the same wave
            st = feedback[sim]
            if not isinstance(st, SimStats):
                raise ConfigError(f"feedback[{sim!r}] is a {type(st).__name__}, expected SimStats")
            missing = [k for k in self.cube.names if k not in st.params]
            if missing:
                raise ConfigError(f"feedback[{sim!r}] lacks the parameters {missing} of the bounds")
            unit = self.cube.unit(st.params)
            if not np.all(np.isfinite(unit)):
                continue
            known.append(unit)
            score = st.loss if self.score == "loss" else st.surprise
            if score is not None and math.isfinite(score) and score >= 0:
                rows.append((float(score), sim, unit))
        if not rows or max(r[0] for r in rows) <= 0:
            return None, None, known
        rows.sort(key=lambda r: (-r[0], r[1]))
        top = rows[:max(1, math.ceil(self.parents * len(rows)))]
        loss = np.array([r[0] for r in top])
        loss = loss / loss.max()  # no overflow to inf for losses near the float limit
        return np.stack([r[2] for r in top]), loss / loss.sum(), known

    def _spread(self, parents: np.ndarray, weights: np.ndarray, n: int, known: list[np.ndarray],
                wave: list[Params], rng: np.random.Generator) -> np.ndarray:
        """``n`` children, each the farthest from the ``known`` simulations, the ``wave``'s points
        and the children before it, among ``spread`` candidates drawn as the plain draw draws them
        (around parents picked by weight): they fill the neighbourhoods of the high-loss
        simulations instead of piling on a few parents and on simulations already run."""
        pick = rng.choice(len(parents), size=n * self.spread, p=weights)
        cand = self._children(parents[pick], rng).reshape(n, self.spread, -1)
        if self.spread == 1:
            return cand[:, 0]
        design = known + [u for u in map(self.cube.unit, wave) if np.all(np.isfinite(u))]
        if design:
            from scipy.spatial import cKDTree  # nearest-design distances in O(log m) each

            gap = cKDTree(np.stack(design)).query(cand.reshape(n * self.spread, -1))[0].reshape(n, self.spread)
        else:
            gap = np.full((n, self.spread), np.inf)
        out = np.empty((n, cand.shape[2]))
        for i in range(n):
            if i:
                gap[i] = np.minimum(gap[i], np.linalg.norm(cand[i][:, None] - out[None, :i], axis=2).min(axis=1))
            out[i] = cand[i, int(np.argmax(gap[i]))]
        return out

    def _children(self, centres: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One Gaussian child per centre, redrawn until inside the unit cube."""
        out = centres + rng.normal(0.0, self.sigma, size=centres.shape)
        for _ in range(64):
            bad = np.any((out < 0) | (out > 1), axis=1)
            if not bad.any():
                break
            out[bad] = centres[bad] + rng.normal(0.0, self.sigma, size=(int(bad.sum()), centres.shape[1]))
        return np.clip(out, 0.0, 1.0)  # after 64 tries (sigma ~ a whole axis): the nearest face

    def state_dict(self) -> dict:
        return {"kind": "breed", "seed": self.seed, "wave": self.wave, "base": self.base.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        s = checked_state(state, "breed", ("seed", "wave"), ("base",), seed=self.seed, name="Breed")
        self.base.load_state_dict(s["base"])
        self.wave = s["wave"]
