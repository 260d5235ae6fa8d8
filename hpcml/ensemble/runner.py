"""One execution of :meth:`hpcml.ensemble.campaign.Campaign.run`: the mutable state and the loop.

Order of things: claim the run directory for the campaign, prepare it, start the trainer,
load Parsl, wait for the trainer's ready file, submit simulations (at most
``max_concurrent`` in flight), write ``sims_done.json``, wait for the trainer; with no
simulations (offline training) Parsl is never loaded. A walltime warning (SIGUSR1/SIGTERM)
at any point: stop submitting, cancel what runs, ask the trainer to save and stop (SIGUSR1, in
that order, so the trainer's last save holds every sample of every finished simulation),
return ``interrupted``.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcml import stop
from hpcml.ensemble import attempts, watchdog
from hpcml.ensemble.apps import simulation_app
from hpcml.ensemble.attempts import SIMS_DONE_FILE
from hpcml.ensemble.campaign import Campaign, claim_run_dir, executor_label
from hpcml.ensemble.progress import ProgressLine, last_json_line
from hpcml.ensemble.spec import CampaignResult, SimSpec, TrainingJob
from hpcml.ensemble.trainer_proc import TrainerProcess
from hpcml.env import NOT_FINISHED
from hpcml.errors import LaunchError
from hpcml.log import get_logger

logger = get_logger(__name__)

#: Seconds before the walltime at which the campaign stops by itself if no warning came:
#: time for the trainer's last save and the driver's report.
SAVE_MARGIN_S = 60.0
#: Seconds before the walltime by which a trainer asked to stop must be gone.
LAST_SECONDS_S = 5.0
#: A trainer's save window after a stop request when there is no walltime (a signal to a local driver).
SAVE_WINDOW_S = 120.0


@dataclass(kw_only=True)
class _Sim:
    spec: SimSpec
    dir: Path
    first: int
    """Attempt number this run's first attempt gets (attempts continue across re-runs)."""
    submitted: float = 0.0
    finished: float = 0.0
    recorded: dict[int, dict] = field(default_factory=dict)
    claimed: int = 0
    """Attempts claimed so far in this run (ended or not)."""
    outcome: str = "pending"
    skipped: bool = False
    """Completed in an earlier run of this campaign (resume): not run again."""


class Run:
    """One execution of :meth:`Campaign.run`; holds the mutable state."""

    def __init__(self, c: Campaign, sims: list[SimSpec], training: TrainingJob | None, ready_file: Path | None, *,
                 ready_timeout_s: float | None, train_timeout_s: float | None, resume: bool,
                 kept: set[int] | Callable[[], Collection[int]] | None = None) -> None:
        self.c, self.training, self.ready_file, self.resume, self.kept = c, training, ready_file, resume, kept
        self.ready_timeout_s, self.train_timeout_s = ready_timeout_s, train_timeout_s
        self.run_dir: Path = c.run_dir  # type: ignore[assignment]
        self.sims_dir = self.run_dir / "sims"
        self.sims = [_Sim(spec=s, dir=attempts.sim_dir(self.run_dir, s.sim_id), first=0) for s in sims]
        self.prov_path = self.run_dir / attempts.PROVENANCE_FILE
        self.trainer: TrainerProcess | None = None
        self.parsl_load_s = 0.0
        self.retries: int | None = None
        self.error: str | None = None
        self.stop_reason: str | None = None
        self.deadline: float | None = c.deadline
        self.campaign_id: str | None = None
        self.held = False
        """The run directory held this campaign before this run (it continues: ``HPCML_RESUME``)."""
        self.progress = ProgressLine(len(sims), enabled=c.progress, every_s=c.progress_every_s)

    # -- time and stopping ------------------------------------------------------------------------
    def _save_window(self) -> float:
        """Seconds a trainer asked to stop has to save: until just before the walltime."""
        if self.deadline is None:
            return SAVE_WINDOW_S
        return self.deadline - time.time() - LAST_SECONDS_S

    def _stopping(self) -> bool:
        """True once the campaign must stop: a walltime warning reached the driver, the
        walltime is ``SAVE_MARGIN_S`` away and none came, or the trainer stopped itself."""
        if self.stop_reason is None:
            if self.c.handle_signals and stop.requested():
                self.stop_reason = stop.requested()
            elif self.deadline is not None and time.time() > self.deadline - SAVE_MARGIN_S:
                self.stop_reason = f"walltime: {SAVE_MARGIN_S:.0f} s left and no warning came"
            if self.stop_reason is not None:
                logger.warning("%s: stopping the campaign: cancelling simulations, then the trainer saves and "
                               "stops", self.stop_reason)
        return self.stop_reason is not None

    # -- orchestration --------------------------------------------------------------------------
    def execute(self) -> CampaignResult:
        t0 = time.monotonic()
        self.started_at = time.time()
        previous = stop.install() if self.c.handle_signals else {}
        try:
            return self._execute(t0)
        finally:
            stop.restore(previous)

    def _execute(self, t0: float) -> CampaignResult:
        alloc = self.c.allocation()
        if alloc is not None and self.deadline is None:
            self.deadline = alloc.deadline
        train_hosts: tuple[str, ...] = ()
        sim_hosts: tuple[str, ...] = ()
        if alloc is not None:
            train_hosts, sim_hosts = alloc.split(self.training.nodes if self.training else 0, sims=bool(self.sims))
            logger.info("one allocation (job %s): training on %s, simulations on %s", alloc.job_id,
                        ",".join(train_hosts) or "-", ",".join(sim_hosts) or "-")
        self.campaign_id, self.held = claim_run_dir(self.run_dir, [s.spec for s in self.sims], self.training,
                                                    resume=self.resume)
        self._prepare()
        try:
            if self.ready_file is not None:
                self.ready_file.unlink(missing_ok=True)  # a stale one would send sims to an old trainer
            if self.training is not None:
                pilot = alloc is None
                self.trainer = TrainerProcess(self.training,
                                              line=lambda job: self.c.train_line(job, train_hosts, allocate=pilot),
                                              run_dir=self.run_dir, env=self._trainer_env(),
                                              grace_s=self.c.cancel_grace_s)
                self.trainer.start(append=self.resume)
            pending = [s for s in self.sims if not s.skipped]
            if pending:
                self._run_parsl(pending, sim_hosts)
            else:
                self._wait_ready()
            if self.sims and not self._stopping():
                self._write_sims_done()
            if self.trainer is not None:
                self._wait_trainer()
        except BaseException as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
            if self.trainer is not None:
                self.trainer.stop()
            raise
        finally:
            self.progress.close()
            result = self._result(time.monotonic() - t0)
            # a training-only run (offline) keeps the simulations' record
            attempts.write_json(self.run_dir / ("campaign.json" if self.sims else "training.json"),
                                self._summary(result))
        return result

    def _run_parsl(self, pending: list[_Sim], sim_hosts: tuple[str, ...]) -> None:
        import parsl

        cfg = self.c.make_config([s.spec for s in pending] or [s.spec for s in self.sims], sim_hosts)
        self.retries = getattr(cfg, "retries", None)
        label = executor_label(cfg)
        t = time.monotonic()
        try:
            parsl.load(cfg)
        except Exception as e:
            hint = "; a Campaign loads its own: clean up the other first" if "already" in str(e) else ""
            raise LaunchError(f"parsl.load failed ({type(e).__name__}: {e}){hint}") from e
        self.parsl_load_s = time.monotonic() - t
        logger.info("Parsl loaded in %.2f s (executor %s, retries %s)", self.parsl_load_s, label, self.retries)
        try:
            self._wait_ready()
            self._run_sims(pending, simulation_app([label]))
        except BaseException:
            self._cancel_inflight()
            raise
        finally:
            try:
                parsl.dfk().cleanup()
            finally:
                parsl.clear()

    def _wait_ready(self) -> None:
        if self.ready_file is not None:
            local = self.c.site is None or self.c.site.scheduler == "local"
            timeout = self.ready_timeout_s if self.ready_timeout_s is not None else 300.0 if local else None
            self.trainer.wait_ready(self.ready_file, timeout, stop_requested=self._stopping)

    def _prepare(self) -> None:
        if not self.sims:  # training alone: the simulations' files stay as they are
            return
        env = {"HPCML_RUN_DIR": str(self.run_dir), "HPCML_CAMPAIGN_ID": self.campaign_id,
               watchdog.ENV_DRIVER_PID: str(os.getpid()), watchdog.ENV_DRIVER_HOST: socket.gethostname(), **self.c.env}
        attempts.prepare(self.sims_dir, env)
        attempts.clear_cancel(self.sims_dir)
        (self.run_dir / SIMS_DONE_FILE).unlink(missing_ok=True)
        done = set(attempts.completed_sims(self.run_dir)) if self.resume else set()
        kept = self.kept() if callable(self.kept) else self.kept  # read once the directory is known to be ours
        skip = done & set(kept) if kept is not None else done
        lost = done - skip
        for s in self.sims:
            s.dir.mkdir(exist_ok=True)
            s.first = attempts.next_attempt(s.dir)
            if s.spec.sim_id in skip:
                s.outcome, s.skipped = "completed", True
        if done:
            logger.info("resuming: %d of %d simulation(s) completed earlier and are not run again%s",
                        sum(s.skipped for s in self.sims), len(self.sims),
                        f"; {len(lost)} finished after the last save and run again: {sorted(lost)}" if lost else "")

    def _trainer_env(self) -> dict[str, str]:
        env = {"HPCML_RUN_DIR": str(self.run_dir), "HPCML_N_SIMS": str(len(self.sims)),
               "HPCML_SIMS_DONE_FILE": str(self.run_dir / SIMS_DONE_FILE), "HPCML_CAMPAIGN_ID": self.campaign_id,
               "HPCML_RESUME": "1" if self.resume and self.held else "0"}
        if self.deadline is not None:
            env["HPCML_JOB_DEADLINE"] = f"{self.deadline:.0f}"
        return env

    # -- training job -----------------------------------------------------------------------------
    def _check_trainer(self) -> None:
        """While simulations remain: a trainer that stopped ends the campaign (restarted first
        after a failure while allowed); exit 75 means it was told to stop (interrupted)."""
        t = self.trainer
        if t is None or t.poll() is None or (not self._stopping() and t.restart_if_allowed()):
            return
        rc = t.returncode
        if rc == NOT_FINISHED:
            self.stop_reason = self.stop_reason or "trainer saved and stopped (exit 75)"
            return
        what = f"exited with code {rc}" if rc != 0 else "exited with code 0 before the simulations were done"
        self.error = t.message(what)
        raise LaunchError(self.error)

    def _wait_trainer(self) -> None:
        t = self.trainer
        rc = t.wait(timeout_s=self.train_timeout_s, tick=self._show, poll_s=self.c.poll_s,
                    stop_requested=self._stopping, save_window=self._save_window)
        self._show(force=True)
        if rc == NOT_FINISHED:
            self.stop_reason = self.stop_reason or "trainer saved and stopped (exit 75)"
        elif rc != 0 and self.stop_reason is not None:  # the last periodic checkpoint is what resumes
            logger.error(t.message(f"exited with code {rc} while stopping, not 75: the next run resumes from "
                                   f"its last periodic checkpoint"))
        elif rc != 0:
            self.error = t.message(f"exited with code {rc}")
            raise LaunchError(self.error)

    # -- simulations --------------------------------------------------------------------------
    def _run_sims(self, pending: list[_Sim], app) -> None:
        queue = deque(pending)
        self.inflight: dict[concurrent.futures.Future, _Sim] = {}
        while queue or self.inflight:
            self._check_trainer()
            if self._stopping():
                self._cancel_inflight()
                return
            while queue and len(self.inflight) < self.c.max_concurrent:
                s = queue.popleft()
                s.submitted, s.outcome = time.monotonic(), "running"
                limit = math.ceil(self.c.sim_timeout_s) if self.c.sim_timeout_s else 0
                fut = app(str(s.dir), s.spec.sim_id, self.c.sim_prefix(s.spec.ranks), s.spec.command(), limit,
                          math.ceil(self.c.cancel_grace_s),
                          parsl_resource_specification=self.c.resource_spec(s.spec.ranks))
                self.inflight[fut] = s
            done, _ = concurrent.futures.wait(list(self.inflight), timeout=self.c.poll_s,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                self._finish(self.inflight.pop(fut), fut)
            for s in self.inflight.values():
                self._record_attempts(s, final=False)
            self._show()
        self._show(force=True)

    def _cancel_inflight(self) -> None:
        """Stop running attempts (the wrappers see CANCEL within a second) and wait for them."""
        inflight = getattr(self, "inflight", {})
        (self.sims_dir / attempts.CANCEL_FILE).touch()
        for s in self.sims:
            if s.outcome == "pending":
                s.outcome = "cancelled"
        if not inflight:
            return
        logger.warning("cancelling %d running simulation(s)", len(inflight))
        done, not_done = concurrent.futures.wait(list(inflight), timeout=self.c.cancel_grace_s + 15)
        for fut in done:
            self._finish(inflight.pop(fut), fut, cancelled=True)
        for fut in not_done:
            s = inflight.pop(fut)
            self._record_attempts(s, final=True)
            s.outcome = "cancelled"
            logger.error("simulation %d did not stop within %.0f s of cancellation", s.spec.sim_id,
                         self.c.cancel_grace_s + 15)

    def _finish(self, s: _Sim, fut: concurrent.futures.Future, *, cancelled: bool = False) -> None:
        s.finished = time.monotonic()
        exc = fut.exception()
        self._record_attempts(s, final=True, exc=exc, ok=exc is None)
        if exc is None:
            s.outcome = "completed"
        elif cancelled or (self.sims_dir / attempts.CANCEL_FILE).exists():
            s.outcome = "cancelled"
        else:
            s.outcome = "failed"
            logger.warning("simulation %d failed after %d attempt(s): %s", s.spec.sim_id, len(s.recorded),
                           attempts.describe(exc))

    def _record_attempts(self, s: _Sim, *, final: bool, exc: BaseException | None = None, ok: bool = False) -> None:
        spec = s.spec
        s.claimed = attempts.record_ended(self.run_dir, s.dir, sim_id=spec.sim_id, params=spec.params,
                                          argv=spec.command(), launch=self.c.sim_prefix(spec.ranks), first=s.first,
                                          recorded=s.recorded, final=final, exc=exc, ok=ok)

    # -- reporting ------------------------------------------------------------------------------
    def _show(self, force: bool = False) -> None:
        if not self.progress.due(force):
            return
        counts = {o: sum(s.outcome == o for s in self.sims) for o in ("completed", "running", "failed", "cancelled")}
        train = None
        if self.trainer is not None and self.trainer.proc is not None:
            rec = last_json_line(self.run_dir / "metrics.jsonl")
            step = rec.get("step") if rec else None
            train = f"train step {step if step is not None else '-'}"
            if self.trainer.poll() is not None:
                train += f" (exited {self.trainer.returncode})"
        self.progress.update(force=force, done=counts["completed"], running=counts["running"],
                             failed=counts["failed"] + counts["cancelled"],
                             retried=sum(s.claimed > 1 for s in self.sims), train=train)

    def _write_sims_done(self) -> None:
        attempts.write_json(self.run_dir / SIMS_DONE_FILE, {
            "completed": [s.spec.sim_id for s in self.sims if s.outcome == "completed"],
            "failed": [s.spec.sim_id for s in self.sims if s.outcome != "completed"]})

    def _result(self, wall_s: float) -> CampaignResult:
        overheads = sorted((s.finished - s.submitted) - sum(d) for s in self.sims
                           if s.finished and (d := [r["duration_s"] for r in s.recorded.values()]) and None not in d)
        by = lambda o: [s.spec.sim_id for s in self.sims if s.outcome == o]  # noqa: E731
        complete = all(s.outcome == "completed" for s in self.sims) and (
            self.trainer is None or self.trainer.returncode == 0)
        interrupted = self.stop_reason is not None and not complete  # a late warning changes nothing done
        return CampaignResult(
            run_dir=str(self.run_dir), total=len(self.sims), completed=by("completed"), failed=by("failed"),
            cancelled=[s.spec.sim_id for s in self.sims if s.outcome in ("cancelled", "pending", "running")],
            attempts={s.spec.sim_id: len(s.recorded) for s in self.sims},
            retried=[s.spec.sim_id for s in self.sims if len(s.recorded) > 1],
            samples_sent=sum(r["samples_sent"] or 0 for s in self.sims for r in s.recorded.values()
                             if r["status"] == "ok" and isinstance(r["samples_sent"], int)),
            wall_s=round(wall_s, 3), parsl_load_s=round(self.parsl_load_s, 3),
            task_overhead_s=round(overheads[len(overheads) // 2], 4) if overheads else None,
            training_returncode=self.trainer.returncode if self.trainer else None, error=self.error,
            skipped=[s.spec.sim_id for s in self.sims if s.skipped], interrupted=interrupted,
            campaign_id=self.campaign_id)

    def _summary(self, r: CampaignResult) -> dict:
        d = asdict(r)
        d["attempts"] = {str(k): v for k, v in r.attempts.items()}
        d.update(version=1, status=r.status, started=attempts.iso(self.started_at), ended=attempts.iso(time.time()),
                 host=socket.gethostname(), max_concurrent=self.c.max_concurrent, retries=self.retries,
                 sim_timeout_s=self.c.sim_timeout_s, provenance=self.prov_path.name, ok=r.ok,
                 stop_reason=self.stop_reason, deadline=self.deadline, pid=os.getpid(),
                 training=None if self.trainer is None else self.trainer.summary())
        return d
