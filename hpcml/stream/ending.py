"""When the stream of one trainer rank has ended, and what it should have held.

Two sources say what each simulation sent. Its ranks' ``end`` markers (the Producer's
``n_sent`` per rank, for the latest attempt), and the driver's done record
(:class:`hpcml.contract.DoneRecord`: which simulations completed, which failed, and how many
samples each completed one streamed, from its Producer's own record). The stream of a rank
ends once the done record is in and every completed simulation routed to it is
*settled*: all its samples are in (its expected count is known and reached), or -- the
count unknown -- every one of its ranks sent its end marker. A simulation that is not
settled ``grace_s`` after the done record arrived no longer holds the stream up: the stream
ends, and what is missing is counted (:meth:`EndTracker.expected` against the samples
ingested), never silently.

A completed simulation that streamed nothing (no Producer: run without streaming) is
settled at once with nothing expected, so a campaign whose simulations never stream ends
its trainer's stream as soon as the driver says so; one that closed no Producer at all is
*silent* in the done record, and the training fails naming it. The grace starts again
whenever a sample arrives: a slow last block is waited for, a dead sender is not. Pure
logic: no sockets, no threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from hpcml.contract import DoneRecord
from hpcml.stream.routing import route


class EndTracker:
    """End markers and the done record of one trainer rank's simulations."""

    def __init__(self, rank: int, n_trainers: int, grace_s: float) -> None:
        self.rank, self.n_trainers, self.grace_s = rank, n_trainers, grace_s
        self.ends: dict[int, dict[int, int]] = {}
        """sim -> {sim rank: messages it sent} for its latest attempt."""
        self.nranks: dict[int, int] = {}
        self.done: DoneRecord | None = None
        self.done_at: float | None = None
        self.progress_at = 0.0
        """When a sample last arrived: the grace runs from the later of that and the done record."""

    def new_attempt(self, sim: int) -> None:
        self.ends.pop(sim, None)

    def end_marker(self, sim: int, rank: int, nranks: int, n_sent: int) -> None:
        self.ends.setdefault(sim, {})[rank] = n_sent
        self.nranks[sim] = nranks

    def campaign_done(self, record: DoneRecord) -> None:
        if self.done is None:
            self.done_at = time.monotonic()
        self.done = record

    def progress(self) -> None:
        """A sample arrived: what is still missing may be on its way, the grace starts again."""
        self.progress_at = time.monotonic()

    def silent(self) -> list[int]:
        """Completed simulations routed here that should have streamed and closed no Producer."""
        return [s for s in (self.done.silent if self.done else []) if self.mine(s)]

    def mine(self, sim: int) -> bool:
        return route(sim, self.n_trainers) == self.rank

    def expected(self) -> dict[int, int | None]:
        """Samples each completed streaming simulation routed here should have given (None:
        unknown); empty until the done record is in."""
        if self.done is None:
            return {}
        streamed = self.done.streamed
        out: dict[int, int | None] = {}
        for sim in self.done.completed:
            if not self.mine(sim) or (streamed is not None and sim not in streamed):
                continue
            ends = self.ends.get(sim)
            counts = [c for c in ((streamed or {}).get(sim), max(ends.values()) if ends else None) if c is not None]
            out[sim] = max(counts) if counts else None
        return out

    def _settled(self, sim: int, expected: int | None, ingested: int) -> bool:
        if expected is not None:
            return ingested >= expected
        ends = self.ends.get(sim, {})
        return bool(ends) and len(ends) >= self.nranks.get(sim, 1 << 30)

    def unsettled(self, ingested: Callable[[int], int]) -> list[int]:
        return [s for s, n in self.expected().items() if not self._settled(s, n, ingested(s))]

    def ended(self, ingested: Callable[[int], int], now: float | None = None) -> tuple[bool, list[int]]:
        """(whether the stream has ended, the simulations it ends without)."""
        if self.done is None:
            return False, []
        waiting = self.unsettled(ingested)
        now = time.monotonic() if now is None else now
        if waiting and now - max(self.done_at, self.progress_at) < self.grace_s:
            return False, waiting
        return True, waiting

    # -- checkpoint ------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"ends": {str(k): {str(r): n for r, n in v.items()} for k, v in self.ends.items()},
                "nranks": {str(k): v for k, v in self.nranks.items()},
                "done": self.done.to_json() if self.done is not None else None}

    def load_state(self, meta: Mapping, keep: Callable[[int], bool]) -> None:
        for k, v in (meta.get("ends") or {}).items():
            if keep(int(k)):
                self.ends[int(k)] = {int(r): int(n) for r, n in v.items()}
        for k, v in (meta.get("nranks") or {}).items():
            if keep(int(k)):
                self.nranks[int(k)] = int(v)
        # the done record of a saved run is the end of *that* run: the next run writes its own
