"""Gray-Scott reaction-diffusion on a periodic grid, MPI-parallel.

    du/dt = Du lap(u) - u v^2 + F (1 - u)
    dv/dt = Dv lap(v) + u v^2 - (F + k) v

Grid units (spacing 1, as in Pearson's 1993 patterns with Du = 2 Dv), explicit Euler, periodic
boundaries on a periodic Cartesian communicator. Start: u = 1, v = 0, with three squares of
u = 1/2, v = 1/4 placed by ``seed`` and 1 % noise, computed in closed form from global indices,
so the run is the same on any number of ranks.

    mpiexec -n 4 python -m kernels.gray_scott --nx 256 --ny 256 --steps 5000 --every 500 --out gs.h5
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from hpcml.errors import ConfigError
from kernels.common import (Decomposition, GridConfig, KernelSpec, Sink, Stencil, check_min, decompose,
                            global_indices, main, march, new_state, param, stable_dt)

FIELDS = ["u", "v"]
N_SQUARES = 3


@dataclass(frozen=True, kw_only=True)
class GrayScottConfig(GridConfig):
    """One Gray-Scott run. ``repr()`` rebuilds it."""

    F: float = param(0.04, "feed rate of u (>= 0)")
    k: float = param(0.06, "kill rate of v (>= 0)")
    Du: float = param(0.2, "diffusivity of u, in cells^2 per time unit (> 0)")
    Dv: float = param(0.1, "diffusivity of v (> 0)")
    seed: int = param(0, "places the initial squares and the noise (>= 0)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_min(self, "Du", "Dv")
        check_min(self, "F", "k", strict=False)
        seed = self.seed
        if isinstance(seed, float) and seed.is_integer():
            object.__setattr__(self, "seed", int(seed))  # JSON numbers arrive as floats
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {seed!r}")
        self.time_step  # noqa: B018 - validates dt against the stability limit

    @property
    def time_step(self) -> float:
        return stable_dt(self.dt, max(self.Du, self.Dv), 1.0, 1.0, what="max(Du, Dv)")


def _hash_uniform(seed: int, stream: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) numbers from global indices (SplitMix64 finaliser): the same on any decomposition."""
    with np.errstate(over="ignore"):
        z = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(stream) * np.uint64(0xD1B54A32D192ED03)
             + i.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
             + j.astype(np.uint64) * np.uint64(0x94D049BB133111EB))
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(mult)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def initial_state(cfg: GrayScottConfig, decomp: Decomposition) -> np.ndarray:
    """``state[2, lx + 2, ly + 2]`` (u, v): seeded squares plus noise, from global indices only."""
    i, j = global_indices(decomp)
    nx, ny = decomp.global_shape
    centres = np.random.default_rng(cfg.seed).random((N_SQUARES, 2)) * (nx, ny)  # a few draws, same on every rank
    half = max(1, min(nx, ny) // 10)
    mask = np.zeros(decomp.local_shape, dtype=bool)
    for cx, cy in centres:
        dx, dy = np.abs(i - int(cx)), np.abs(j - int(cy))
        mask |= (np.minimum(dx, nx - dx) <= half) & (np.minimum(dy, ny - dy) <= half)  # periodic distance
    state = new_state(decomp, 2)
    u, v = state[0, 1:-1, 1:-1], state[1, 1:-1, 1:-1]
    u[...] = np.where(mask, 0.5, 1.0) + 0.01 * (_hash_uniform(cfg.seed, 0, i, j) - 0.5)
    v[...] = np.where(mask, 0.25, 0.0) * (1.0 + 0.04 * (_hash_uniform(cfg.seed, 1, i, j) - 0.5))
    return state


def run(comm: MPI.Comm, cfg: GrayScottConfig, sink: Sink | None = None, *,
        decomp: Decomposition | None = None) -> np.ndarray:
    """Run on ``comm`` (collective); returns this rank's final interior fields ``[2, lx, ly]`` (u, v).

    ``decomp`` reuses a periodic decomposition already made on ``comm``. The caller owns
    ``sink`` and closes it.
    """
    decomp = decomp if decomp is not None else decompose(comm, cfg.nx, cfg.ny, periodic=True)
    state, dt = initial_state(cfg, decomp), cfg.time_step
    u, v = state[0, 1:-1, 1:-1], state[1, 1:-1, 1:-1]
    stencil = Stencil(decomp.local_shape)
    du, dv, r = (np.empty(decomp.local_shape) for _ in range(3))
    cu, cv, feed, loss = cfg.Du * dt, cfg.Dv * dt, cfg.F * dt, (cfg.F + cfg.k) * dt

    def advance() -> None:  # ufuncs with out=: in place, no temporaries
        stencil.diffusion(state[0], cu, cu, out=du)
        stencil.diffusion(state[1], cv, cv, out=dv)
        np.multiply(v, v, out=r)
        np.multiply(r, u, out=r)
        np.multiply(r, dt, out=r)  # dt u v^2: what the reaction moves from u to v
        np.subtract(du, r, out=du)
        np.add(dv, r, out=dv)
        np.subtract(1.0, u, out=r)
        np.multiply(r, feed, out=r)
        np.add(du, r, out=du)
        np.multiply(v, loss, out=r)
        np.subtract(dv, r, out=dv)
        np.add(u, du, out=u)
        np.add(v, dv, out=v)

    march(state, decomp, advance, cfg=cfg, names=FIELDS, sink=sink)
    return state[:, 1:-1, 1:-1].copy()


SPEC = KernelSpec(name="gray_scott", description=__doc__.split("\n")[0], config=GrayScottConfig, run=run,
                  fields=FIELDS, periodic=True)

if __name__ == "__main__":
    sys.exit(main(SPEC))
