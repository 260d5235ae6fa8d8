"""Who writes what: deduplicate replicated chunks and balance bytes over ranks (pure, no MPI)."""

from __future__ import annotations

from dataclasses import dataclass


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


def check_coverage(global_shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """None if the (offset, shape) boxes cover every element of ``global_shape`` exactly once, else why not."""
    import numpy as np

    count = np.zeros(global_shape, dtype=np.int32)
    for off, shp in boxes:
        sl = tuple(slice(o, o + s) for o, s in zip(off, shp))
        count[sl] += 1
    if count.size and count.min() == 0:
        return f"{int((count == 0).sum())} elements not covered"
    if count.size and count.max() > 1:
        return f"{int((count > 1).sum())} elements covered more than once"
    return None
