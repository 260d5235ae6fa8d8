"""Parameter designs: stratification, the Sobol sequence itself, bounds, seeds, log scaling, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcml.ensemble.design import design, full_factorial, latin_hypercube, sobol
from hpcml.errors import ConfigError

BOUNDS = {"alpha": (0.1, 2.0), "kappa": (1e-4, 1e-1), "t0": (-5.0, 5.0)}


def _unit(points, bounds=BOUNDS, log=frozenset()):
    """Points back on the unit cube (log space for log names), shape (n, d)."""
    cols = []
    for name, (lo, hi) in bounds.items():
        x = np.array([p[name] for p in points])
        if name in log:
            x, lo, hi = np.log(x), math.log(lo), math.log(hi)
        cols.append((x - lo) / (hi - lo))
    return np.stack(cols, axis=1)


def _one_per_stratum(u: np.ndarray) -> bool:
    n = len(u)
    return all(sorted(np.floor(u[:, j] * n).astype(int).tolist()) == list(range(n)) for j in range(u.shape[1]))


@pytest.mark.parametrize("n", [1, 7, 64])
def test_lhs_exactly_one_point_per_stratum_per_dimension(n):
    pts = latin_hypercube(BOUNDS, n, seed=3, log={"kappa"})
    assert len(pts) == n and all(list(p) == list(BOUNDS) for p in pts)
    assert _one_per_stratum(_unit(pts, log={"kappa"}))


def test_lhs_log_strata_are_decades_not_linear():
    pts = latin_hypercube({"k": (1e-4, 1.0)}, 4, seed=0, log={"k"})
    # four log strata = the four decades, one point in each
    assert sorted(math.floor(math.log10(p["k"])) for p in pts) == [-4, -3, -2, -1]


def test_sobol_unscrambled_is_the_classic_sequence():
    pts = sobol({"x": (0.0, 1.0), "y": (0.0, 1.0)}, 8, scramble=False)
    assert [(p["x"], p["y"]) for p in pts] == [
        (0.0, 0.0), (0.5, 0.5), (0.75, 0.25), (0.25, 0.75),
        (0.375, 0.375), (0.875, 0.875), (0.625, 0.125), (0.125, 0.625)]


def test_sobol_scrambled_is_a_0_m_2_net():
    # The first 2^m points of a (scrambled) 2-D Sobol sequence put exactly one point in every
    # elementary box of area 2^-m: here every 4 x 4 and every 2 x 8 and 8 x 2 cell of 16 points.
    u = _unit(sobol({"a": (0.0, 1.0), "b": (-1.0, 1.0)}, 16, seed=11), {"a": (0.0, 1.0), "b": (-1.0, 1.0)})
    for kx, ky in [(4, 4), (2, 8), (8, 2), (16, 1), (1, 16)]:
        cells = sorted(zip(np.floor(u[:, 0] * kx).astype(int).tolist(), np.floor(u[:, 1] * ky).astype(int).tolist()))
        assert cells == [(i, j) for i in range(kx) for j in range(ky)], (kx, ky)


def test_bounds_respected_and_seeds_reproducible():
    for kind in ("lhs", "sobol"):
        a = design(kind, BOUNDS, 32, seed=5, log={"kappa"})
        assert a == design(kind, BOUNDS, 32, seed=5, log={"kappa"})
        assert a != design(kind, BOUNDS, 32, seed=6, log={"kappa"})
        for p in a:
            for name, (lo, hi) in BOUNDS.items():
                assert lo <= p[name] <= hi and type(p[name]) is float


def test_log_uniform_median_is_the_geometric_mean():
    pts = latin_hypercube({"k": (1e-6, 1.0)}, 1001, seed=0, log={"k"})
    assert np.median([p["k"] for p in pts]) == pytest.approx(1e-3, rel=0.05)
    lin = latin_hypercube({"k": (1e-6, 1.0)}, 1001, seed=0)
    assert np.median([p["k"] for p in lin]) == pytest.approx(0.5, rel=0.05)


def test_full_factorial_total_n_and_per_axis_counts():
    g = full_factorial({"a": (0.0, 1.0), "b": (1.0, 100.0)}, 9, log={"b"})
    assert [(p["a"], p["b"]) for p in g] == [
        (0.0, 1.0), (0.0, pytest.approx(10.0)), (0.0, 100.0), (0.5, 1.0), (0.5, pytest.approx(10.0)), (0.5, 100.0),
        (1.0, 1.0), (1.0, pytest.approx(10.0)), (1.0, 100.0)]
    assert len(design("full_factorial", BOUNDS, 64)) == 64            # 4 per axis: 64 ** (1/3) is 3.99999... in floats
    assert len(design("full_factorial", BOUNDS, 30)) == 27            # floor(30 ** (1/3)) = 3 per axis
    g = full_factorial({"a": (0.0, 1.0), "b": (0.0, 2.0)}, {"a": 1, "b": 3})
    assert [(p["a"], p["b"]) for p in g] == [(0.5, 0.0), (0.5, 1.0), (0.5, 2.0)]


@pytest.mark.parametrize("call, message", [
    (lambda: design("halton", BOUNDS, 4),
     "design kind 'halton' unknown: expected one of latin_hypercube, lhs, sobol, full_factorial"),
    (lambda: design("lhs", {"a": (1.0, 1.0)}, 4), "bounds['a']: lo 1.0 must be < hi 1.0"),
    (lambda: design("lhs", {"a": (2.0, 1.0)}, 4), "bounds['a']: lo 2.0 must be < hi 1.0"),
    (lambda: design("lhs", {"a": (0.0, math.inf)}, 4), "bounds['a'] must be finite, got (0.0, inf)"),
    (lambda: design("lhs", {"a": 3.0}, 4), "bounds['a'] must be a pair (lo, hi) of numbers, got 3.0"),
    (lambda: design("lhs", {}, 4), "bounds must be a non-empty dict of name -> (lo, hi), got {}"),
    (lambda: design("lhs", BOUNDS, 0), "n must be an int >= 1, got 0"),
    (lambda: design("lhs", BOUNDS, 2.5), "latin_hypercube needs n as an int, got 2.5"),
    (lambda: design("lhs", BOUNDS, 4, seed=-1), "seed must be an int >= 0, got -1"),
    (lambda: design("sobol", BOUNDS, 100), "sobol needs n a power of two for balanced points, got 100 (use 64 or 128)"),
    (lambda: design("lhs", {"a": (0.0, 1.0)}, 4, log={"a"}), "log-uniform 'a' needs lo > 0, got 0.0"),
    (lambda: design("lhs", {"a": (1.0, 2.0)}, 4, log={"b"}), "log names ['b'] are not in bounds (a)"),
    (lambda: design("lhs", {"a": (1.0, 2.0)}, 4, log="a"), "log must be a set of names, got the string 'a'"),
    (lambda: full_factorial({"a": (0.0, 1.0)}, {"a": 0}), "full_factorial count for 'a' must be an int >= 1, got 0"),
    (lambda: full_factorial({"a": (0.0, 1.0)}, {"b": 2}),
     "full_factorial counts must name exactly the bounds' parameters (a); unknown ['b'], missing ['a']"),
])
def test_bad_input_is_one_line_naming_the_value(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert str(e.value) == message


def test_the_full_factorial_design_is_not_called_grid():
    """``hpcml.grid`` is the process grid: no design of that name, no alias."""
    import hpcml.ensemble
    import hpcml.ensemble.design

    assert not hasattr(hpcml.ensemble.design, "grid") and "grid" not in hpcml.ensemble.__all__
    assert hpcml.ensemble.full_factorial is full_factorial
    with pytest.raises(ConfigError, match=r"^design kind 'grid' unknown: expected one of latin_hypercube, lhs, sobol, "
                                          r"full_factorial$"):
        design("grid", BOUNDS, 8)
