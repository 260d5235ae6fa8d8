"""Where the next simulations go: samplers a campaign asks for each wave of parameters.

A :class:`Sampler` proposes ``n`` parameter sets from what training reports about the
simulations run so far (:class:`SimStats` per simulation: the loss on its samples, how many
were trained on, how old they are). The static designs ignore the feedback and continue a
sequence (:class:`Halton`, :class:`Sobol`), draw a fresh stratified set per wave
(:class:`LatinHypercube`) or walk a grid (:class:`FullFactorial`). The adaptive one,
:class:`~hpcml.ensemble.breed.Breed`, has a module of its own: after Melissa's Breed
(Dymchenko, Purandare, Raffin 2024), a fraction ``R`` of each wave is drawn from Gaussians
around the simulations the surrogate fits worst, ``R`` ramped up over the waves, the rest
from a base design, every point inside the bounds.

Resuming must propose the same waves, so a sampler is deterministic in (its seed, the wave
number, the feedback) and its whole state is a small JSON dict (:meth:`Sampler.state_dict`)
the campaign checkpoints. Draws happen in the unit cube, mapped onto the bounds linearly or
log-uniformly (:mod:`hpcml.ensemble.design`), so a Gaussian's width means the same fraction
of every axis. A user's own sampler is any object with the three methods of :class:`Sampler`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from hpcml.ensemble.design import Bounds, check_bounds, check_seed, full_factorial, latin_hypercube, scale_unit
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int, is_real

logger = get_logger(__name__)

Params = dict[str, float]


@dataclass(frozen=True, kw_only=True)
class SimStats:
    """What training knows of one simulation, as the trainer publishes it."""

    params: Mapping[str, float]
    """The simulation's parameters."""
    loss: float
    """Mean training loss over its samples, as last evaluated (higher: fitted worse)."""
    samples: int = 0
    """Samples of it trained on so far."""
    age: int = 0
    """Trainer steps since its loss was last evaluated."""
    fresh: float | None = None
    """Its loss before the trainer trained on it: out-of-sample (None: not measured)."""
    surprise: float | None = None
    """``fresh`` over the training loss of that moment (>> 1: a region the surrogate has not learnt)."""

    def __post_init__(self) -> None:
        if not is_real(self.loss):
            raise ConfigError(f"SimStats.loss={self.loss!r}: expected a number (NaN or inf: not used as a parent)")
        for name in ("fresh", "surprise"):
            v = getattr(self, name)
            if v is not None and (not is_real(v)):
                raise ConfigError(f"SimStats.{name}={v!r}: expected a number or None")
        if not is_int(self.samples) or self.samples < 0:
            raise ConfigError(f"SimStats.samples={self.samples!r}: expected an integer >= 0")
        if not is_int(self.age) or self.age < 0:
            raise ConfigError(f"SimStats.age={self.age!r}: expected an integer >= 0")


Feedback = Mapping[str, SimStats]
"""Per-simulation statistics by simulation id."""


@runtime_checkable
class Sampler(Protocol):
    """Proposes parameter sets; deterministic in its seed, the wave and the feedback."""

    def propose(self, n: int, feedback: Feedback) -> list[Params]:
        """The next wave: ``n`` parameter sets inside the bounds."""
        ...

    def state_dict(self) -> dict:
        """Everything needed to propose the next wave again after a restart (JSON)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        ...


# --- static designs -----------------------------------------------------------------------------

class Cube:
    """Bounds, checked once, and the map from the unit cube onto them."""

    def __init__(self, bounds: Bounds, log: Collection[str]) -> None:
        self.names, self.lo, self.hi, self.is_log = check_bounds(bounds, log)
        self.bounds = {k: (a, b) for k, a, b in zip(self.names, self.lo, self.hi)}
        self.log = frozenset(k for k, flag in zip(self.names, self.is_log) if flag)

    @property
    def d(self) -> int:
        return len(self.names)

    def points(self, u: np.ndarray) -> list[Params]:
        return scale_unit(np.asarray(u, dtype=float).reshape(-1, self.d), self.names, self.lo, self.hi,
                             self.is_log)

    def unit(self, params: Mapping[str, float]) -> np.ndarray:
        """Parameters -> unit cube (clipped: a simulation outside the bounds counts at their edge;
        NaN where a value is not finite)."""
        out = np.empty(self.d)
        for j, k in enumerate(self.names):
            v = float(params[k])
            if not math.isfinite(v):  # not a point of the space: the caller skips it
                out[j] = math.nan
                continue
            a, b, x = (math.log(self.lo[j]), math.log(self.hi[j]), math.log(v) if v > 0 else -math.inf) \
                if self.is_log[j] else (self.lo[j], self.hi[j], v)
            out[j] = (x - a) / (b - a)
        return np.clip(out, 0.0, 1.0)


#: A sampler's counters (points drawn, waves) never pass this: a state that says more was not recorded by one.
MAX_COUNT = 2**31 - 1


def check_count(n: object) -> int:
    if not is_int(n, numpy=True) or n < 0:
        raise ConfigError(f"propose(n={n!r}): expected an integer >= 0")
    return int(n)


def checked_state(state: object, kind: str, keys: Collection[str], others: Collection[str] = (), *,
           seed: int | None = None, name: str | None = None) -> dict:
    """A state dict of ``kind`` with exactly ``keys`` (integers >= 0) and ``others``, drawn with
    ``seed`` when one is given; errors say ``name.load_state_dict`` (default: the kind)."""
    who = f"{name or kind}.load_state_dict"
    if not isinstance(state, Mapping) or state.get("kind") != kind or set(state) != {"kind", *keys, *others}:
        raise ConfigError(f"{who}: expected {{'kind': {kind!r}, {', '.join(sorted([*keys, *others]))}}}, "
                          f"got {str(state)[:120]}")
    if seed is not None and state.get("seed") != seed:
        raise ConfigError(f"{who}: the state was drawn with seed {state.get('seed')}, this sampler has seed {seed}")
    for k in keys:
        v = state[k]
        top = 2**128 if k == "seed" else MAX_COUNT
        if not is_int(v) or not 0 <= v <= top:
            raise ConfigError(f"{who}: {k}={v!r}, expected an integer from 0 to {top}")
    return dict(state)


class _Sequence:
    """A low-discrepancy sequence continued across waves: the state is how many were drawn."""

    kind = ""

    def __init__(self, bounds: Bounds, *, seed: int = 0, log: Collection[str] = frozenset()) -> None:
        check_seed(seed)
        self.cube, self.seed, self.drawn = Cube(bounds, log), int(seed), 0

    def _engine(self):
        raise NotImplementedError

    def propose(self, n: int, feedback: Feedback | None = None) -> list[Params]:
        n = check_count(n)
        if not n:
            return []
        engine = self._engine()
        if self.drawn:
            engine.fast_forward(self.drawn)
        u = engine.random(n)
        self.drawn += n
        return self.cube.points(u)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = checked_state(state, self.kind, ("seed", "drawn"), seed=self.seed)["drawn"]


class Halton(_Sequence):
    """The scrambled Halton sequence, continued wave after wave: any prefix is space-filling,
    so waves of any size stay balanced together (the usual base design of adaptive sampling)."""

    kind = "halton"

    def _engine(self):
        from scipy.stats import qmc  # ~0.3 s, only where a sequence is drawn

        return qmc.Halton(self.cube.d, scramble=True, rng=np.random.default_rng(self.seed))


class Sobol(_Sequence):
    """The Owen-scrambled Sobol sequence, continued wave after wave (balanced at every power
    of two drawn in total, as :func:`hpcml.ensemble.design.sobol` explains)."""

    kind = "sobol"

    def _engine(self):
        from scipy.stats import qmc

        return qmc.Sobol(self.cube.d, scramble=True, rng=np.random.default_rng(self.seed))

    def propose(self, n: int, feedback: Feedback | None = None) -> list[Params]:
        import warnings

        with warnings.catch_warnings():  # balance is of the total drawn, not of one wave: said above
            warnings.filterwarnings("ignore", message=".*balance properties of Sobol.*")
            return super().propose(n, feedback)


class LatinHypercube:
    """A fresh Latin hypercube per wave (its own seed: the sampler's and the wave number)."""

    kind = "latin_hypercube"

    def __init__(self, bounds: Bounds, *, seed: int = 0, log: Collection[str] = frozenset()) -> None:
        check_seed(seed)
        self.bounds, self.log, self.seed, self.wave = dict(bounds), frozenset(log), int(seed), 0
        Cube(bounds, log)  # checked now, not at the first wave

    def propose(self, n: int, feedback: Feedback | None = None) -> list[Params]:
        n = check_count(n)
        if not n:
            return []
        seed = int(np.random.SeedSequence([self.seed, self.wave]).generate_state(1)[0])
        self.wave += 1
        return latin_hypercube(self.bounds, n, seed=seed, log=self.log)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "seed": self.seed, "wave": self.wave}

    def load_state_dict(self, state: dict) -> None:
        s = checked_state(state, self.kind, ("seed", "wave"))
        self.seed, self.wave = s["seed"], s["wave"]


class FullFactorial:
    """Every point of a grid (:func:`hpcml.ensemble.design.full_factorial`), handed out in order
    across waves; asking past its last point is an error naming how many are left."""

    kind = "full_factorial"

    def __init__(self, bounds: Bounds, n: int | Mapping[str, int], *,
                 log: Collection[str] = frozenset()) -> None:
        self.points, self.bounds = full_factorial(bounds, n, log=log), dict(bounds)
        self.drawn = 0

    @property
    def capacity(self) -> int:
        """Points of the grid: a campaign's budget must not exceed it."""
        return len(self.points)

    def propose(self, n: int, feedback: Feedback | None = None) -> list[Params]:
        n = check_count(n)
        left = len(self.points) - self.drawn
        if n > left:
            raise ConfigError(f"full_factorial: {n} points asked, {left} of {len(self.points)} left")
        out = self.points[self.drawn:self.drawn + n]
        self.drawn += n
        return [dict(p) for p in out]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        s = checked_state(state, self.kind, ("drawn",))
        if s["drawn"] > len(self.points):
            raise ConfigError(f"full_factorial.load_state_dict: drawn={s['drawn']} exceeds the grid's "
                              f"{len(self.points)} points")
        self.drawn = s["drawn"]


STATIC = {"halton": Halton, "sobol": Sobol, "latin_hypercube": LatinHypercube, "lhs": LatinHypercube}


def static(kind: str, bounds: Bounds, *, seed: int = 0, log: Collection[str] = frozenset()) -> Sampler:
    """A static sampler by name (halton, sobol, latin_hypercube / lhs)."""
    cls = STATIC.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"sampler {kind!r} unknown: expected one of {', '.join(STATIC)} (or full_factorial "
                          f"with its counts: FullFactorial)")
    return cls(bounds, seed=seed, log=log)
