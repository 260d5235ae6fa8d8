"""Issue 39: a simulation's ranks' blocks tile its grid -- checked where it starts streaming, so
an overlapping or gapped decomposition is a deterministic mistake named at once (the trainer
dropped each of its samples as ``incomplete_cover`` until the campaign ended, then advised a resume)."""

from __future__ import annotations

from mpi4py import MPI

from hpcml.stream.tiling import gather_blocks, tiling_problem


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    return [(r * n // parts, (r + 1) * n // parts - r * n // parts) for r in range(parts)]


def test_an_exact_tiling_passes_and_each_mistake_is_named():
    # 25 x 12 x 12 over 3 ranks as 8/8/9 planes, and a 2-D 4 x 3 grid of uneven blocks
    rows = _split(25, 3)
    g = [(25, 12, 12)] * 3
    assert tiling_problem(g, [(o, 0, 0) for o, _ in rows], [(n, 12, 12) for _, n in rows]) is None
    xs, ys = _split(10, 4), _split(7, 3)
    offs = [(ox, oy) for ox, _ in xs for oy, _ in ys]
    sizes = [(nx, ny) for _, nx in xs for _, ny in ys]
    assert tiling_problem([(10, 7)] * 12, offs, sizes) is None
    # rank 1 one plane early: overlaps rank 0 (and leaves none out: the count alone would miss it)
    over = tiling_problem(g, [(0, 0, 0), (7, 0, 0), (17, 0, 0)], [(8, 12, 12), (9, 12, 12), (8, 12, 12)])
    assert over == ("rank 0's block at offset (0, 0, 0) of local_shape (8, 12, 12) and rank 1's at (7, 0, 0) of "
                    "(9, 12, 12) overlap: each point of global_shape (25, 12, 12) must come from one rank")
    gap = tiling_problem(g, [(0, 0, 0), (8, 0, 0), (17, 0, 0)], [(8, 12, 12), (8, 12, 12), (8, 12, 12)])
    assert gap == ("the 3 ranks' blocks cover 3456 of the 3600 points of global_shape (25, 12, 12) (some by "
                   "none): they must tile the grid exactly")
    grid = tiling_problem([(25, 12, 12), (24, 12, 12)], [(0, 0, 0), (8, 0, 0)], [(8, 12, 12), (16, 12, 12)])
    assert grid == ("rank 1 sends global_shape (24, 12, 12), rank 0 (25, 12, 12): every rank's must be the "
                    "whole grid's")
    # touching blocks (end == the next one's offset) are not an overlap, in every dimension
    assert tiling_problem([(4, 4)] * 4, [(0, 0), (0, 2), (2, 0), (2, 2)], [(2, 2)] * 4) is None


def test_thousands_of_ranks_are_checked():
    """4,096 ranks of a 2-D decomposition: tiled, and one block moved into its neighbour's named
    (its time, 0.3-0.5 s here, is in docs/benchmarks.md, not asserted)."""
    xs = _split(4096, 64)
    offs = [(ox, oy) for ox, _ in xs for oy, _ in xs]
    sizes = [(nx, ny) for _, nx in xs for _, ny in xs]
    assert tiling_problem([(4096, 4096)] * len(offs), offs, sizes) is None
    offs[-1] = (offs[-1][0] - 1, offs[-1][1])  # the last rank's block one row up: into its neighbour's
    assert "rank 4031's block" in tiling_problem([(4096, 4096)] * len(offs), offs, sizes)


def test_gathered_on_one_rank_and_refusing_a_comm_that_is_not_mpi4pys():
    got = gather_blocks(MPI.COMM_SELF, (25, 12), (3, 0), (22, 12), timeout_s=5)
    assert got == ([(25, 12)], [(3, 0)], [(22, 12)])

    class Fake:
        def Get_size(self):
            return 2
    assert gather_blocks(Fake(), (4,), (0,), (2,), timeout_s=1) is None
