"""Issue 39: a simulation's ranks' blocks gathered over its real communicator (non-blocking, with a
deadline) and checked alike on every rank: an overlap is named the same everywhere, before any send."""

from __future__ import annotations

from hpcml.stream.tiling import gather_blocks, tiling_problem


def _rows(n: int, rank: int, size: int) -> tuple[int, int]:
    lo = rank * n // size
    return lo, (rank + 1) * n // size - lo


def test_every_rank_gathers_every_block_and_names_the_same_overlap(comm):
    rank, size = comm.rank, comm.size
    lo, n = _rows(25, rank, size)
    got = gather_blocks(comm, (25, 12), (lo, 0), (n, 12), timeout_s=60)
    assert got is not None
    assert got[1] == [(_rows(25, r, size)[0], 0) for r in range(size)]
    assert got[2] == [(_rows(25, r, size)[1], 12) for r in range(size)]
    assert tiling_problem(*got) is None
    if rank == size - 1:  # the last rank sends a halo row of its neighbour's as its own
        lo, n = lo - 1, n + 1
    bad = gather_blocks(comm, (25, 12), (lo, 0), (n, 12), timeout_s=60)
    problem = tiling_problem(*bad)
    assert problem is not None and f"rank {size - 2}'s block" in problem and f"rank {size - 1}'s at" in problem
    assert comm.allgather(problem) == [problem] * size  # named alike on every rank
