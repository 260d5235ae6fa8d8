"""A kernel's grid: the domain decomposition over MPI ranks, the halo exchange, the explicit
5-point stencil and its stable time step (numpy and mpi4py only).

Conventions: a global field has shape ``(nx, ny)``, index ``[i, j]`` with ``i`` along x. A rank
holds its block with one ghost layer, as one float64 array ``state[f, lx + 2, ly + 2]`` for all
``f`` fields, so one halo exchange serves every field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcml.errors import ConfigError
from hpcml.waiting import wait_all

#: Fraction of the explicit stability limit used when no ``dt`` is given.
DT_SAFETY = 0.8


# --------------------------------------------------------------------------- decomposition


@dataclass(frozen=True, kw_only=True)
class Decomposition:
    """This rank's block of a 2-D grid on a Cartesian communicator."""

    global_shape: tuple[int, int]
    """(nx, ny) of the whole grid."""
    offset: tuple[int, int]
    """Global index (x0, y0) of this rank's first interior cell."""
    local_shape: tuple[int, int]
    """(lx, ly) interior cells on this rank."""
    dims: tuple[int, int]
    """Ranks along x and y."""
    coords: tuple[int, int]
    """This rank's position in the process grid."""
    periodic: bool
    """Whether both axes wrap around."""
    comm: Any = field(compare=False, repr=False)
    """The Cartesian communicator (``MPI.Cartcomm``)."""

    @property
    def interior(self) -> tuple[slice, slice]:
        """The global index of this rank's block, for slicing a global array."""
        (x0, y0), (lx, ly) = self.offset, self.local_shape
        return slice(x0, x0 + lx), slice(y0, y0 + ly)


def split_extent(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of block ``index`` when ``n`` cells are split into ``parts`` blocks.

    The remainder goes to the first blocks, so sizes differ by at most one.
    """
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def grid_dims(nx: int, ny: int, size: int) -> tuple[int, int]:
    """Ranks along (x, y) for ``size`` ranks (``MPI.Compute_dims``), checked against the grid.

    Pure arithmetic (no communicator): the same answer and the same error on every rank.
    """
    dims = tuple(MPI.Compute_dims(size, 2))
    for axis, n, d in (("x", nx, dims[0]), ("y", ny, dims[1])):
        if n < d:
            raise ConfigError(f"n{axis}={n} is smaller than the {d} ranks along {axis} "
                              f"(process grid {dims[0]}x{dims[1]} for {size} ranks): expected n{axis} >= {d}")
    return dims  # type: ignore[return-value]


def block(nx: int, ny: int, dims: Sequence[int], coords: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offset, local_shape) of the block at ``coords`` in a ``dims`` process grid."""
    (x0, lx), (y0, ly) = split_extent(nx, dims[0], coords[0]), split_extent(ny, dims[1], coords[1])
    return (x0, y0), (lx, ly)


def decompose(comm: MPI.Comm, nx: int, ny: int, periodic: bool) -> Decomposition:
    """Split an ``nx`` x ``ny`` grid over ``comm`` on a new Cartesian communicator.

    Validation comes before ``Create_cart`` (the first collective), so bad sizes raise the
    same :class:`ConfigError` on every rank and nothing hangs.
    """
    dims = grid_dims(nx, ny, comm.Get_size())
    cart = comm.Create_cart(dims, periods=[periodic, periodic], reorder=False)
    coords = tuple(cart.Get_coords(cart.Get_rank()))
    offset, local_shape = block(nx, ny, dims, coords)
    return Decomposition(global_shape=(nx, ny), offset=offset, local_shape=local_shape, dims=dims,
                         coords=coords, periodic=periodic, comm=cart)  # type: ignore[arg-type]


class Halo:
    """Fills the ghost layer of ``state[f, lx + 2, ly + 2]`` from the neighbouring ranks.

    MPI subarray datatypes describe the edge rows and (strided) columns in place, so nothing
    is copied by hand; all eight messages are in flight at once (a 5-point stencil needs no
    corners). A neighbour beyond a non-periodic edge is ``MPI.PROC_NULL``: its ghost cells
    keep what the kernel put there (the boundary condition).
    """

    def __init__(self, decomp: Decomposition, n_fields: int) -> None:
        self.comm = decomp.comm
        lx, ly = decomp.local_shape
        sizes = [n_fields, lx + 2, ly + 2]

        def sub(subsizes: list[int], starts: list[int]) -> MPI.Datatype:
            return MPI.DOUBLE.Create_subarray(sizes, subsizes, starts).Commit()

        # Per axis: (lower neighbour, upper neighbour, send-low, send-high, recv-low, recv-high).
        self._plan = []
        for axis, (rows, n) in enumerate((([n_fields, 1, ly], lx), ([n_fields, lx, 1], ly))):
            at = (lambda k: [0, k, 1]) if axis == 0 else (lambda k: [0, 1, k])
            lo, hi = self.comm.Shift(axis, 1)
            sends, recvs = (sub(rows, at(1)), sub(rows, at(n))), (sub(rows, at(0)), sub(rows, at(n + 1)))
            self._plan.append((axis, lo, hi, *sends, *recvs))

    def exchange(self, state: np.ndarray) -> None:
        """Post every receive and send, then wait (without spinning a core: a neighbour may be
        held up by the stream's backpressure); ``state`` must be C-contiguous float64."""
        reqs = []
        for axis, lo, hi, send_lo, send_hi, recv_lo, recv_hi in self._plan:
            up, down = 2 * axis, 2 * axis + 1  # tags: a rank may be both neighbours, or itself
            reqs.append(self.comm.Irecv([state, 1, recv_lo], source=lo, tag=up))
            reqs.append(self.comm.Irecv([state, 1, recv_hi], source=hi, tag=down))
            reqs.append(self.comm.Isend([state, 1, send_hi], dest=hi, tag=up))
            reqs.append(self.comm.Isend([state, 1, send_lo], dest=lo, tag=down))
        wait_all(reqs)

    def free(self) -> None:
        for _, _, _, *types in self._plan:
            for t in types:
                t.Free()
        self._plan = []


# --------------------------------------------------------------------------- numerics


def stable_dt(dt: float | None, diffusivity: float, dx: float, dy: float, what: str) -> float:
    """``dt`` checked against the explicit 2-D diffusion limit, or a safe one when ``None``.

    Forward Euler on the 5-point Laplacian is stable for
    ``dt <= 1 / (2 D (1/dx^2 + 1/dy^2))`` (``dx^2 / (4 D)`` on a square grid).
    """
    limit = 1.0 / (2.0 * diffusivity * (1.0 / dx**2 + 1.0 / dy**2))
    if dt is None:
        return DT_SAFETY * limit
    if not dt > 0:
        raise ConfigError(f"dt must be > 0, got {dt}")
    if dt > limit:
        raise ConfigError(f"dt={dt:.6g} is unstable: expected dt <= {limit:.6g} "
                          f"(explicit limit 1/(2 {what} (1/dx^2 + 1/dy^2)) with dx={dx:.6g}, dy={dy:.6g})")
    return dt


class Stencil:
    """The 5-point diffusion increment, vectorised into preallocated buffers (no temporaries)."""

    def __init__(self, local_shape: tuple[int, int]) -> None:
        self._tmp = np.empty(local_shape)

    def diffusion(self, g: np.ndarray, cx: float, cy: float, out: np.ndarray) -> np.ndarray:
        """``out = cx (g[i+1] + g[i-1] - 2g) + cy (g[j+1] + g[j-1] - 2g)`` on the interior of ghosted ``g``.

        With ``cx = D dt / dx^2`` this is the forward-Euler increment of ``D * laplacian``.
        The same operations in the same order on every cell, whatever the decomposition, so
        results agree bitwise across rank counts.
        """
        c, t = g[1:-1, 1:-1], self._tmp
        np.add(g[2:, 1:-1], g[:-2, 1:-1], out=out)
        out -= c
        out -= c
        out *= cx
        np.add(g[1:-1, 2:], g[1:-1, :-2], out=t)
        t -= c
        t -= c
        t *= cy
        out += t
        return out


def new_state(decomp: Decomposition, n_fields: int) -> np.ndarray:
    """Zeroed ``state[n_fields, lx + 2, ly + 2]``: this rank's block of every field with its ghost layer."""
    lx, ly = decomp.local_shape
    return np.zeros((n_fields, lx + 2, ly + 2))


def global_indices(decomp: Decomposition) -> tuple[np.ndarray, np.ndarray]:
    """Global (i, j) index arrays of this rank's interior, for closed-form initial conditions."""
    sx, sy = decomp.interior
    return np.ogrid[sx, sy]
