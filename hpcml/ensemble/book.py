"""The driver's record of every simulation of one run, in a few bytes each.

The pool (:mod:`hpcml.ensemble.simpool`) makes a :class:`~hpcml.ensemble.simpool.Sim`
for a simulation when it hands it to Parsl and folds it into this book when its task
ends; nothing else of a simulation stays in memory. Per simulation the book keeps its
outcome and its attempts in this run (a byte each, by position in the run's
:class:`~hpcml.ensemble.members.Specs`), plus running totals -- so a campaign of 10^5
members holds ~200 KB here, and the driver's memory does not grow with the members
(``benchmarks/campaign_scale.py``).
"""

from __future__ import annotations

import random
from itertools import islice
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from hpcml.idset import SHOWN, IdSet
from hpcml.ensemble.members import Specs

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ensemble.simpool import Sim

OUTCOMES = ("pending", "running", "completed", "failed", "cancelled")
PENDING, RUNNING, COMPLETED, FAILED, CANCELLED = range(5)
CODE = {name: k for k, name in enumerate(OUTCOMES)}


class Reservoir:
    """A uniform sample of at most ``size`` values (a seeded reservoir): a median over 10^5
    simulations without keeping 10^5 figures."""

    def __init__(self, size: int = 4096) -> None:
        self.size, self.seen, self.values = size, 0, []
        self._rng = random.Random(0)

    def add(self, v: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(v)
        elif (k := self._rng.randrange(self.seen)) < self.size:
            self.values[k] = v

    def median(self) -> float | None:
        v = sorted(self.values)
        return v[len(v) // 2] if v else None


class Book:
    """Outcome and attempts of every simulation of a run, by position."""

    def __init__(self, specs: Specs) -> None:
        self.specs = specs
        self.outcome = bytearray(len(specs))
        self.tries = bytearray(len(specs))  # attempts in this run, 255 at most
        self.counts = [len(specs), 0, 0, 0, 0]
        self.skipped = IdSet()
        """Completed in an earlier run of the campaign (resume): not run again."""
        self.first: dict[int, int] = {}
        """Position -> the attempt number this run starts from, where not 0 (a resume)."""
        self.retried = 0
        self.samples_sent = 0
        self.overheads = Reservoir()

    def __len__(self) -> int:
        return len(self.outcome)

    def extend(self, specs) -> range:
        """Simulations added to the run (a wave); their positions."""
        got = self.specs.extend(specs)
        self.outcome.extend(bytes(len(got)))
        self.tries.extend(bytes(len(got)))
        self.counts[PENDING] += len(got)
        return got

    def set(self, pos: int, code: int) -> None:
        self.counts[self.outcome[pos]] -= 1
        self.counts[code] += 1
        self.outcome[pos] = code

    def skip(self, pos: int) -> None:
        """Completed by an earlier run: counted completed, never handed to Parsl."""
        self.set(pos, COMPLETED)
        self.skipped.add(self.specs.sim_id(pos))

    def pending(self) -> Iterator[int]:
        """Positions still to run, in order (read as they are handed out)."""
        return (p for p in range(len(self.outcome)) if self.outcome[p] == PENDING)

    def fold(self, s: Sim) -> None:
        """An ended (or given-up) simulation's outcome, attempts and figures; the Sim may go."""
        self.set(s.pos, CODE.get(s.outcome, CANCELLED))
        n = min(255, len(s.recorded))
        if n > 1 >= self.tries[s.pos]:
            self.retried += 1
        self.tries[s.pos] = n
        self.samples_sent += sum(r["samples_sent"] for r in s.recorded.values()
                                 if r["status"] == "ok" and isinstance(r["samples_sent"], int))
        if s.finished and (d := [r["duration_s"] for r in s.recorded.values()]) and None not in d:
            self.overheads.add((s.finished - s.submitted) - sum(d))

    def cancel_pending(self) -> None:
        for p in range(len(self.outcome)):
            if self.outcome[p] == PENDING:
                self.set(p, CANCELLED)

    def ids(self, *codes: int) -> IdSet:
        """The ids of the simulations whose outcome is one of ``codes``."""
        out = IdSet()
        want = set(codes)
        for p, ids in self._runs():
            if self.outcome[p] in want:
                out.add(ids)
        return out

    def retried_ids(self) -> IdSet:
        return IdSet(i for p, i in self._runs() if self.tries[p] > 1)

    def all_done(self) -> bool:
        return self.counts[COMPLETED] == len(self.outcome)

    def _runs(self) -> Iterator[tuple[int, int]]:
        return enumerate(self.specs.ids())

    def attempts(self) -> Attempts:
        return Attempts(self)


class Attempts(Mapping[int, int]):
    """Attempts made in this run, per simulation id (a view of a :class:`Book`; equal to
    the dict it reads as)."""

    def __init__(self, book: Book) -> None:
        self._book = book

    def __getitem__(self, sim_id: int) -> int:
        pos = self._book.specs.position(sim_id)
        if pos is None:
            raise KeyError(sim_id)
        return self._book.tries[pos]

    def __iter__(self) -> Iterator[int]:
        return self._book.specs.ids()

    def __len__(self) -> int:
        return len(self._book.tries)

    def __repr__(self) -> str:
        head = list(islice(self.items(), SHOWN))
        return "{" + ", ".join(f"{k}: {v}" for k, v in head) + (", ..." if len(self) > SHOWN else "") + "}"

    def __deepcopy__(self, memo) -> dict[int, int]:
        """A plain dict: ``dataclasses.asdict`` (which copies what it does not know) then gives
        what ``json.dumps`` takes."""
        return dict(self.items())
