"""Blocks of a simulation's ranks into whole samples, bounded in memory and in time.

A sample of an R-rank simulation is complete when R distinct ranks have sent blocks that
tile its grid exactly: every point covered, none twice (a coverage mask, one byte per
point, catches overlaps that a sum of areas would miss and which would otherwise leave
uninitialised memory in a sample). Until then its blocks wait in memory; senders that
never finish (a crashed rank, a hostile peer) cannot grow that memory: past
``max_bytes`` the least recently touched incomplete sample is evicted, and one no block
has reached for ``timeout_s`` too. Every eviction is reported (the server counts it as
``partial_evicted``: the sample's data never reached training).

Each incomplete sample is charged to the connection whose block opened it (the whole sample
is allocated then, however small the block): past ``peer_bytes`` a connection's block that
would open another is refused (``peer_budget``), and the memory bound evicts from the
connection that holds the most, so one peer cannot push out the others' samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hpcml.stream.message import MessageError

Key = tuple[int, int, int]
"""(simulation, attempt, step)."""


@dataclass
class Partial:
    fields: np.ndarray
    """float32 [n_fields, *global_shape]."""
    covered: np.ndarray
    """bool [*global_shape]: the points some block has written."""
    t: float
    params: np.ndarray
    nranks: int
    ranks: set[int] = field(default_factory=set)
    touched: float = 0.0
    peer: object = None
    """The connection whose block opened it (None: not told)."""

    @property
    def nbytes(self) -> int:
        return self.fields.nbytes + self.covered.nbytes


def sample_bytes(n_fields: int, global_shape: Sequence[int]) -> int:
    """Memory an incomplete sample of this shape holds (fields as float32 plus the mask)."""
    return (4 * n_fields + 1) * math.prod(global_shape)


class Assembler:
    """Incomplete samples by key; ``add`` returns the sample once its last block is in."""

    def __init__(self, n_fields: int, *, max_bytes: int, timeout_s: float,
                 on_evict: Callable[[Key, Partial, str], None], peer_bytes: int | None = None) -> None:
        self.n_fields, self.max_bytes, self.timeout_s, self._on_evict = n_fields, max_bytes, timeout_s, on_evict
        self.peer_bytes = peer_bytes
        self.partials: dict[Key, Partial] = {}
        self.nbytes = 0
        self.held: dict[object, int] = {}
        """Bytes of incomplete samples by the connection that opened them."""
        self._swept = time.monotonic()

    def __len__(self) -> int:
        return len(self.partials)

    def add(self, key: Key, *, rank: int, nranks: int, global_shape: tuple[int, ...], offset: tuple[int, ...],
            shape: tuple[int, ...], t: float, params: np.ndarray, arrays: Sequence[np.ndarray],
            peer: object = None) -> Partial | None:
        """Place one rank's block (sent by connection ``peer``); the whole sample when it
        completes, else None. :class:`MessageError` (``bad_fragment``, ``incomplete_cover``)
        for a block that cannot belong: its sample stays as it was, or is dropped if it can
        no longer be whole; ``peer_budget`` for a block whose sender holds too much to open one."""
        p = self.partials.get(key)
        if p is None:
            need, held = sample_bytes(self.n_fields, global_shape), self.held.get(peer, 0)
            if self.peer_bytes is not None and held + need > self.peer_bytes:
                raise MessageError("peer_budget", f"connection {peer} holds {held} bytes of incomplete samples, "
                                                  f"another of {need} would pass max_peer_bytes={self.peer_bytes}")
            self._make_room(need)
            p = self.partials[key] = Partial(np.empty((self.n_fields, *global_shape), np.float32),
                                             np.zeros(global_shape, bool), t, params, nranks, peer=peer)
            self.nbytes += p.nbytes
            self.held[peer] = self.held.get(peer, 0) + p.nbytes
        if rank in p.ranks or p.fields.shape[1:] != global_shape or p.nranks != nranks:
            raise MessageError("bad_fragment", f"rank {rank} of {nranks}, grid {global_shape}: a block already in, "
                                               f"or not of sample {key} (rank of {p.nranks}, "
                                               f"grid {p.fields.shape[1:]})")
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        if p.covered[box].any():
            self.forget(key)
            raise MessageError("incomplete_cover", f"rank {rank}'s block at {offset} of {shape} overlaps another "
                                                   f"rank's in sample {key}")
        p.covered[box] = True
        for i, a in enumerate(arrays):
            p.fields[(i, *box)] = a
        p.ranks.add(rank)
        p.touched = time.monotonic()
        if len(p.ranks) < p.nranks:
            return None
        self.forget(key)
        if not p.covered.all():
            raise MessageError("incomplete_cover", f"the {nranks} ranks' blocks leave points of sample {key} uncovered")
        return p

    def forget(self, key: Key) -> Partial:
        p = self.partials.pop(key)
        self.nbytes -= p.nbytes
        self.held[p.peer] -= p.nbytes
        if not self.held[p.peer]:
            del self.held[p.peer]
        return p

    def discard_older(self, sim: int, attempt: int) -> int:
        """Drop the incomplete samples of ``sim``'s attempts before ``attempt`` (a retry supersedes them)."""
        stale = [k for k in self.partials if k[0] == sim and k[1] < attempt]
        for k in stale:
            self.forget(k)
        return len(stale)

    def _make_room(self, nbytes: int) -> None:
        """Evict the least recently touched incomplete sample of the connection holding the most."""
        while self.partials and self.nbytes + nbytes > self.max_bytes:
            top = max(self.held, key=self.held.__getitem__)
            mine = (k for k, p in self.partials.items() if p.peer == top)
            self._evict(min(mine, key=lambda k: self.partials[k].touched), "the memory bound")

    def sweep(self) -> None:
        """Evict the incomplete samples untouched for ``timeout_s`` (looks once a second)."""
        now = time.monotonic()
        if now - self._swept < 1.0 or not self.partials:
            return
        self._swept = now
        for k in [k for k, p in self.partials.items() if now - p.touched > self.timeout_s]:
            self._evict(k, f"no block for {self.timeout_s:g} s")

    def _evict(self, key: Key, why: str) -> None:
        self._on_evict(key, self.forget(key), why)
