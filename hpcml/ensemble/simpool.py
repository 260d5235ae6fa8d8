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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcml.outcome import FINAL_SUFFIX, read_final_error
from hpcml.ensemble import attempts, bundles
from hpcml.errors import ConfigError
from hpcml.ensemble.spec import SimSpec
from hpcml.log import get_logger

logger = get_logger(__name__)


@dataclass(kw_only=True)
class Sim:
    spec: SimSpec
    dir: Path
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

    def __init__(self, campaign, run_dir: Path, sims: list[Sim], *,
                 check: Callable[[], None], stopping: Callable[[], bool], show: Callable[[], None]) -> None:
        self.c, self.run_dir, self.sims = campaign, run_dir, sims
        self.sims_dir = run_dir / "sims"
        self._check, self._stopping, self._show = check, stopping, show
        self.inflight: dict[concurrent.futures.Future, Sim | bundles.BundleTask] = {}
        self.run_id = "run"
        """This run's id: names its bundles' directories."""
        self.on_complete: Callable[[Sim], None] = lambda s: None

    def run(self, pending: list[Sim], app, more: Callable[[], list[Sim] | None] | None = None) -> None:
        """Until every one of ``pending`` has ended, or a stop (then the running ones are cancelled).
        ``more()`` (waves of an adaptive campaign) is asked, whenever nothing waits to be
        submitted, for simulations to add: a list (empty: not yet), or None once there are no more."""
        queue = deque(pending)
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
                s = queue.popleft()
                s.submitted, s.outcome = time.monotonic(), "running"
                if s.spec.entry is not None:  # members run in-process, up to `bundle` of them a task
                    members = [s]
                    while queue and len(members) < self.c.bundle and queue[0].spec.entry == s.spec.entry:
                        members.append(queue.popleft())
                        members[-1].submitted, members[-1].outcome = s.submitted, "running"
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

    def cancel(self) -> None:
        """Stop running attempts (the wrappers see CANCEL within a second) and wait for them."""
        (self.sims_dir / attempts.CANCEL_FILE).touch()
        for s in self.sims:
            if s.outcome == "pending":
                s.outcome = "cancelled"
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
                continue
            self.record(s, final=True)
            s.outcome = "cancelled"
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
            self.on_complete(s)
        elif cancelled or (self.sims_dir / attempts.CANCEL_FILE).exists():
            s.outcome = "cancelled"
        else:
            s.outcome = "failed"
            s.final_error = read_final_error(s.dir)
            if s.final_error is not None:  # every other simulation would fail the same way: stop here
                raise ConfigError(f"simulation {s.spec.sim_id} failed on a deterministic error, not retried (a "
                                  f"retry or a resume would fail the same way): {s.final_error}")
            logger.warning("simulation %d failed after %d attempt(s): %s", s.spec.sim_id, len(s.recorded),
                           attempts.describe(exc))

    def _finish_bundle(self, task: bundles.BundleTask, fut: concurrent.futures.Future, cancelled: bool) -> None:
        exc = fut.exception()
        bundles.settle(task, self.run_dir, self.c.sim_prefix(1), None if cancelled else exc)
        for s in task.sims:
            if s.outcome == "completed":
                self.on_complete(s)
        final = [s for s in task.sims if s.final_error is not None]
        if final:  # every other member would fail the same way: stop here
            s = final[0]
            raise ConfigError(f"simulation {s.spec.sim_id} failed on a deterministic error, not retried (a retry or "
                              f"a resume would fail the same way): {s.final_error}")
        failed = [s.spec.sim_id for s in task.sims if s.outcome == "failed"]
        if failed:
            logger.warning("bundle %s: %d member(s) failed: %s%s", task.dir.name, len(failed), failed[:10],
                           f" ({attempts.describe(exc)})" if exc is not None else "")

    def record(self, s: Sim, *, final: bool, exc: BaseException | None = None, ok: bool = False) -> None:
        spec = s.spec
        s.claimed = attempts.record_ended(self.run_dir, s.dir, sim_id=spec.sim_id, params=spec.params,
                                          argv=spec.command(), launch=self.c.sim_prefix(spec.ranks), first=s.first,
                                          recorded=s.recorded, final=final, exc=exc, ok=ok)

    def counts(self) -> dict[str, int]:
        """For the progress line: completed, running (an attempt started, not ended), failed,
        cancelled, retried."""
        out = {o: sum(s.outcome == o for s in self.sims) for o in ("completed", "failed", "cancelled")}
        out["running"] = sum(s.running() for s in self.inflight.values())
        out["retried"] = sum(s.claimed > 1 for s in self.sims)
        return out

    def overheads(self) -> list[float]:
        """Per simulation: time in Parsl minus time running attempts (sorted)."""
        return sorted((s.finished - s.submitted) - sum(d) for s in self.sims
                      if s.finished and (d := [r["duration_s"] for r in s.recorded.values()]) and None not in d)
