"""Who writes what: deduplicate replicated chunks and balance bytes over ranks (pure, no MPI)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcml.numeric import is_int


@dataclass(frozen=True)
class ChunkMeta:
    """One rectangular piece of a global tensor as one rank holds it."""

    name: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def key(self) -> tuple:
        return (self.name, self.offset, self.shape)

    @property
    def dataset(self) -> str:
        """Dataset path of this chunk inside a shard file."""
        return f"{self.name}/@" + "_".join(map(str, self.offset))


def assign_owners(per_rank: list[list[ChunkMeta]]) -> dict[tuple, int]:
    """Chunk key -> the one rank that writes it.

    A chunk several ranks hold alike (a replicated tensor, a tp-replicated norm, a DDP
    replica) is written once. Largest chunks are placed first, each on the candidate with
    the fewest bytes so far (ties: lowest rank) -- every rank computes the same answer.
    """
    holders: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    for rank, chunks in enumerate(per_rank):
        for c in chunks:
            holders.setdefault(c.key, []).append(rank)
            size[c.key] = c.nbytes
    load = [0] * len(per_rank)
    owner: dict[tuple, int] = {}
    for key in sorted(holders, key=lambda k: (-size[k], k)):
        best = min(holders[key], key=lambda r: (load[r], r))
        owner[key] = best
        load[best] += size[key]
    return owner


def fused_spec(attrs) -> tuple[list, object] | None:
    """(widths, dim) when tensor attributes ``attrs`` (a dict, or an HDF5 dataset's
    ``attrs``) declare a fused tensor (``fused_widths``, ``fused_dim`` default 0), else None.
    Numbers come back as Python ints; :func:`check_fused` judges the rest."""
    if attrs is None or "fused_widths" not in attrs or attrs["fused_widths"] is None:
        return None
    raw = attrs["fused_widths"]
    try:
        widths = [int(w) if isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)) else w
                  for w in raw]
    except TypeError:  # not a sequence
        widths = [raw]
    dim = attrs["fused_dim"] if "fused_dim" in attrs else 0
    return widths, int(dim) if isinstance(dim, (int, np.integer)) and not isinstance(dim, (bool, np.bool_)) else dim


def check_fused(name: str, widths, dim: int, global_shape: tuple[int, ...], shards: int) -> str | None:
    """None if a fused tensor's declaration fits it, else a one-line reason naming the tensor.

    ``widths``: the sub-parameter sizes along ``dim`` (e.g. q, k, v rows); ``shards``: how
    many tensor-parallel shards hold each sub-parameter's own slice (1: not interleaved).
    """
    widths = list(widths)
    if not widths or not all(is_int(w) and w > 0 for w in widths):
        return f"fused tensor {name}: fused_widths {widths} must be a non-empty list of positive integers"
    if not is_int(dim) or not 0 <= dim < len(global_shape):
        return f"fused tensor {name}: fused_dim {dim} is not a dimension of its shape {list(global_shape)}"
    if sum(widths) != global_shape[dim]:
        return (f"fused tensor {name}: fused_widths {widths} sum to {sum(widths)}, but its size on "
                f"fused_dim {dim} is {global_shape[dim]} (shape {list(global_shape)})")
    if any(w % shards for w in widths):
        return (f"fused tensor {name}: fused_widths {widths} are not all divisible by its {shards} "
                f"tensor-parallel shards on dim {dim}; uneven sub-parameter shards are not supported")
    return None


def fused_runs(widths, shards: int, start: int, length: int) -> list[tuple[int, int, int]]:
    """Where the rows ``[start, start + length)`` of a rank-interleaved fused tensor lie in its
    logical layout, as ``(local offset, logical offset, length)`` runs along the fused dim.

    A fused tensor ``cat([w_0, w_1, ...])`` (widths ``W_k``) sharded ``n = shards`` ways
    holds on shard ``s`` the block ``[w_0 shard s; w_1 shard s; ...]`` of ``sum(W)/n`` rows,
    so its *physical* (DTensor-global) row ``p = s*sum(W)/n + c_k + q`` (``c_k =
    sum_{j<k} W_j/n``, ``0 <= q < W_k/n``) is *logical* row ``S_k + s*W_k/n + q`` with
    ``S_k = sum_{j<k} W_j``. Runs adjacent in both are merged, so ``shards == 1`` (no
    interleave) gives one run. ``start``/``length`` may cover part of a block (a further
    data-parallel shard of the tp shard) or several blocks.
    """
    widths = list(widths)
    block = sum(widths) // shards
    sub = [w // shards for w in widths]
    runs: list[tuple[int, int, int]] = []
    p, end = start, start + length
    while p < end:
        s, q = divmod(p, block)
        k, c = 0, 0
        while q >= c + sub[k]:
            c += sub[k]
            k += 1
        n = min(end, s * block + c + sub[k]) - p
        logical = sum(widths[:k]) + s * sub[k] + (q - c)
        if runs and runs[-1][0] + runs[-1][2] == p - start and runs[-1][1] + runs[-1][2] == logical:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((p - start, logical, n))
        p += n
    return runs


def fused_boxes(widths, dim: int, shards: int, offset: tuple[int, ...], shape: tuple[int, ...],
                ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The pieces of a local block (DTensor-global ``offset``, ``shape``) of a fused tensor
    interleaved over ``shards`` tensor-parallel ranks: ``(start in the local block along dim,
    logical offset, shape)`` each -- what the writer stores and the reader reads."""
    return [(lo, offset[:dim] + (logical,) + offset[dim + 1:], shape[:dim] + (n,) + shape[dim + 1:])
            for lo, logical, n in fused_runs(widths, shards, offset[dim], shape[dim])]
