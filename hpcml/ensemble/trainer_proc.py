"""The training job of a campaign as a child process group of the driver.

It is not a Parsl task: it must never be retried behind our back (it owns the stream's
state), its exit must be seen at once, it must not take a simulation slot, and the driver
must be able to signal it (the walltime warning). Exit codes: 0 finished; 75
(:data:`hpcml.env.NOT_FINISHED`) saved and stopped on a signal, to be resumed; anything
else failed, and it is relaunched while ``max_restarts`` allow (it resumes from its
checkpoint; its stream servers rebind the same addresses).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from hpcml.ensemble import watchdog
from hpcml.ensemble.attempts import tail_text
from hpcml.ensemble.spec import TrainingJob
from hpcml.env import NOT_FINISHED
from hpcml.errors import LaunchError
from hpcml.log import get_logger

logger = get_logger(__name__)


_CAUSE = re.compile(r"\b[A-Z]\w*(Error|Exception|Interrupt)\b|\berror:|KILLED BY SIGNAL|Killed|Segmentation fault|"
                    r"out of memory", re.I)
_NOISE = re.compile(r"MPI_Abort|Abort\(\d+\)|^\[rank \d+\] (INFO|DEBUG|WARNING) |^={5,}|^\s*$|aborting the MPI job")


def cause_line(path: Path, max_chars: int = 400) -> str | None:
    """The last line of ``path``'s tail that says what went wrong (an exception, an error, a
    signal), skipping the launcher's abort noise and log lines; None if there is none."""
    for line in reversed(tail_text(path, 1 << 16).splitlines()):
        line = line.strip()
        if _CAUSE.search(line) and not _NOISE.search(line):
            return line if len(line) <= max_chars else line[:max_chars - 3] + "..."
    return None


class TrainerProcess:
    """Start, watch, restart, signal and stop the training job; its output goes to
    ``run_dir/train.out`` and ``train.err`` (appended on a restart)."""

    def __init__(self, job: TrainingJob, *, line: Callable[[TrainingJob], str], run_dir: Path,
                 env: Mapping[str, str], grace_s: float) -> None:
        self.job, self._line, self.run_dir, self.env, self.grace_s = job, line, run_dir, dict(env), grace_s
        self.proc: subprocess.Popen | None = None
        self.line: str | None = None
        self.returncode: int | None = None
        self.started = self.ended = 0.0
        self.restarts = 0

    # -- life ---------------------------------------------------------------------------------
    def start(self, *, restart: bool = False, append: bool = False) -> None:
        """Launch it; a relaunch (``restart``) gets ``restart_argv`` and ``HPCML_RESUME=1``:
        it continues from its checkpoint."""
        job = self.job
        if restart and job.restart_argv:
            job = TrainingJob(**{**asdict(job), "argv": job.restart_argv})
        self.line = self._line(job)
        env = {**os.environ, **self.env, **job.env, **({"HPCML_RESUME": "1"} if restart else {})}
        logger.info("training job: %s", self.line)
        mode = "ab" if restart or append else "wb"
        with open(self.run_dir / "train.out", mode) as out, open(self.run_dir / "train.err", mode) as err:
            # its own process group, under the watchdog that ends it if this driver dies
            self.proc = subprocess.Popen(watchdog.command(["/bin/bash", "-c", self.line]), stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.returncode = None
        self.started = time.monotonic()

    def poll(self) -> int | None:
        """The exit status once it has exited (recorded the first time it is seen)."""
        if self.proc is not None and self.returncode is None and self.proc.poll() is not None:
            self.returncode = self.proc.returncode
            self.ended = time.monotonic()
        return self.returncode

    @property
    def running(self) -> bool:
        return self.proc is not None and self.poll() is None

    def restart_if_allowed(self) -> bool:
        """Relaunch after a failure while restarts are left; False when it stays down."""
        rc = self.poll()
        if rc in (None, 0, NOT_FINISHED) or self.restarts >= self.job.max_restarts:
            return False
        self.restarts += 1
        logger.warning("training job exited with code %s: restart %d of %d (it resumes from its checkpoint)",
                       rc, self.restarts, self.job.max_restarts)
        self.start(restart=True)
        return True

    def batch_job(self) -> tuple[str, str] | None:
        """(scheduler, job id) when the training job is a batch job submitted and waited for
        (pilot mode on PBS and LSF): its client printed the id when it submitted."""
        head = (self.line or "").split(" ", 1)[0]
        if head not in ("qsub", "bsub"):
            return None
        text = tail_text(self.run_dir / "train.out", 1 << 16)
        m = re.search(r"Job <(\d+)>", text) if head == "bsub" else re.search(r"^\s*(\d+[\w.-]*)\s*$", text, re.M)
        return ("pbs" if head == "qsub" else "lsf", m[1]) if m else None

    def _scheduler(self, sig: int | None) -> bool:
        """Signal (or, ``sig`` None, cancel) a submitted batch job through its scheduler; the
        client's process group would only lose the client. False if it is no batch job."""
        job = self.batch_job()
        if job is None:
            return False
        kind, job_id = job
        name = signal.Signals(sig).name[3:] if sig is not None else None
        cmd = {("pbs", True): ["qsig", "-s", str(name), job_id], ("pbs", False): ["qdel", job_id],
               ("lsf", True): ["bkill", "-s", str(name), job_id], ("lsf", False): ["bkill", job_id]}[kind, sig is not None]
        try:
            subprocess.run(cmd, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            logger.error("%s failed: %s", " ".join(cmd), e)
        return True

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group (``srun``/``mpiexec`` forward it to every rank),
        or through the scheduler to a batch job it submitted."""
        if self.running and not self._scheduler(sig):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """TERM the process group, KILL it after the grace period (a submitted batch job is
        cancelled through its scheduler first)."""
        if not self.running:
            return
        self._scheduler(None)
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.poll()

    # -- waiting --------------------------------------------------------------------------------
    def wait_ready(self, ready_file: Path, timeout_s: float | None,
                   stop_requested: Callable[[], bool] = lambda: False) -> bool:
        """Until ``ready_file`` exists (True) or a stop is asked (False); LaunchError if the
        job exits first or time runs out."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ready_file.exists():
            if self.poll() is not None:
                raise LaunchError(self.message(f"exited with code {self.returncode} before writing "
                                               f"ready file {ready_file}"))
            if stop_requested():
                return False
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"ready file {ready_file} did not appear within {timeout_s:g} s; the training "
                                  f"job is still running")
            time.sleep(0.05)
        return True

    def wait(self, *, timeout_s: float | None, tick: Callable[[], None], poll_s: float,
             stop_requested: Callable[[], bool], save_window: Callable[[], float]) -> int:
        """Until it exits; its exit status.

        A failure is relaunched while ``max_restarts`` allow. When ``stop_requested()`` turns
        true, it is asked to save and stop (SIGUSR1) and never relaunched; after
        ``save_window()`` seconds more it is stopped (TERM, then KILL). ``timeout_s``: a limit
        given by the caller, after which it is stopped and LaunchError raised.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        asked_until: float | None = None
        while True:
            if self.poll() is not None and (asked_until is not None or not self.restart_if_allowed()):
                break
            if asked_until is None and stop_requested():
                window = max(1.0, save_window())
                logger.warning("asking the training job to save and stop (SIGUSR1); it has %.0f s", window)
                self.signal(signal.SIGUSR1)
                asked_until = time.monotonic() + window
            if asked_until is not None and time.monotonic() > asked_until:
                logger.error("the training job did not stop within its save window: stopping it")
                self.stop()
                break
            if asked_until is None and deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"training job did not exit within train_timeout_s={timeout_s:g} s after the "
                                  f"last simulation; stopped it")
            tick()
            time.sleep(poll_s)
        tick()
        return self.returncode

    # -- reporting ----------------------------------------------------------------------------
    def message(self, what: str) -> str:
        """One line: what happened, the restarts used, and the cause -- the last error line of
        the job's output, not the MPI_Abort or log lines that follow it."""
        used = (f"; {self.restarts} of {self.job.max_restarts} restart(s) used, none left"
                if self.returncode not in (None, 0, NOT_FINISHED) and self.job.max_restarts else "")
        err = self.run_dir / "train.err"
        cause = cause_line(err) or cause_line(self.run_dir / "train.out") or " / ".join(
            [line for line in tail_text(err).splitlines() if line.strip() and not _NOISE.search(line)][-3:])
        return (f"training job {what} after {(self.ended or time.monotonic()) - self.started:.1f} s{used} "
                f"(see {self.run_dir / 'train.err'}){': ' + cause if cause else ''}")

    def summary(self) -> dict:
        return {"argv": self.job.argv, "ranks": self.job.ranks, "nodes": self.job.nodes, "launch": self.line,
                "returncode": self.returncode, "restarts": self.restarts,
                "wall_s": round((self.ended or time.monotonic()) - self.started, 3) if self.started else None}
