"""Do a tensor's pieces tile it exactly once? The manifest's one geometric check, on piece
boxes a crafted manifest may hold by the hundred thousand: O(n log n), never pairwise over all
pieces, never anything of the tensor's size. numpy only."""

from __future__ import annotations

import math

import numpy as np


def coverage(shape: tuple[int, ...], boxes) -> str | None:
    """None if the (offset, shape) boxes inside ``shape`` cover it exactly once, else why
    not. ``boxes``: a list of (offset, shape) pairs, or the two as (n, d) int64 arrays.
    Equal volumes and no two boxes overlapping is exactly once; the overlap test is
    :func:`_disjoint`, O(n log n) per pass in time and O(n) in memory, never pairwise over
    all pieces and never anything of the tensor's size."""
    if isinstance(boxes, tuple):
        lo, size = boxes
    else:
        lo = np.asarray([o for o, _ in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
        size = np.asarray([s for _, s in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    total = math.prod(shape)
    covered = sum(math.prod(s) for s in size.tolist())
    if covered > total:
        return f"pieces overlap: they hold {covered} elements, the tensor {total}"
    if covered != total:
        return f"{total - covered} of {total} elements not covered by any piece"
    if len(lo) > 1 and len(shape):
        return _disjoint(lo, lo + size)
    return None


MAX_PASSES_PER_DIM = 4
SMALL_GROUP = 64


def _disjoint(lo: np.ndarray, hi: np.ndarray) -> str | None:
    """None if no two boxes ``[lo, hi)`` overlap, else why not.

    Every layout a save makes is a nest of slabs (a dimension cut into intervals, each cut
    again along others: sharding, fused sub-parameters), so the boxes are split into groups
    that a cut along one dimension separates -- one sort per pass, all groups at once --
    until each group holds one box. Boxes that no cut separates are tested pairwise when
    few, and refused when many (no save lays pieces out like that)."""
    n, d = lo.shape
    gid = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    idle, k = 0, 0
    for _ in range(MAX_PASSES_PER_DIM * d + 8):
        if not alive.any() or idle >= d:
            break
        idx = np.flatnonzero(alive)
        g, a, b = gid[idx], lo[idx, k], hi[idx, k]
        order = np.lexsort((a, g))
        idx, g, a, b = idx[order], g[order], a[order], b[order]
        vals = np.unique(np.concatenate([a, b]))
        ra, rb = np.searchsorted(vals, a), np.searchsorted(vals, b)
        span = len(vals) + 1
        reach = np.maximum.accumulate(g * span + rb) - g * span  # furthest end so far in the group
        first = np.ones(len(idx), dtype=bool)
        first[1:] = g[1:] != g[:-1]
        cut = np.zeros(len(idx), dtype=bool)
        cut[1:] = ~first[1:] & (reach[:-1] <= ra[1:])
        idle = 0 if cut.any() else idle + 1
        newg = np.cumsum(first | cut) - 1 + (gid.max() + 1)
        gid[idx] = newg
        sizes = np.bincount(newg - newg[0]) if len(newg) else np.zeros(0, np.int64)
        alive[idx] = sizes[newg - newg[0]] > 1
        k = (k + 1) % d
    if not alive.any():
        return None
    idx = np.flatnonzero(alive)
    for group in np.split(idx[np.argsort(gid[idx], kind="stable")],
                          np.flatnonzero(np.diff(np.sort(gid[idx]))) + 1):
        if len(group) > SMALL_GROUP:
            return (f"pieces overlap, or {len(group)} of them are laid out in no slabs a save makes: "
                    f"refused rather than tested pairwise")
        gl, gh = lo[group], hi[group]
        over = np.all((gl[:, None] < gh[None]) & (gl[None] < gh[:, None]), axis=-1)
        np.fill_diagonal(over, False)
        if over.any():
            return "pieces overlap: some elements are covered more than once"
    return None
