"""The simulations of one campaign run: submitted through Parsl at most ``max_concurrent`` at a
time, every ended attempt recorded, cancelled together on a stop.

Counts for the progress line are what the simulations are doing, not what was handed to
Parsl: *running* means an attempt has started (its wrapper claimed ``attempt_K.start``)
and not ended -- a site that runs one simulation at a time shows 1 running, however many
wait in Parsl's queue -- and cancelled simulations are not counted as failed.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hpcml.outcome import FINAL_SUFFIX, failed_alike, read_final_error
from hpcml.ensemble import attempt_text, attempts, bundles
from hpcml.ensemble.book import CANCELLED, COMPLETED, FAILED, RUNNING, Book
from hpcml.errors import ConfigError
from hpcml.ensemble.spec import SimSpec
from hpcml.log import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True)
class Sim:
    """A simulation while it is in flight (made when it is handed to Parsl, folded into the
    run's :class:`~hpcml.ensemble.book.Book` when its task ends)."""

    spec: SimSpec
    dir: Path
    pos: int = -1
    """Its position in the run's simulations (the book's index)."""
    first: int = 0
    """Attempt number this run's first attempt gets (attempts continue across re-runs)."""
    streams: bool = False
    """It streams to the campaign's training job."""
    submitted: float = 0.0
    finished: float = 0.0
    recorded: dict[int, dict] = field(default_factory=dict)
    claimed: int = 0
    """Attempts claimed so far in this run (ended or not)."""
    outcome: str = "pending"
    skipped: bool = False
    """Completed in an earlier run of this campaign (resume): not run again."""
    final_error: str | None = None
    """The deterministic error that ended it (its producer's, :func:`hpcml.contract.write_final_error`)."""

    def running(self) -> bool:
        """An attempt of it has started and not ended."""
        k = self.first + self.claimed - 1
        return (self.outcome == "running" and self.claimed > 0 and (self.dir / f"attempt_{k}.start").exists()
                and not (self.dir / f"attempt_{k}.end").exists())


class SimPool:
    """Submits, watches, records and cancels the simulations of one run."""

    def __init__(self, campaign, run_dir: Path, book: Book, make: Callable[[int], Sim], *,
                 check: Callable[[], None], stopping: Callable[[], bool], show: Callable[[], None]) -> None:
        self.c, self.run_dir, self.book, self._make = campaign, run_dir, book, make
        self.sims_dir = run_dir / "sims"
        self._check, self._stopping, self._show = check, stopping, show
        self.inflight: dict[concurrent.futures.Future, Sim | bundles.BundleTask] = {}
        self.run_id = "run"
        """This run's id: names its bundles' directories."""
        self.on_complete: Callable[[Sim], None] = lambda s: None

    def run(self, pending: Iterable[int], app, more: Callable[[], Iterable[int] | None] | None = None) -> None:
        """Until every one of ``pending`` (positions in the book, read as they are handed out)
        has ended, or a stop (then the running ones are cancelled). ``more()`` (waves of an
        adaptive campaign) is asked, whenever nothing waits to be submitted, for simulations
        to add: positions (none: not yet), or None once there are no more."""
        queue = _Queue(pending, self._make)
        while queue or self.inflight or more is not None:
            self._check()
            if self._stopping():
                self.cancel()
                return
            if not queue and more is not None:
                extra = more()
                if extra is None:
                    more = None
                    continue
                queue.extend(extra)
            while queue and len(self.inflight) < self.c.max_concurrent:
                s = queue.pop()
                self._running(s)
                if s.spec.entry is not None:  # members run in-process, up to `bundle` of them a task
                    members = [s]
                    while len(members) < self.c.bundle and queue and queue.peek().spec.entry == s.spec.entry:
                        members.append(queue.pop())
                        self._running(members[-1], s.submitted)
                    self._submit_bundle(members, app)
                    continue
                for old in s.dir.glob(f"attempt_*{FINAL_SUFFIX}"):  # an earlier run's: this one may have fixed it
                    old.unlink(missing_ok=True)
                limit = math.ceil(self.c.sim_timeout_s) if self.c.sim_timeout_s else 0
                fut = app(str(s.dir), s.spec.sim_id, self.c.sim_prefix(s.spec.ranks), s.spec.command(), limit,
                          math.ceil(self.c.cancel_grace_s),
                          parsl_resource_specification=self.c.resource_spec(s.spec.ranks))
                self.inflight[fut] = s
            if not self.inflight:  # waiting for the next wave: nothing to wait on
                time.sleep(self.c.poll_s)
            done, _ = concurrent.futures.wait(list(self.inflight), timeout=self.c.poll_s,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                self.finish(self.inflight.pop(fut), fut)
            for s in self.inflight.values():
                if not isinstance(s, bundles.BundleTask):
                    self.record(s, final=False)
            self._show()

    def _running(self, s: Sim, at: float | None = None) -> None:
        s.submitted, s.outcome = at if at is not None else time.monotonic(), "running"
        self.book.set(s.pos, RUNNING)

    def cancel(self) -> None:
        """Stop running attempts (the wrappers see CANCEL within a second) and wait for them."""
        (self.sims_dir / attempts.CANCEL_FILE).touch()
        self.book.cancel_pending()
        if not self.inflight:
            return
        logger.warning("cancelling %d running simulation(s)", len(self.inflight))
        done, not_done = concurrent.futures.wait(list(self.inflight), timeout=self.c.cancel_grace_s + 15)
        for fut in done:
            self.finish(self.inflight.pop(fut), fut, cancelled=True)
        for fut in not_done:
            s = self.inflight.pop(fut)
            if isinstance(s, bundles.BundleTask):
                bundles.settle(s, self.run_dir, self.c.sim_prefix(1), None)
                for m in s.sims:
                    self.book.fold(m)
                continue
            self.record(s, final=True)
            s.outcome = "cancelled"
            self.book.fold(s)
            logger.error("simulation %d did not stop within %.0f s of cancellation", s.spec.sim_id,
                         self.c.cancel_grace_s + 15)

    def _submit_bundle(self, members: list[Sim], app) -> None:
        task = bundles.start(members, self.run_dir, self.run_id, self.c.retries,
                             {s.spec.sim_id: s.first for s in members})
        limit = math.ceil(self.c.sim_timeout_s * len(members)) if self.c.sim_timeout_s else 0
        fut = app(str(task.dir), members[0].spec.sim_id, self.c.sim_prefix(1), bundles.argv(task), limit,
                  math.ceil(self.c.cancel_grace_s), parsl_resource_specification=self.c.resource_spec(1))
        self.inflight[fut] = task

    def finish(self, s, fut: concurrent.futures.Future, *, cancelled: bool = False) -> None:
        if isinstance(s, bundles.BundleTask):
            return self._finish_bundle(s, fut, cancelled)
        s.finished = time.monotonic()
        exc = fut.exception()
        self.record(s, final=True, exc=exc, ok=exc is None)
        if exc is None:
            s.outcome = "completed"
        elif cancelled or (self.sims_dir / attempts.CANCEL_FILE).exists():
            s.outcome = "cancelled"
        else:
            s.outcome = "failed"
            s.final_error = read_final_error(s.dir)
        self.book.fold(s)
        if s.outcome == "completed":
            self.on_complete(s)
        elif s.final_error is not None:  # every other simulation would fail the same way: stop here
            raise _deterministic(s)
        elif s.outcome == "failed":
            alike = failed_alike(str(s.dir), len(s.recorded)) if len(s.recorded) < self.c.retries + 1 else None
            logger.warning("simulation %d failed after %d attempt(s)%s: %s", s.spec.sim_id, len(s.recorded),
                           " (the same exception twice: not retried again)" if alike else "",
                           attempt_text.describe(exc))

    def _finish_bundle(self, task: bundles.BundleTask, fut: concurrent.futures.Future, cancelled: bool) -> None:
        exc = fut.exception()
        bundles.settle(task, self.run_dir, self.c.sim_prefix(1), None if cancelled else exc)
        for s in task.sims:
            self.book.fold(s)
        for s in task.sims:
            if s.outcome == "completed":
                self.on_complete(s)
        final = [s for s in task.sims if s.final_error is not None]
        if final:  # every other member would fail the same way: stop here
            raise _deterministic(final[0])
        failed = [s.spec.sim_id for s in task.sims if s.outcome == "failed"]
        if failed:
            logger.warning("bundle %s: %d member(s) failed: %s%s", task.dir.name, len(failed), failed[:10],
                           f" ({attempt_text.describe(exc)})" if exc is not None else "")

    def record(self, s: Sim, *, final: bool, exc: BaseException | None = None, ok: bool = False) -> None:
        spec = s.spec
        s.claimed = attempts.record_ended(self.run_dir, s.dir, sim_id=spec.sim_id, params=spec.params,
                                          argv=spec.command(), launch=self.c.sim_prefix(spec.ranks), first=s.first,
                                          recorded=s.recorded, final=final, exc=exc, ok=ok)

    def counts(self) -> dict[str, int]:
        """For the progress line: completed, running (an attempt started, not ended), failed,
        cancelled, retried."""
        n = self.book.counts
        running = sum(s.running() for s in self.inflight.values())
        retried = self.book.retried + sum(s.claimed > 1 for s in self.inflight.values() if isinstance(s, Sim))
        return {"completed": n[COMPLETED], "failed": n[FAILED], "cancelled": n[CANCELLED], "running": running,
                "retried": retried}


class _Queue:
    """The positions still to submit, made into Sims one at a time (with one looked ahead, to
    group a bundle's members)."""

    def __init__(self, positions: Iterable[int], make: Callable[[int], Sim]) -> None:
        self._parts: deque[Iterator[int]] = deque([iter(positions)])
        self._make = make
        self._next: Sim | None = None

    def extend(self, positions: Iterable[int]) -> None:
        self._parts.append(iter(positions))

    def peek(self) -> Sim | None:
        while self._next is None and self._parts:
            pos = next(self._parts[0], None)
            if pos is None:
                self._parts.popleft()
            else:
                self._next = self._make(pos)
        return self._next

    def pop(self) -> Sim:
        s = self.peek()
        self._next = None
        return s

    def __bool__(self) -> bool:
        return self.peek() is not None


def _deterministic(s) -> ConfigError:
    """The campaign's end on a simulation's deterministic error: what the next run must change."""
    return ConfigError(f"simulation {s.spec.sim_id} failed on a deterministic error, not retried (a retry, or a "
                       f"resume before its cause is fixed, would fail the same way): {s.final_error}")
