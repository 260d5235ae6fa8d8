"""The Campaign: N MPI simulations through Parsl alongside one MPI training job.

Each simulation is a Parsl ``bash_app`` whose command line is the site's MPI launch prefix
(``mpiexec -n R`` locally, ``$PARSL_MPI_PREFIX`` under Parsl's ``MPIExecutor``) followed
by the simulation's argv. The Campaign, not the executor, bounds how many simulations are
in flight, so the limit holds under any executor. Retries are Parsl's: a non-zero exit
raises ``BashExitFailure`` and Parsl runs the app function again.

Attempts are numbered where they run: the app function claims ``attempt_K.start`` in the
simulation's directory with an exclusive create, so the number is right on a retry, on a
re-run of the campaign in the same run directory, and whichever worker runs it. A small
bash wrapper (``run_dir/sims/attempt.sh``) runs the attempt in its own process group,
kills it on timeout or cancellation, and leaves ``attempt_K.end``; the Campaign turns
those plain files into ``provenance.jsonl`` records. Nothing is pickled except what
Parsl itself serialises (the app's arguments: strings and numbers).

The training job is a subprocess of the Campaign started with the site's training launch
line, not a Parsl task: it must never be retried behind our back (it owns the stream's
state), its exit code must be seen at once, and it must not take a simulation slot.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import inspect
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hpcml.ensemble.progress import ProgressLine, last_json_line
from hpcml.errors import ConfigError, LaunchError
from hpcml.log import get_logger

if TYPE_CHECKING:  # parsl costs ~0.4 s to import; only run() needs it
    import parsl

logger = get_logger(__name__)

RESULT_MARKER = "HPCML_SIM_RESULT"
"""Rank 0 of a simulation prints ``HPCML_SIM_RESULT {json}`` as its last stdout line."""
CANCEL_FILE = "CANCEL"
"""Created in ``run_dir/sims`` to stop every running attempt and every retry."""
SIMS_DONE_FILE = "sims_done.json"
"""Written in ``run_dir`` once no simulation is left; its path is ``$HPCML_SIMS_DONE_FILE`` for the trainer."""
_CANCELLED_RC = 125


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    """One simulation: ``argv`` is the program without the MPI prefix; the Campaign appends
    ``--sim-id N --params-json '{...}'``."""

    sim_id: int
    params: dict[str, float]
    argv: list[str]
    ranks: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.sim_id, int) or isinstance(self.sim_id, bool) or self.sim_id < 0:
            raise ConfigError(f"sim_id must be an int >= 0, got {self.sim_id!r}")
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"sim {self.sim_id}: ranks must be an int >= 1, got {self.ranks!r}")
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"sim {self.sim_id}: argv must be a non-empty list of strings, got {self.argv!r}")
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"sim {self.sim_id}: params must be a dict, got {self.params!r}")
        try:
            json.dumps(dict(self.params), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sim {self.sim_id}: params must be finite JSON values ({e})") from None

    def command(self) -> list[str]:
        """The full program argv (still without the MPI prefix)."""
        return [*self.argv, "--sim-id", str(self.sim_id), "--params-json", json.dumps(dict(self.params))]


@dataclass(frozen=True, kw_only=True)
class TrainingJob:
    """The MPI training job launched alongside the simulations."""

    argv: list[str]
    ranks: int = 2
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    """Relaunch a training job that exits non-zero (a node died) this many times; it resumes
    from its checkpoint and its stream servers rebind the same addresses, so the simulations,
    which keep running, reconnect."""
    restart_argv: list[str] | None = None
    """The argv of a relaunch (default: ``argv``), e.g. with ``--resume``."""

    def __post_init__(self) -> None:
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"training argv must be a non-empty list of strings, got {self.argv!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"training max_restarts must be an int >= 0, got {self.max_restarts!r}")
        for name in ("ranks", "nodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"training {name} must be an int >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class CampaignResult:
    """What a finished campaign did; also written to ``run_dir/campaign.json``."""

    run_dir: str
    total: int
    completed: list[int]
    failed: list[int]
    cancelled: list[int]
    attempts: dict[int, int]
    """Attempts made in this run, per simulation."""
    retried: list[int]
    samples_sent: int
    """Sum of samples_sent over the successful attempts."""
    wall_s: float
    parsl_load_s: float
    task_overhead_s: float | None
    """Median over simulations of (time in Parsl) minus (time running attempts)."""
    training_returncode: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and not self.cancelled and self.error is None and self.training_returncode in (None, 0)


Launch = str | Callable[[int], str]
TrainLaunch = str | Callable[..., str]


@dataclass(kw_only=True)
class Campaign:
    """Runs simulations through Parsl, with a training job alongside.

    Give either ``site`` (a ``site_configs`` module or its name: Config, launch lines and
    resource specs all come from it) or ``config`` (a Parsl Config or a factory of one)
    with ``sim_launch`` / ``train_launch`` (strings formatted with ``{ranks}`` and
    ``{nodes}``, or callables like the site module's).
    """

    run_dir: Path | str
    site: ModuleType | str | None = None
    site_options: dict[str, Any] = field(default_factory=dict)
    """Passed to ``site.parsl_config`` (nodes, walltime, account, queue, worker_init)."""
    config: Any = None
    """A ``parsl.Config`` or a zero-argument callable returning one (a Config is used once)."""
    sim_launch: Launch | None = None
    sim_resource_spec: Callable[[int], dict] | None = None
    train_launch: TrainLaunch | None = None
    max_concurrent: int = 4
    retries: int = 2
    """Only for a Config built from ``site``; an explicit Config carries its own."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every simulation attempt (e.g. stream endpoints)."""
    sim_timeout_s: float | None = None
    """Kill an attempt after this long (it then counts as failed and may be retried)."""
    cancel_grace_s: float = 10.0
    """Between SIGTERM and SIGKILL when an attempt is timed out or cancelled."""
    progress: bool = True
    progress_every_s: float = 30.0
    """Seconds between progress lines when stderr is not a terminal."""
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).resolve()
        if not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ConfigError(f"max_concurrent must be an int >= 1, got {self.max_concurrent!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {self.retries!r}")
        if self.sim_timeout_s is not None and not self.sim_timeout_s > 0:
            raise ConfigError(f"sim_timeout_s must be > 0 or None, got {self.sim_timeout_s}")
        for name in ("cancel_grace_s", "poll_s", "progress_every_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.site is None and self.config is None:
            raise ConfigError("Campaign needs site= (a site_configs module or name) or config= (a parsl.Config)")
        bad = [k for k, v in self.env.items()
               if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)) or not isinstance(v, str)]
        if bad:
            raise ConfigError(f"env names must be shell identifiers with str values, got {bad}")
        if isinstance(self.site, str):
            from hpcml.ensemble.site import load_site

            self.site = load_site(self.site)

    # --- launch lines ---------------------------------------------------------------------

    def _sim_prefix(self, ranks: int) -> str:
        launch = self.sim_launch if self.sim_launch is not None else getattr(self.site, "sim_launch", None)
        if launch is None:
            launch = "mpiexec -n {ranks}"
        return launch(ranks) if callable(launch) else launch.format(ranks=ranks)

    def _resource_spec(self, ranks: int) -> dict:
        fn = self.sim_resource_spec or getattr(self.site, "sim_resource_spec", None)
        return dict(fn(ranks)) if fn is not None else {}

    def _train_line(self, job: TrainingJob) -> str:
        launch = self.train_launch if self.train_launch is not None else getattr(self.site, "train_launch", None)
        if launch is None:
            launch = "mpiexec -n {ranks}"
        if not callable(launch):
            return f"{launch.format(ranks=job.ranks, nodes=job.nodes)} {shlex.join(job.argv)}"
        params = inspect.signature(launch).parameters
        takes_ranks = "ranks" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        return launch(job.nodes, list(job.argv), ranks=job.ranks) if takes_ranks else launch(job.nodes, list(job.argv))

    def _make_config(self, sims: Sequence[SimSpec]) -> parsl.Config:
        if self.config is not None:
            cfg = self.config() if callable(self.config) else self.config
        else:
            cfg = self.site.parsl_config(run_dir=str(self.run_dir), max_concurrent_sims=self.max_concurrent,
                                         sim_ranks=max((s.ranks for s in sims), default=1), retries=self.retries,
                                         **self.site_options)
        if getattr(cfg, "run_dir", None) == "runinfo":  # Parsl's default: keep everything in the run directory
            cfg.run_dir = str(self.run_dir / "parsl")
        return cfg

    # --- the run --------------------------------------------------------------------------

    def run(self, sims: Sequence[SimSpec], *, training: TrainingJob | None = None, ready_file: Path | str | None = None,
            ready_timeout_s: float = 300.0, train_timeout_s: float = 600.0) -> CampaignResult:
        """Start ``training``, wait for ``ready_file``, run every simulation, wait for the
        trainer to exit; raise :class:`LaunchError` if the trainer fails (remaining
        simulations are cancelled first)."""
        sims = list(sims)
        ids = [s.sim_id for s in sims]
        if len(set(ids)) != len(ids):
            dup = sorted(i for i, n in Counter(ids).items() if n > 1)
            raise ConfigError(f"sim_id values must be unique, repeated: {dup}")
        for name, v in (("ready_timeout_s", ready_timeout_s), ("train_timeout_s", train_timeout_s)):
            if not v > 0:
                raise ConfigError(f"{name} must be > 0, got {v}")
        if ready_file is not None and training is None:
            raise ConfigError(f"ready_file {ready_file} given without a training job to write it")
        return _Run(self, sims, training, Path(ready_file) if ready_file is not None else None,
                    ready_timeout_s, train_timeout_s).execute()


# --- the remote side: runs on the Parsl worker ----------------------------------------------

def hpcml_sim(sim_dir: str, sim_id: int, launch: str, argv: list[str], limit_s: int, grace_s: int,
              parsl_resource_specification: dict) -> str:
    """Parsl bash_app body: claim the next attempt number and return its command line.

    Parsl calls this again on every retry, on the worker, so the number is claimed here
    with an exclusive create rather than counted on the submitting side.
    """
    sims_dir = os.path.dirname(sim_dir)
    if os.path.exists(os.path.join(sims_dir, "CANCEL")):
        return f"exit {_CANCELLED_RC}"  # a retry after cancellation: no attempt, no launch
    os.makedirs(sim_dir, exist_ok=True)
    k = 0
    while True:
        try:
            fd = os.open(os.path.join(sim_dir, f"attempt_{k}.start"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            k += 1
    with os.fdopen(fd, "w") as f:
        json.dump({"start": time.time(), "host": socket.gethostname()}, f)
    script = os.path.join(sims_dir, "attempt.sh")
    # `launch` stays unquoted: $PARSL_MPI_PREFIX must expand on the worker.
    return (f"exec /bin/bash {shlex.quote(script)} {shlex.quote(sim_dir)} {int(sim_id)} {k} {int(limit_s)} "
            f"{int(grace_s)} -- {launch} {shlex.join(argv)}")


_ATTEMPT_SH = r"""#!/bin/bash
# Written by hpcml.ensemble.campaign. Runs attempt K of one simulation in its own process
# group; TERM then KILL it on timeout, on run_dir/sims/CANCEL or when this script is
# signalled; leaves attempt_K.end = {"returncode", "end", "reason"}.
# usage: attempt.sh SIM_DIR SIM_ID K TIMEOUT_S GRACE_S -- COMMAND...
dir=$1 id=$2 k=$3 limit=$4 grace=$5
shift 6
here=$(cd "$(dirname "$0")" && pwd)
base=$dir/attempt_$k
[ -f "$here/env.sh" ] && . "$here/env.sh"
export HPCML_SIM_ID=$id HPCML_ATTEMPT=$k
exec >"$base.out" 2>"$base.err" </dev/null
printf '%q ' "$@" >"$base.cmd"  # the command as launched: $PARSL_MPI_PREFIX expanded
set -m
"$@" &
child=$!
reason=
stop() {
    kill -TERM -- -"$child" 2>/dev/null
    local g=0
    while [ "$g" -lt "$grace" ] && kill -0 "$child" 2>/dev/null; do sleep 1; g=$((g + 1)); done
    kill -KILL -- -"$child" 2>/dev/null
}
interrupted=0 killer=
# Signalled (e.g. a worker shutting down): TERM the attempt now, KILL it after the grace
# period from the background, so that the wait below reaps it as soon as it exits.
trap 'interrupted=1; echo interrupted >"$base.reason"; kill -TERM -- -"$child" 2>/dev/null
      (sleep "$grace"; kill -KILL -- -"$child" 2>/dev/null) & killer=$!' TERM INT HUP
(
    n=0
    while sleep 1; do
        kill -0 "$child" 2>/dev/null || exit 0
        n=$((n + 1))
        if [ -e "$here/CANCEL" ]; then echo cancelled >"$base.reason"
        elif [ "$limit" -gt 0 ] && [ "$n" -ge "$limit" ]; then echo timeout >"$base.reason"
        else continue; fi
        stop
        exit 0
    done
) &
watcher=$!
set +m  # the process groups stay; bash's job notices ("Terminated ...") would clutter the .err
wait "$child"; rc=$?
if [ "$interrupted" = 1 ]; then wait "$child"; rc=$?; kill "$killer" 2>/dev/null; fi
kill -- -"$watcher" 2>/dev/null
wait "$watcher" 2>/dev/null
[ -f "$base.reason" ] && reason=$(cat "$base.reason")
# MPICH's hydra exits 0 after forwarding SIGTERM: a stopped attempt must not look like a success.
if [ -n "$reason" ] && [ "$rc" = 0 ]; then rc=143; fi
printf '{"returncode": %d, "end": %s, "reason": "%s"}\n' "$rc" "$(date +%s.%N)" "$reason" >"$base.end.tmp"
mv "$base.end.tmp" "$base.end"
exit "$rc"
"""


# --- the submitting side ---------------------------------------------------------------------

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


class _Run:
    """One execution of :meth:`Campaign.run`; holds the mutable state."""

    def __init__(self, c: Campaign, sims: list[SimSpec], training: TrainingJob | None, ready_file: Path | None,
                 ready_timeout_s: float, train_timeout_s: float) -> None:
        self.c, self.training, self.ready_file = c, training, ready_file
        self.ready_timeout_s, self.train_timeout_s = ready_timeout_s, train_timeout_s
        self.run_dir: Path = c.run_dir  # type: ignore[assignment]
        self.sims_dir = self.run_dir / "sims"
        self.sims = [_Sim(spec=s, dir=self.sims_dir / f"sim_{s.sim_id:05d}", first=0) for s in sims]
        self.prov_path = self.run_dir / "provenance.jsonl"
        self.trainer: subprocess.Popen | None = None
        self.train_line: str | None = None
        self.train_rc: int | None = None
        self.train_started = self.train_ended = 0.0
        self.train_restarts = 0
        self.parsl_load_s = 0.0
        self.retries: int | None = None
        self.error: str | None = None
        self.progress = ProgressLine(len(sims), enabled=c.progress, every_s=c.progress_every_s)
        self._early_exit_warned = False

    # -- orchestration --

    def execute(self) -> CampaignResult:
        t0 = time.monotonic()
        self.started_at = time.time()
        self._prepare()
        result: CampaignResult | None = None
        try:
            if self.ready_file is not None:
                self.ready_file.unlink(missing_ok=True)  # a stale one would send sims to an old trainer
            if self.training is not None:
                self._start_trainer()
            import parsl

            cfg = self.c._make_config([s.spec for s in self.sims])
            self.retries = getattr(cfg, "retries", None)
            label = _executor_label(cfg)
            t = time.monotonic()
            try:
                parsl.load(cfg)
            except Exception as e:
                hint = "; a Campaign loads its own: clean up the other first" if "already" in str(e) else ""
                raise LaunchError(f"parsl.load failed ({type(e).__name__}: {e}){hint}") from e
            self.parsl_load_s = time.monotonic() - t
            logger.info("Parsl loaded in %.2f s (executor %s, retries %s)", self.parsl_load_s, label, self.retries)
            try:
                if self.ready_file is not None:
                    self._wait_ready()
                self._run_sims(parsl.bash_app(hpcml_sim, executors=[label]))
            except BaseException:
                self._cancel_inflight()
                raise
            finally:
                try:
                    parsl.dfk().cleanup()
                finally:
                    parsl.clear()
            self._write_sims_done()
            if self.trainer is not None:
                self._wait_trainer()
        except BaseException as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
            self._stop_trainer()
            raise
        finally:
            self.progress.close()
            result = self._result(time.monotonic() - t0)
            _write_json(self.run_dir / "campaign.json", self._summary(result))
        return result

    def _prepare(self) -> None:
        self.sims_dir.mkdir(parents=True, exist_ok=True)
        (self.sims_dir / CANCEL_FILE).unlink(missing_ok=True)
        (self.run_dir / SIMS_DONE_FILE).unlink(missing_ok=True)
        script = self.sims_dir / "attempt.sh"
        script.write_text(_ATTEMPT_SH)
        script.chmod(0o755)
        env = {"HPCML_RUN_DIR": str(self.run_dir), **self.c.env}
        env_sh = self.sims_dir / "env.sh"
        fd = os.open(env_sh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may name secrets' files
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        for s in self.sims:
            s.dir.mkdir(exist_ok=True)
            s.first = _next_attempt(s.dir)

    # -- training job --

    def _start_trainer(self, restart: bool = False) -> None:
        job = self.training
        assert job is not None
        if restart and job.restart_argv:
            job = TrainingJob(**{**asdict(job), "argv": job.restart_argv})
        self.train_line = self.c._train_line(job)
        env = {**os.environ, "HPCML_RUN_DIR": str(self.run_dir), "HPCML_N_SIMS": str(len(self.sims)),
               "HPCML_SIMS_DONE_FILE": str(self.run_dir / SIMS_DONE_FILE), **job.env}
        logger.info("training job: %s", self.train_line)
        mode = "ab" if restart else "wb"
        with open(self.run_dir / "train.out", mode) as out, open(self.run_dir / "train.err", mode) as err:
            self.trainer = subprocess.Popen(self.train_line, shell=True, executable="/bin/bash", stdout=out,
                                            stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.train_started = time.monotonic()

    def _trainer_failed(self) -> str | None:
        """A message when the trainer has exited non-zero; warns once on an early clean exit."""
        if self.trainer is None or self.trainer.poll() is None:
            return None
        self._note_trainer_exit()
        if self.train_rc != 0 and self._restart_trainer():
            return None
        if self.train_rc == 0:
            if not self._early_exit_warned and any(s.outcome in ("pending", "running") for s in self.sims):
                logger.warning("training job exited 0 while simulations remain; they run on")
                self._early_exit_warned = True
            return None
        return self._trainer_message(f"exited with code {self.train_rc}")

    def _restart_trainer(self) -> bool:
        """Relaunch a failed trainer while restarts are left (it resumes from its checkpoint)."""
        if self.train_restarts >= self.training.max_restarts:
            return False
        self.train_restarts += 1
        logger.warning("training job exited with code %s: restart %d of %d (it resumes from its checkpoint)",
                       self.train_rc, self.train_restarts, self.training.max_restarts)
        self.train_rc = None
        self._start_trainer(restart=True)
        return True

    def _trainer_message(self, what: str) -> str:
        tail = _tail_lines(self.run_dir / "train.err", 3)
        return (f"training job {what} after {(self.train_ended or time.monotonic()) - self.train_started:.1f} s "
                f"(see {self.run_dir / 'train.err'}){': ' + ' / '.join(tail) if tail else ''}")

    def _note_trainer_exit(self) -> None:
        if self.trainer is not None and self.train_rc is None and self.trainer.returncode is not None:
            self.train_rc = self.trainer.returncode
            self.train_ended = time.monotonic()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.ready_file.exists():  # type: ignore[union-attr]
            if self.trainer is not None and self.trainer.poll() is not None:
                self._note_trainer_exit()
                raise LaunchError(self._trainer_message(f"exited with code {self.train_rc} before writing "
                                                        f"ready file {self.ready_file}"))
            if time.monotonic() > deadline:
                raise LaunchError(f"ready file {self.ready_file} did not appear within ready_timeout_s="
                                  f"{self.ready_timeout_s:g} s; the training job is still running")
            time.sleep(0.05)

    def _wait_trainer(self) -> None:
        assert self.trainer is not None
        deadline = time.monotonic() + self.train_timeout_s
        while True:
            if self.trainer.poll() is not None:
                self._note_trainer_exit()
                if self.train_rc != 0 and self._restart_trainer():
                    continue
                break
            if time.monotonic() > deadline:
                raise LaunchError(f"training job did not exit within train_timeout_s={self.train_timeout_s:g} s "
                                  f"after the last simulation; stopped it")
            self._show()
            time.sleep(self.c.poll_s)
        self._note_trainer_exit()
        self._show(force=True)
        if self.train_rc != 0:
            raise LaunchError(self._trainer_message(f"exited with code {self.train_rc}"))

    def _stop_trainer(self) -> None:
        """TERM the trainer's process group, KILL it after the grace period."""
        p = self.trainer
        if p is None or p.poll() is not None:
            self._note_trainer_exit()
            return
        for sig, wait_s in ((signal.SIGTERM, self.c.cancel_grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._note_trainer_exit()

    # -- simulations --

    def _run_sims(self, app) -> None:
        pending = deque(self.sims)
        self.inflight: dict[concurrent.futures.Future, _Sim] = {}
        while pending or self.inflight:
            failure = self._trainer_failed()
            if failure is not None:
                self.error = failure
                raise LaunchError(failure)
            while pending and len(self.inflight) < self.c.max_concurrent:
                s = pending.popleft()
                spec = s.spec
                s.submitted, s.outcome = time.monotonic(), "running"
                limit = math.ceil(self.c.sim_timeout_s) if self.c.sim_timeout_s else 0
                fut = app(str(s.dir), spec.sim_id, self.c._sim_prefix(spec.ranks), spec.command(), limit,
                          math.ceil(self.c.cancel_grace_s),
                          parsl_resource_specification=self.c._resource_spec(spec.ranks))
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
        (self.sims_dir / CANCEL_FILE).touch()
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
        elif cancelled or (self.sims_dir / CANCEL_FILE).exists():
            s.outcome = "cancelled"
        else:
            s.outcome = "failed"
            logger.warning("simulation %d failed after %d attempt(s): %s", s.spec.sim_id, len(s.recorded),
                           _describe(exc))

    def _record_attempts(self, s: _Sim, *, final: bool, exc: BaseException | None = None, ok: bool = False) -> None:
        """Append a provenance record for every attempt of ``s`` that has ended; when the
        task is over (``final``), also for attempts whose wrapper left no end record (the
        last one then takes its return code from the task: 0 if ``ok``, else ``exc``'s)."""
        k = s.first
        while (s.dir / f"attempt_{k}.start").exists():
            if k not in s.recorded:
                rec = self._attempt_record(s, k)
                if rec is None and final:
                    last = not (s.dir / f"attempt_{k + 1}.start").exists()
                    rc = (0 if ok else getattr(exc, "exitcode", None)) if last else None
                    rec = self._attempt_record(s, k, missing_end_rc=rc, missing_end=True)
                if rec is not None:
                    s.recorded[k] = rec
                    with open(self.prov_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
            k += 1
        s.claimed = k - s.first

    def _attempt_record(self, s: _Sim, k: int, *, missing_end: bool = False,
                        missing_end_rc: int | None = None) -> dict | None:
        """The provenance record of attempt ``k``, or None while it runs."""
        base = s.dir / f"attempt_{k}"
        start = _read_json(base.with_suffix(".start")) or {}
        end = _read_json(base.with_suffix(".end"))
        if end is None and not missing_end:
            return None
        out, err = base.with_suffix(".out"), base.with_suffix(".err")
        result = _parse_result(out)
        if end is not None:
            rc, t_end, reason = end.get("returncode"), end.get("end"), end.get("reason") or None
        else:  # no end record: the wrapper itself was killed, the worker lost, or the file not yet visible
            rc, t_end, reason = missing_end_rc, None, None
        sig = _exit_signal(rc, _tail_text(out) + _tail_text(err))
        if reason in ("timeout", "cancelled", "interrupted"):
            status = reason
        elif rc == 0:
            status = "ok"
        elif sig is not None:
            status = "killed"
        else:
            status = "lost" if rc is None else "failed"
        t_start = start.get("start")
        return {
            "sim_id": s.spec.sim_id, "attempt": k, "params": dict(s.spec.params), "status": status,
            "returncode": rc, "signal": sig,
            "samples_sent": result.get("samples_sent") if result else None, "result": result,
            "start": t_start, "end": t_end,
            "duration_s": round(t_end - t_start, 3) if t_start is not None and t_end is not None else None,
            "host": start.get("host"), "launch": self.c._sim_prefix(s.spec.ranks), "argv": s.spec.command(),
            "command": _read_text(base.with_suffix(".cmd")),
            "stdout": str(out.relative_to(self.run_dir)), "stderr": str(err.relative_to(self.run_dir)),
        }

    # -- reporting --

    def _show(self, force: bool = False) -> None:
        if not self.progress.due(force):
            return
        counts = {o: sum(s.outcome == o for s in self.sims) for o in ("completed", "running", "failed", "cancelled")}
        train = None
        if self.trainer is not None:
            rec = last_json_line(self.run_dir / "metrics.jsonl")
            step = rec.get("step") if rec else None
            train = f"train step {step if step is not None else '-'}"
            if self.trainer.poll() is not None:
                train += f" (exited {self.trainer.returncode})"
        self.progress.update(force=force, done=counts["completed"], running=counts["running"],
                             failed=counts["failed"] + counts["cancelled"],
                             retried=sum(s.claimed > 1 for s in self.sims), train=train)

    def _write_sims_done(self) -> None:
        _write_json(self.run_dir / SIMS_DONE_FILE, {
            "completed": [s.spec.sim_id for s in self.sims if s.outcome == "completed"],
            "failed": [s.spec.sim_id for s in self.sims if s.outcome != "completed"]})

    def _result(self, wall_s: float) -> CampaignResult:
        overheads = []
        for s in self.sims:
            durations = [r["duration_s"] for r in s.recorded.values()]
            if s.finished and durations and None not in durations:
                overheads.append((s.finished - s.submitted) - sum(durations))
        overheads.sort()
        by = lambda o: [s.spec.sim_id for s in self.sims if s.outcome == o]  # noqa: E731
        return CampaignResult(
            run_dir=str(self.run_dir), total=len(self.sims), completed=by("completed"), failed=by("failed"),
            cancelled=[s.spec.sim_id for s in self.sims if s.outcome in ("cancelled", "pending", "running")],
            attempts={s.spec.sim_id: len(s.recorded) for s in self.sims},
            retried=[s.spec.sim_id for s in self.sims if len(s.recorded) > 1],
            samples_sent=sum(r["samples_sent"] or 0 for s in self.sims for r in s.recorded.values()
                             if r["status"] == "ok" and isinstance(r["samples_sent"], int)),
            wall_s=round(wall_s, 3), parsl_load_s=round(self.parsl_load_s, 3),
            task_overhead_s=round(overheads[len(overheads) // 2], 4) if overheads else None,
            training_returncode=self.train_rc, error=self.error)

    def _summary(self, r: CampaignResult) -> dict:
        d = asdict(r)
        d["attempts"] = {str(k): v for k, v in r.attempts.items()}
        d.update(version=1, started=_iso(self.started_at), ended=_iso(time.time()), host=socket.gethostname(),
                 max_concurrent=self.c.max_concurrent, retries=self.retries, sim_timeout_s=self.c.sim_timeout_s,
                 provenance=self.prov_path.name, ok=r.ok,
                 training=None if self.training is None else {
                     "argv": self.training.argv, "ranks": self.training.ranks, "nodes": self.training.nodes,
                     "launch": self.train_line, "returncode": self.train_rc,
                     "wall_s": round((self.train_ended or time.monotonic()) - self.train_started, 3)})
        return d


# --- helpers ---------------------------------------------------------------------------------

def _executor_label(cfg: Any) -> str:
    labels = [e.label for e in getattr(cfg, "executors", [])]
    if "sims" in labels:
        return "sims"
    if len(labels) == 1:
        return labels[0]
    raise ConfigError(f"the Parsl config needs an executor labelled 'sims' for the simulations, got {labels}")


def _next_attempt(sim_dir: Path) -> int:
    k = 0
    while (sim_dir / f"attempt_{k}.start").exists():
        k += 1
    return k


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _tail_text(path: Path, max_bytes: int = 8192) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _tail_lines(path: Path, n: int) -> list[str]:
    return [line.strip() for line in _tail_text(path).splitlines() if line.strip()][-n:]


def _parse_result(out: Path) -> dict | None:
    """The last ``HPCML_SIM_RESULT {json}`` line of an attempt's stdout (its last MiB)."""
    for line in reversed(_tail_text(out, 1 << 20).splitlines()):
        if line.startswith(RESULT_MARKER + " "):
            try:
                data = json.loads(line[len(RESULT_MARKER) + 1:])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


_HYDRA_SIGNAL = re.compile(r"\(signal (\d+)\)")


def _exit_signal(rc: int | None, output_tail: str) -> int | None:
    """The signal that ended an attempt: a negative return code, MPICH's "(signal N)" exit
    string (hydra returns N itself as the exit code), or the shell's 128 + N."""
    if rc is None or rc == 0:
        return None
    if rc < 0:
        return -rc
    m = _HYDRA_SIGNAL.findall(output_tail)
    if m:
        return int(m[-1])
    if 128 < rc <= 128 + 64:
        return rc - 128
    return None


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "exitcode", None)
    return f"exit code {code}" if code is not None else f"{type(exc).__name__}: {exc}"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")
