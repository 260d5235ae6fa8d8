"""Whether a simulation's ranks' blocks tile its grid -- every point sent by exactly one rank --
checked where the simulation starts streaming (:meth:`hpcml.stream.Producer.from_campaign`), so
a decomposition that overlaps or leaves points out is a deterministic mistake named at once,
not a trainer dropping every sample as ``incomplete_cover`` until the campaign ends."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from hpcml.stream.message import MAX_DIMS

#: Ranks past which overlaps are not looked for pairwise (the count of points still is).
MAX_PAIRWISE = 8192


def tiling_problem(global_shapes: Sequence[Sequence[int]], offsets: Sequence[Sequence[int]],
                   shapes: Sequence[Sequence[int]]) -> str | None:
    """Why rank ``r``'s block (``offsets[r]``, ``shapes[r]``) of ``global_shapes[r]`` and the
    others' do not tile one grid, or None. Each block is assumed inside its grid (the Producer's
    own check, :func:`hpcml.stream.message.box_problem`)."""
    g = tuple(global_shapes[0])
    for r, other in enumerate(global_shapes):
        if tuple(other) != g:
            return f"rank {r} sends global_shape {tuple(other)}, rank 0 {g}: every rank's must be the whole grid's"
    lo, size = np.array(offsets, np.int64), np.array(shapes, np.int64)
    hi = lo + size
    n = len(lo)
    for i in range(min(n, MAX_PAIRWISE) - 1):
        hit = np.all((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i]), axis=1)
        if hit.any():
            j = i + 1 + int(np.argmax(hit))
            return (f"rank {i}'s block at offset {_t(lo[i])} of local_shape {_t(size[i])} and rank {j}'s at "
                    f"{_t(lo[j])} of {_t(size[j])} overlap: each point of global_shape {g} must come from one rank")
    covered, total = int(size.prod(axis=1).sum()), math.prod(g)
    if covered != total:
        return (f"the {n} ranks' blocks cover {covered} of the {total} points of global_shape {g} "
                f"({'some twice' if covered > total else 'some by none'}): they must tile the grid exactly")
    return None


def _t(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def gather_blocks(comm, global_shape: Sequence[int], offset: Sequence[int], local_shape: Sequence[int],
                  timeout_s: float) -> tuple[list, list, list] | None:
    """Every rank's (global shapes, offsets, local shapes) of ``comm``, gathered without blocking
    for more than ``timeout_s`` (None then: a rank that never makes its Producer does not hang this
    one; nor does a ``comm`` that is not an mpi4py communicator)."""
    if not hasattr(comm, "Iallgather"):
        return None
    row = np.zeros(1 + 3 * MAX_DIMS, np.int64)
    d = len(global_shape)
    row[0] = d
    for k, v in enumerate((global_shape, offset, local_shape)):
        row[1 + k * MAX_DIMS:1 + k * MAX_DIMS + d] = v
    out = np.empty((comm.Get_size(), row.size), np.int64)
    req = comm.Iallgather(row, out)
    deadline = time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)
    dims = [int(x) for x in out[:, 0]]
    cols = [[tuple(int(v) for v in out[r, 1 + k * MAX_DIMS:1 + k * MAX_DIMS + dims[r]]) for r in range(len(out))]
            for k in range(3)]
    return cols[0], cols[1], cols[2]
