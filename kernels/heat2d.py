"""2-D heat equation on the unit square, MPI-parallel: ``dT/dt = alpha (d2T/dx2 + d2T/dy2)``.

``nx`` x ``ny`` interior points ``x_i = (i + 1) / (nx + 1)``, ``y_j = (j + 1) / (ny + 1)``;
Dirichlet temperatures on the four sides live in the ghost layer; explicit Euler in time on
the 5-point Laplacian (second order in space, first in time: with ``dt ~ dx^2`` the error
falls as ``dx^2``). ``init="sine"`` is the analytic case ``T = t_init exp(-2 pi^2 alpha t)
sin(pi x) sin(pi y)`` (zero boundaries). ``source_power > 0`` adds a Gaussian heat source of
that total rate, ``q(x, y) = source_power / (2 pi w^2) exp(-((x - source_x)^2 + (y -
source_y)^2) / (2 w^2))`` with ``w = source_width``, to the right-hand side: the same heat
from a narrower source makes a sharper, higher peak that moves with its centre, so how hard
the field is to learn varies strongly across (centre, width) -- what an adaptive sampler is
for (``benchmarks/active_learning.py --kernel heat2d``).

    mpiexec -n 4 python -m kernels.heat2d --nx 256 --ny 256 --steps 100 --every 10 --out heat.h5
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from hpcml.errors import ConfigError
from kernels.common import (Decomposition, GridConfig, KernelSpec, Sink, Stencil, check_min, decompose,
                            global_indices, main, march, new_state, option, param, stable_dt)

FIELDS = ["T"]


@dataclass(frozen=True, kw_only=True)
class HeatConfig(GridConfig):
    """One heat-equation run. ``repr()`` rebuilds it."""

    alpha: float = param(1.0, "thermal diffusivity (> 0)")
    t_left: float = param(0.0, "temperature on the side x = 0")
    t_right: float = param(0.0, "temperature on the side x = 1")
    t_bottom: float = param(0.0, "temperature on the side y = 0")
    t_top: float = param(0.0, "temperature on the side y = 1")
    t_init: float = param(1.0, "initial interior temperature (the amplitude with --init sine)")
    source_power: float = param(0.0, "heat a Gaussian source adds per unit time, its integral over the plane "
                                     "(0: no source)")
    source_x: float = param(0.5, "x of the source's centre")
    source_y: float = param(0.5, "y of the source's centre")
    source_width: float = param(0.1, "standard deviation of the source (> 0)")
    init: str = option("uniform", "initial condition: 'uniform' (t_init everywhere) or 'sine' (the analytic test "
                                  "case: t_init sin(pi x) sin(pi y), zero boundaries)", choices=["uniform", "sine"])

    def __post_init__(self) -> None:
        super().__post_init__()
        check_min(self, "alpha", "source_width")
        check_min(self, "source_power", strict=False)
        for name in ("source_power", "source_x", "source_y", "source_width"):
            if not np.isfinite(getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.init not in ("uniform", "sine"):
            raise ConfigError(f"init must be 'uniform' or 'sine', got {self.init!r}")
        if self.init == "sine":
            hot = {k: v for k, v in self.params.items()
                   if (k.startswith("t_") and k != "t_init" or k == "source_power") and v != 0}
            if hot:
                raise ConfigError("init='sine' is the analytic case with zero boundary temperatures and no source, got "
                                  + ", ".join(f"{k}={v}" for k, v in hot.items()))
        self.time_step  # noqa: B018 - validates dt against the stability limit

    @property
    def spacing(self) -> tuple[float, float]:
        """(dx, dy): the nx interior points and the two walls split [0, 1] into nx + 1 intervals."""
        return 1.0 / (self.nx + 1), 1.0 / (self.ny + 1)

    @property
    def time_step(self) -> float:
        return stable_dt(self.dt, self.alpha, *self.spacing, what="alpha")


def exact(cfg: HeatConfig, t: float, decomp: Decomposition) -> np.ndarray:
    """The analytic solution of the ``init="sine"`` case on this rank's block."""
    x, y = coordinates(cfg, decomp)
    return cfg.t_init * np.exp(-2 * np.pi**2 * cfg.alpha * t) * np.sin(np.pi * x) * np.sin(np.pi * y)


def coordinates(cfg: HeatConfig, decomp: Decomposition) -> tuple[np.ndarray, np.ndarray]:
    """x and y of this rank's interior points (open grids: broadcast them)."""
    (i, j), (dx, dy) = global_indices(decomp), cfg.spacing
    return (i + 1) * dx, (j + 1) * dy


def source(cfg: HeatConfig, decomp: Decomposition) -> np.ndarray | None:
    """The Gaussian source ``q`` on this rank's block (``None`` without one)."""
    if cfg.source_power == 0:
        return None
    x, y = coordinates(cfg, decomp)
    r2 = (x - cfg.source_x) ** 2 + (y - cfg.source_y) ** 2
    w2 = cfg.source_width**2
    return cfg.source_power / (2 * np.pi * w2) * np.exp(-r2 / (2 * w2))


def initial_state(cfg: HeatConfig, decomp: Decomposition) -> np.ndarray:
    """``state[1, lx + 2, ly + 2]``: the interior initial field and, on the domain's edges, the walls."""
    state = new_state(decomp, 1)
    state[0, 1:-1, 1:-1] = exact(cfg, 0.0, decomp) if cfg.init == "sine" else cfg.t_init
    (cx, cy), (px, py) = decomp.coords, decomp.dims
    T = state[0]
    if cx == 0:
        T[0, :] = cfg.t_left
    if cx == px - 1:
        T[-1, :] = cfg.t_right
    if cy == 0:
        T[:, 0] = cfg.t_bottom
    if cy == py - 1:
        T[:, -1] = cfg.t_top
    return state


def run(comm: MPI.Comm, cfg: HeatConfig, sink: Sink | None = None, *,
        decomp: Decomposition | None = None) -> np.ndarray:
    """Run on ``comm`` (collective); returns this rank's final interior field ``T[lx, ly]``.

    ``decomp`` reuses a decomposition already made on ``comm`` (the one a sink was opened on).
    The caller owns ``sink`` and closes it.
    """
    decomp = decomp if decomp is not None else decompose(comm, cfg.nx, cfg.ny, periodic=False)
    state = initial_state(cfg, decomp)
    (dx, dy), dt = cfg.spacing, cfg.time_step
    rx, ry = cfg.alpha * dt / dx**2, cfg.alpha * dt / dy**2
    stencil, inc = Stencil(decomp.local_shape), np.empty(decomp.local_shape)
    heat = source(cfg, decomp)  # per step: dt q
    if heat is not None:
        heat *= dt

    def advance() -> None:
        state[0, 1:-1, 1:-1] += stencil.diffusion(state[0], rx, ry, out=inc)
        if heat is not None:
            state[0, 1:-1, 1:-1] += heat

    march(state, decomp, advance, cfg=cfg, names=FIELDS, sink=sink)
    return state[0, 1:-1, 1:-1].copy()


SPEC = KernelSpec(name="heat2d", description=__doc__.split("\n")[0], config=HeatConfig, run=run, fields=FIELDS,
                  periodic=False)

if __name__ == "__main__":
    sys.exit(main(SPEC))
