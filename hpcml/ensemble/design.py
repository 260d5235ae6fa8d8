"""Parameter designs for ensembles: Latin hypercube, Sobol and full factorial.

Every design is drawn on the unit cube and then mapped onto the bounds, linearly or
log-uniformly (for parameters that span decades, such as a diffusivity), so that the
space-filling property holds in the space the scientist thinks in. A design is a plain
``list[dict[str, float]]`` in the order of ``bounds``: it goes into JSON provenance and
onto a command line as it is.

Decisions:

- Latin hypercube is drawn with numpy (a permutation of the strata plus a uniform jitter
  per dimension), so a seed gives the same points whatever scipy is installed.
- Sobol needs ``n`` a power of two: only then are its points balanced (every dyadic
  stratum of every dimension holds exactly one point). Another ``n`` is a
  :class:`~hpcml.errors.ConfigError` naming the two nearest powers, not a silent rounding
  that would change the ensemble's cost.
- Full factorial takes either a total ``n`` (``floor(n ** (1/d))`` points per axis, a
  warning when that product is not ``n``) or a dict of per-axis counts; each axis includes
  both bounds (one point per axis means the midpoint). Not named "grid": ``hpcml.grid`` is
  the process grid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping

import numpy as np

from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int

logger = get_logger(__name__)

Bounds = Mapping[str, tuple[float, float]]
KINDS = {"latin_hypercube": "latin_hypercube", "lhs": "latin_hypercube", "sobol": "sobol",
         "full_factorial": "full_factorial"}


def design(kind: str, bounds: Bounds, n: int | Mapping[str, int], *, seed: int = 0,
           log: Collection[str] = frozenset()) -> list[dict[str, float]]:
    """``n`` points of design ``kind`` (latin_hypercube / lhs, sobol, full_factorial) over ``bounds``;
    names in ``log`` are sampled log-uniformly."""
    name = KINDS.get(kind) if isinstance(kind, str) else None
    if name is None:
        raise ConfigError(f"design kind {kind!r} unknown: expected one of {', '.join(KINDS)}")
    if name == "full_factorial":
        return full_factorial(bounds, n, log=log)
    if not is_int(n, numpy=True):
        raise ConfigError(f"{name} needs n as an int, got {n!r}")
    draw = latin_hypercube if name == "latin_hypercube" else sobol
    return draw(bounds, n, seed=seed, log=log)  # type: ignore[arg-type]


def latin_hypercube(bounds: Bounds, n: int, *, seed: int = 0,
                    log: Collection[str] = frozenset()) -> list[dict[str, float]]:
    """Latin hypercube: each parameter's range cut into ``n`` equal strata (in log space for
    ``log`` names), exactly one point in each, strata paired at random across parameters."""
    names, lo, hi, is_log = check_bounds(bounds, log)
    _check_n(n)
    check_seed(seed)
    rng = np.random.default_rng(seed)
    d = len(names)
    u = np.empty((n, d))
    for j in range(d):
        u[:, j] = (rng.permutation(n) + rng.random(n)) / n
    return scale_unit(u, names, lo, hi, is_log)


def sobol(bounds: Bounds, n: int, *, seed: int = 0, log: Collection[str] = frozenset(),
          scramble: bool = True) -> list[dict[str, float]]:
    """The first ``n`` points (a power of two) of a Sobol sequence, Owen-scrambled with
    ``seed`` unless ``scramble`` is False (then the classic sequence, starting at 0)."""
    names, lo, hi, is_log = check_bounds(bounds, log)
    _check_n(n)
    check_seed(seed)
    if n & (n - 1):
        below = 1 << (n.bit_length() - 1)
        raise ConfigError(f"sobol needs n a power of two for balanced points, got {n} (use {below} or {below * 2})")
    if len(names) > 21201:
        raise ConfigError(f"sobol supports at most 21201 parameters, got {len(names)}")
    from scipy.stats import qmc  # imported here: scipy costs ~0.3 s, and only Sobol needs it

    rng = np.random.default_rng(seed)
    try:
        engine = qmc.Sobol(len(names), scramble=scramble, rng=rng)
    except TypeError:  # scipy < 1.15 names the generator `seed`
        engine = qmc.Sobol(len(names), scramble=scramble, seed=rng)
    return scale_unit(engine.random_base2(n.bit_length() - 1), names, lo, hi, is_log)


def full_factorial(bounds: Bounds, n: int | Mapping[str, int], *,
                   log: Collection[str] = frozenset()) -> list[dict[str, float]]:
    """Every combination of per-axis points, the last parameter varying fastest; ``n`` is the total (the
    per-axis count is ``floor(n ** (1/d))``) or a dict of per-axis counts."""
    names, lo, hi, is_log = check_bounds(bounds, log)
    if isinstance(n, Mapping):
        extra = sorted(set(n) - set(names))
        missing = [k for k in names if k not in n]
        if extra or missing:
            raise ConfigError(f"full_factorial counts must name exactly the bounds' parameters ({', '.join(names)}); "
                              f"unknown {extra}, missing {missing}")
        for k in names:
            if not is_int(n[k], numpy=True) or n[k] < 1:
                raise ConfigError(f"full_factorial count for {k!r} must be an int >= 1, got {n[k]!r}")
        counts = [int(n[k]) for k in names]
    else:
        _check_n(n)
        per = _int_root(n, len(names))
        counts = [per] * len(names)
        if per ** len(names) != n:
            logger.warning("full_factorial: n=%d over %d parameters gives %d per axis = %d points", n, len(names), per,
                           per ** len(names))
    axes = []
    for j, c in enumerate(counts):
        a, b = (math.log(lo[j]), math.log(hi[j])) if is_log[j] else (lo[j], hi[j])
        pts = np.linspace(a, b, c) if c > 1 else np.array([(a + b) / 2])
        axes.append(np.exp(pts) if is_log[j] else pts)
    if is_log:  # exact bounds despite exp(log(x)) rounding
        for j, c in enumerate(counts):
            if c > 1:
                axes[j][0], axes[j][-1] = lo[j], hi[j]
    return [{k: float(v) for k, v in zip(names, point)} for point in itertools.product(*axes)]


# --- validation and mapping -------------------------------------------------------------------

def _check_n(n: object) -> None:
    if not is_int(n, numpy=True) or n < 1:  # type: ignore[operator]
        raise ConfigError(f"n must be an int >= 1, got {n!r}")


def check_seed(seed: object) -> None:
    if not is_int(seed, numpy=True) or seed < 0:  # type: ignore[operator]
        raise ConfigError(f"seed must be an int >= 0, got {seed!r}")


def check_bounds(bounds: Bounds, log_names: Collection[str]) -> tuple[list[str], list[float], list[float], list[bool]]:
    if not isinstance(bounds, Mapping) or not bounds:
        raise ConfigError(f"bounds must be a non-empty dict of name -> (lo, hi), got {bounds!r}")
    if isinstance(log_names, str):
        raise ConfigError(f"log must be a set of names, got the string {log_names!r}")
    unknown = sorted(set(log_names) - set(bounds))
    if unknown:
        raise ConfigError(f"log names {unknown} are not in bounds ({', '.join(bounds)})")
    names, lo, hi, is_log = [], [], [], []
    for name, pair in bounds.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"parameter names must be non-empty strings, got {name!r}")
        try:
            a, b = (float(v) for v in pair)
        except (TypeError, ValueError):
            raise ConfigError(f"bounds[{name!r}] must be a pair (lo, hi) of numbers, got {pair!r}") from None
        if not (math.isfinite(a) and math.isfinite(b)):
            raise ConfigError(f"bounds[{name!r}] must be finite, got ({a}, {b})")
        if not a < b:
            raise ConfigError(f"bounds[{name!r}]: lo {a} must be < hi {b}")
        if name in log_names and a <= 0:
            raise ConfigError(f"log-uniform {name!r} needs lo > 0, got {a}")
        names.append(name)
        lo.append(a)
        hi.append(b)
        is_log.append(name in log_names)
    return names, lo, hi, is_log


def scale_unit(u: np.ndarray, names: list[str], lo: list[float], hi: list[float],
           is_log: list[bool]) -> list[dict[str, float]]:
    """Unit cube -> bounds, log-uniformly where asked; results clipped into [lo, hi]."""
    out = np.empty_like(u)
    for j in range(len(names)):
        if is_log[j]:
            a, b = math.log(lo[j]), math.log(hi[j])
            out[:, j] = np.exp(a + u[:, j] * (b - a))
        else:
            out[:, j] = lo[j] + u[:, j] * (hi[j] - lo[j])
        np.clip(out[:, j], lo[j], hi[j], out=out[:, j])
    return [{k: float(v) for k, v in zip(names, row)} for row in out]


def _int_root(n: int, d: int) -> int:
    """floor(n ** (1/d)) without float error (64 ** (1/3) is 3.9999999999999996)."""
    k = int(round(n ** (1.0 / d)))
    while k ** d > n:
        k -= 1
    while (k + 1) ** d <= n:
        k += 1
    return k
