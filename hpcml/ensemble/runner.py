"""One execution of :meth:`hpcml.ensemble.campaign.Campaign.run`: the mutable state and the loop.

Order of things: claim the run directory (:mod:`hpcml.ensemble.rundir`: refused, or
resumed, before anything is read), write the contract (:mod:`hpcml.contract`) into the
trainer's and the simulations' environments, start the trainer, load Parsl, wait for the
trainer's endpoints, submit simulations (:mod:`hpcml.ensemble.simpool`), write the done
record (with what each simulation streamed), wait for the trainer, read its accounting;
with no simulations (offline training) Parsl is never loaded. A walltime warning
(SIGUSR1/SIGTERM) at any point: stop submitting, cancel what runs, ask the trainer to save
and stop (SIGUSR1, in that order, so the trainer's last save holds every sample of every
finished simulation), return ``interrupted``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from hpcml import stop
from hpcml.contract import DONE_FILE, ENDPOINTS_FILE, ENV, SECRET_FILE, Contract, connections_needed, write_done
from hpcml.ensemble import attempts, ledger, provenance, run_report, rundir
from hpcml.ensemble.apps import simulation_app
from hpcml.ensemble.parsl_build import executor_label
from hpcml.ensemble.progress import ProgressLine, last_json_line
from hpcml.ensemble.book import COMPLETED, FAILED, PENDING, RUNNING, CANCELLED, Book
from hpcml.idset import IdSet
from hpcml.ensemble.members import Specs
from hpcml.ensemble.simpool import Sim, SimPool
from hpcml.ensemble.spec import CampaignResult, SimSpec, TrainingJob, streaming
from hpcml.ensemble.stopping import StopPolicy
from hpcml.ensemble.supervise import TrainerWatch
from hpcml.ensemble.trainer_proc import TrainerProcess
from hpcml.ensemble.waves import Waves, rank_idle
from hpcml.errors import ConfigError, LaunchError
from hpcml.log import get_logger

if TYPE_CHECKING:  # pragma: no cover -- the campaign imports the runner, never the reverse
    from hpcml.ensemble.campaign import Campaign

logger = get_logger(__name__)

#: Between SIGTERM and SIGKILL for a training job that is ended (before a relaunch, or at the end):
#: time to take in what is queued (``quiesce``, 10 s at most) and save it.
TRAINER_SAVE_S = 30.0


class Run:
    """One execution of :meth:`Campaign.run`; holds the mutable state."""

    def __init__(self, c: Campaign, sims: Specs, training: TrainingJob | None, ready_file: Path | None, *,
                 ready_timeout_s: float | None, train_timeout_s: float | None, resume: bool,
                 kept: set[int] | Callable[[], Collection[int]] | None = None, waves: Waves | None = None) -> None:
        self.c, self.training, self.resume, self.kept, self.waves = c, training, resume, kept, waves
        self.ready_timeout_s, self.train_timeout_s = ready_timeout_s, train_timeout_s
        self.run_dir: Path = c.run_dir  # type: ignore[assignment]
        self.streams = streaming(training, ready_file)
        self.ready_file = ready_file if ready_file is not None or not self.streams else self.run_dir / ENDPOINTS_FILE
        self.book = Book(sims)  # every simulation's outcome, a few bytes each; a Sim exists only in flight
        self.stops = StopPolicy(c.deadline, signals=c.handle_signals)
        self.pool = SimPool(c, self.run_dir, self.book, self._sim, check=self._check_trainer,
                            stopping=self.stops.stopping, show=self._show)
        self.pool.on_complete = self._completed
        self.prov_path = self.run_dir / provenance.PROVENANCE_FILE
        self.trainer: TrainerProcess | None = None
        self.watch: TrainerWatch | None = None
        self.contract: Contract | None = None
        self.parsl_load_s = 0.0
        self.retries: int | None = None
        self.error: str | None = None
        self.fixed = len(sims)  # with waves: the simulations of a fixed design run besides them
        self.progress = ProgressLine(self._total(), enabled=c.progress,
                                     every_s=c.progress_every_s)

    # -- what the report reads ------------------------------------------------------------------
    @property
    def stop_reason(self) -> str | None:
        return self.stops.reason

    @property
    def deadline(self) -> float | None:
        return self.stops.deadline

    @property
    def samples(self) -> dict | None:
        """The trainer's accounting of samples (expected, ingested, missing), once read."""
        return self.watch.samples if self.watch is not None else None

    # -- orchestration --------------------------------------------------------------------------
    def execute(self) -> CampaignResult:
        t0 = time.monotonic()
        self.started_at = time.time()
        if len(self.book) or self.waves:
            _refuse_loaded_parsl()  # before the run directory is touched
        previous = stop.install() if self.c.handle_signals else {}
        try:
            return self._execute(t0)
        finally:
            stop.restore(previous)

    def _execute(self, t0: float) -> CampaignResult:
        alloc = self.c.allocation()
        if alloc is not None and self.stops.deadline is None:
            self.stops.deadline = alloc.deadline
        train_hosts: tuple[str, ...] = ()
        sim_hosts: tuple[str, ...] = ()
        if alloc is None:
            self.c.plan_pilot(self.training)  # two jobs within the queues' per-user limits, or refused now
        else:
            train_hosts, sim_hosts = alloc.split(self.training.nodes if self.training else 0,
                                                 sims=bool(len(self.book)) or self.waves is not None)
            logger.info("one allocation (job %s): training on %s, simulations on %s", alloc.job_id,
                        ",".join(train_hosts) or "-", ",".join(sim_hosts) or "-")
        self.claim = rundir.claim(self.run_dir, self.book.specs, self.training,
                                  resume=self.resume, adaptive=self.waves.definition if self.waves else None)
        try:
            if self.waves:  # the waves proposed by an earlier run of this campaign: the same simulations
                self.book.extend(self.waves.open(self.run_dir))
            self.contract = self._contract()
            self.pool.run_id = self.contract.run
            self._prepare()
            return self._go(t0, alloc is None, train_hosts, sim_hosts)
        finally:
            rundir.release(self.run_dir)

    def _go(self, t0: float, pilot: bool, train_hosts: tuple[str, ...], sim_hosts: tuple[str, ...]) -> CampaignResult:
        failure: BaseException | None = None
        try:
            if self.ready_file is not None:
                self.ready_file.unlink(missing_ok=True)  # a stale one would send sims to an old trainer
            if self.training is not None:
                self.trainer = TrainerProcess(self.training,
                                              line=lambda job: self.c.train_line(job, train_hosts, allocate=pilot),
                                              run_dir=self.run_dir, env=self.contract.to_env(),
                                              grace_s=max(self.c.cancel_grace_s, TRAINER_SAVE_S))
                self.trainer.start(append=self.resume)
                contract = self.contract
                self.watch = TrainerWatch(self.trainer, self.stops,
                                          lambda: ledger.samples(ledger.trainer_summary(contract)))
            if self.waves and not self.waves.plan.waves:  # the first wave: no feedback yet
                self._add(self.waves.propose(self.contract))
            if self.book.counts[PENDING] or (self.waves and not self.waves.plan.done):
                self._run_parsl(sim_hosts)
            else:
                self._wait_ready()
            waves_done = not self.waves or self.waves.plan.done
            if (len(self.book) or self.waves) and not self.stops.stopping() and waves_done:
                self._write_done()
            if self.trainer is not None:
                self._wait_trainer()
        except BaseException as e:
            watched = self.watch.error if self.watch is not None else None  # the trainer's own failure line
            self.error, failure = self.error or watched or f"{type(e).__name__}: {e}", e
            if self.trainer is not None:
                self.trainer.stop()
            raise
        finally:
            self.progress.close()
            if self.waves is not None and self.contract is not None:
                try:
                    self.waves.report(self.run_dir, self.contract)
                except Exception as e:  # noqa: BLE001 -- a figure never fails a campaign
                    logger.warning("no waves.png: %s: %s", type(e).__name__, e)
            result = run_report.result(self, time.monotonic() - t0)
            # a training-only run (offline) keeps the simulations' record
            run_report.write_summary(self.run_dir / ("campaign.json" if len(self.book) else "training.json"),
                                     run_report.summary(self, result))
            if failure is not None:
                failure.result = result  # what was done before it failed, for the caller's own report
        return result

    def _run_parsl(self, sim_hosts: tuple[str, ...]) -> None:
        import parsl

        cfg = self.c.make_config(self.book.specs, sim_hosts)
        self.retries = getattr(cfg, "retries", None)
        label = executor_label(cfg)
        t = time.monotonic()
        try:
            parsl.load(cfg)
        except Exception as e:
            raise LaunchError(f"parsl.load failed ({type(e).__name__}: {e})") from e
        self.parsl_load_s = time.monotonic() - t
        logger.info("Parsl loaded in %.2f s (executor %s, retries %s)", self.parsl_load_s, label, self.retries)
        try:
            self._wait_ready()
            self.pool.run(self.book.pending(), simulation_app([label]), more=self._next_wave if self.waves else None)
            self._show(force=True)
        except BaseException:
            self.pool.cancel()
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
            self.trainer.wait_ready(self.ready_file, timeout, stop_requested=self.stops.stopping)
            if self.streams and self.contract is not None and self.contract.endpoints_file:
                connections_needed(self.contract.endpoints_file, self.c.max_concurrent, self.book.specs.max_ranks(),
                                   self.contract)

    # -- the contract ---------------------------------------------------------------------------
    def _contract(self) -> Contract:
        from hpcml.stream.routing import new_secret

        env = {**self.c.env, **(self.training.env if self.training else {})}
        stream: dict = {}
        if self.streams:
            secret = env.get(ENV["secret_file"]) or str(self.run_dir / SECRET_FILE)
            new_secret(secret)  # reused when it exists
            stream = dict(secret_file=secret, endpoints_file=env.get(ENV["endpoints_file"]) or str(self.ready_file),
                          stream_host=self.c.stream_host,
                          stream_interface=None if self.c.stream_host or self.c.site is None
                          else self.c.site.stream_interface)
        t = self.training
        if len(self.book) or self.waves:  # the end of the campaign, for any trainer that waits for it (streaming too)
            stream["done_file"] = str(self.run_dir / DONE_FILE)
        return Contract(run_dir=str(self.run_dir), campaign=self.claim.campaign, run=self.claim.run,
                        resume=self.resume and self.claim.held, steps=t.steps if t else None,
                        batch=t.batch if t else None, n_sims=self._total(),
                        deadline=self.stops.deadline,
                        driver_pid=os.getpid(), driver_host=socket.gethostname(), **stream)

    def _prepare(self) -> None:
        if not len(self.book) and not self.waves:  # training alone: the simulations' files stay as they are
            return
        attempts.prepare(self.pool.sims_dir, {**self.contract.for_simulations().to_env(), **self.c.env})
        attempts.clear_cancel(self.pool.sims_dir)
        rundir.clear_done(self.run_dir)
        specs = self.book.specs
        for pos in range(len(specs)):  # a launched simulation's definition is pinned beside its attempts
            if not specs.is_member(pos):
                rundir.record_spec(self.run_dir, specs[pos])
        if not self.resume:
            return
        records, last = provenance.scan(self.run_dir)  # one pass over the provenance for all of it
        done = set(records)
        if done:
            kept = self.kept() if callable(self.kept) else self.kept  # read once the directory is known to be ours
            if kept is None:
                streaming = set(specs.streaming_ids()) if self.streams else set()
                kept = ledger.kept(self.run_dir, done, streaming, records)
            skip = done & set(kept)
        else:
            skip = set()
        for pos, sim_id in enumerate(specs.ids()):
            if sim_id in skip:
                self.book.skip(pos)
            elif specs.is_member(pos):  # no directory of its own: its attempts go on from the provenance's
                if sim_id in last:
                    self.book.first[pos] = last[sim_id] + 1
        if done:
            lost = sorted(done - skip)
            logger.info("resuming: %d of %d simulation(s) completed earlier and are not run again%s",
                        len(self.book.skipped), len(specs),
                        f"; {len(lost)} finished after the last save and run again: {lost[:20]}" if lost else "")

    def _next_wave(self) -> list[Sim] | None:
        """The pool's ``more``: the next wave when :meth:`Waves.due` says so, proposed from the
        trainer's feedback; None once the budget is proposed."""
        w = self.waves
        if w.plan.done:
            return None
        at = [self.book.specs.position(i) for i in w.last_ids()]
        ended = sum(p is not None and self.book.outcome[p] in (COMPLETED, FAILED) for p in at)
        if not w.due(ended, running=bool(self.pool.inflight), idle=self._rank_idle):
            return []
        new = self._add(w.propose(self.contract))
        self.progress.total = self._total()
        return new

    def _total(self) -> int:
        """Simulations of the whole campaign: the waves' budget and the fixed ones."""
        return self.fixed + (self.waves.budget if self.waves else 0)

    def _rank_idle(self) -> bool:
        """A streaming trainer rank with no running simulation (:func:`~hpcml.ensemble.waves.rank_idle`)."""
        return self.streams and self.training is not None and rank_idle(
            [i for t in self.pool.inflight.values() if t.streams for i in getattr(t, "sim_ids", [t.spec.sim_id])],
            self.c.train_ranks(self.training))

    def _sim(self, pos: int) -> Sim:
        """The simulation at ``pos``, made as it is handed to Parsl."""
        spec = self.book.specs[pos]
        member = spec.entry is not None  # no directory of its own: its records are its bundle's
        s = Sim(spec=spec, pos=pos, dir=self.pool.sims_dir if member else attempts.sim_dir(self.run_dir, spec.sim_id),
                streams=self.streams and spec.stream is not False)
        s.first = self.book.first.get(pos, 0) if member else attempts.next_attempt(s.dir)
        return s

    def _add(self, specs: list[SimSpec]) -> range:
        """The simulations of a new wave, set up as :meth:`_prepare` sets up the others."""
        for spec in specs:
            rundir.record_spec(self.run_dir, spec)
        return self.book.extend(specs)

    def _completed(self, s: Sim) -> None:
        """A streaming simulation that completed without streaming fails the campaign at once:
        the trainer would wait for its samples, and every other simulation would be wasted."""
        if s.streams and not ledger.streamed_anything(s):
            where = s.dir if s.spec.entry is None else self.prov_path
            self.error = (f"simulation {s.spec.sim_id} completed without streaming (no hpcml.stream.Producer of it "
                          f"was closed: run without its stream option, or without producer.close()?), but the training "
                          f"job takes its stream; SimSpec(stream=False) if it writes files instead (see {where})")
            raise LaunchError(self.error)

    def _write_done(self) -> None:
        streaming = self.book.specs.streaming_ids() if self.streams else IdSet()
        write_done(self.run_dir / DONE_FILE, ledger.done_record(
            self.contract, self.book.ids(COMPLETED), self.book.ids(PENDING, RUNNING, FAILED, CANCELLED), streaming))

    # -- training job -----------------------------------------------------------------------------
    def _check_trainer(self) -> None:
        """The pool's check while simulations remain (:meth:`TrainerWatch.check`)."""
        if self.watch is not None:
            self.watch.check()

    def _wait_trainer(self) -> None:
        try:
            self.watch.wait(timeout_s=self.train_timeout_s, tick=self._show, poll_s=self.c.poll_s)
        finally:
            self._show(force=True)

    # -- reporting ------------------------------------------------------------------------------
    def _show(self, force: bool = False) -> None:
        if not self.progress.due(force):
            return
        train = None
        if self.trainer is not None and self.trainer.proc is not None:
            rec = (last_json_line(self.run_dir / "metrics.jsonl")  # a population's: its first member's
                   or last_json_line(self.run_dir / "member_0" / "metrics.jsonl"))
            step = rec.get("step") if rec else None
            train = f"train step {step if step is not None else '-'}"
            if self.trainer.poll() is not None:
                train += f" (exited {self.trainer.returncode})"
        n = self.pool.counts()
        self.progress.update(force=force, done=n["completed"], running=n["running"], failed=n["failed"],
                             cancelled=n["cancelled"], retried=n["retried"], train=train)


def _refuse_loaded_parsl() -> None:
    """A Campaign loads its own Parsl config: one already loaded is refused before anything is written."""
    import parsl
    from parsl.errors import NoDataFlowKernelError

    try:
        parsl.dfk()
    except NoDataFlowKernelError:
        return
    raise ConfigError("a Parsl config is already loaded in this process: a Campaign loads its own; call "
                      "parsl.dfk().cleanup() and parsl.clear() first, or drive your own config with "
                      "hpcml.ensemble.apps")
