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
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from hpcml import safeio
from hpcml.contract import CONFIG_ERROR, ENV, INCOMPLETE, LEASE_FILE
from hpcml.ensemble import schedulers, watchdog
from hpcml.ensemble.attempt_text import tail_text
from hpcml.ensemble.spec import TrainingJob
from hpcml.env import NOT_FINISHED
from hpcml.errors import LaunchError
from hpcml.log import get_logger

logger = get_logger(__name__)


_CAUSE = re.compile(r"\b[A-Z]\w*(Error|Exception|Interrupt)\b|\berror:|\bfailed:|KILLED BY SIGNAL|Killed|"
                    r"Segmentation fault|out of memory", re.I)
_NOISE = re.compile(r"MPI_Abort|Abort\(\d+\)|^\[rank \d+\] (INFO|DEBUG|WARNING) |^={5,}|^\s*$|aborting the MPI job")


def launch_pids(launch: str) -> list[int]:
    """The processes of this host (this user's, readable) whose environment carries the
    training-job launch token ``launch``."""
    needle = f"{ENV['launch']}={launch}".encode()
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                data = f.read()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and b"\0" + needle + b"\0" in b"\0" + data + b"\0":
            out.append(int(name))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def cause_line(path: Path, max_chars: int = 400) -> str | None:
    """The last line of ``path``'s tail that says what went wrong (an exception, an error, a
    signal), skipping the launcher's abort noise and log lines; None if there is none."""
    for line in reversed(tail_text(path, 1 << 16).splitlines()):
        line = line.strip()
        if _CAUSE.search(line) and not _NOISE.search(line):
            return line if len(line) <= max_chars else line[:max_chars - 3] + "..."
    return None


#: Exit statuses after which a relaunch would fail the same way (or lose nothing more).
NO_RELAUNCH = (0, NOT_FINISHED, INCOMPLETE, CONFIG_ERROR)
_NOT_RELAUNCHED = {CONFIG_ERROR: "none made: a relaunch would repeat it",
                   INCOMPLETE: "none made: it trained, samples are what is missing"}


class TrainerProcess:
    """Start, watch, restart, signal and stop the training job; its output goes to
    ``run_dir/train.out`` and ``train.err`` (appended on a restart).

    Each launch gets a token (``HPCML_TRAINER_LAUNCH``), written to ``run_dir/trainer.lease``
    before it starts. Before a relaunch, and when it is stopped, every process of the
    earlier launch is ended and waited for: its process group, and on this host every
    process whose environment carries its token (MPI launchers start ranks in sessions of
    their own; a killed watchdog leaves the launcher orphaned) -- TERM first, so its ranks
    save what they hold, KILL after the grace period. Ranks elsewhere see the lease change
    and exit by themselves (:mod:`hpcml.lifeline`). So a relaunch never finds its ports held
    by the job it replaces.
    """

    def __init__(self, job: TrainingJob, *, line: Callable[[TrainingJob], str], run_dir: Path,
                 env: Mapping[str, str], grace_s: float) -> None:
        self.job, self._line, self.run_dir, self.env, self.grace_s = job, line, run_dir, dict(env), grace_s
        self.proc: subprocess.Popen | None = None
        self.line: str | None = None
        self.returncode: int | None = None
        self.started = self.ended = 0.0
        self.restarts = 0
        self.launch: str | None = None
        self.stopped = False
        """The campaign ended it while it ran (MPICH's launcher then exits 0 whatever its ranks did)."""

    # -- life ---------------------------------------------------------------------------------
    def start(self, *, restart: bool = False, append: bool = False) -> None:
        """Launch it; a relaunch (``restart``) gets ``restart_argv`` and ``HPCML_RESUME=1``:
        it continues from its checkpoint."""
        job = self.job
        if restart and job.restart_argv:
            job = TrainingJob(**{**asdict(job), "argv": job.restart_argv})
        self.line = self._line(job)
        if self.launch is not None:  # TERM first: its ranks save what they hold and exit; the rest is killed
            self.reap(self.launch)
        self.launch = uuid.uuid4().hex[:16]
        # ranks of the earlier launch elsewhere see it, and go
        safeio.replace(self.run_dir / LEASE_FILE, self.launch + "\n")
        env = {**os.environ, **self.env, **job.env, ENV["launch"]: self.launch,
               **({ENV["resume"]: "1"} if restart else {})}
        logger.info("training job: %s", self.line)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if restart or append else os.O_TRUNC)
        with os.fdopen(safeio.open_fd(self.run_dir / "train.out", flags, root=self.run_dir), "wb") as out, \
                os.fdopen(safeio.open_fd(self.run_dir / "train.err", flags, root=self.run_dir), "wb") as err:
            # its own process group, under the watchdog that ends it if this driver dies
            self.proc = subprocess.Popen(watchdog.command(["/bin/bash", "-c", self.line]), stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.returncode, self.stopped = None, False
        self.started = time.monotonic()

    def reap(self, launch: str | None = None) -> list[int]:
        """End every process of ``launch`` (default: the current one) on this host -- TERM, then
        KILL after the grace period -- and wait until none is left; the pids that survived
        (none, unless the kernel holds them in an uninterruptible state)."""
        launch = launch or self.launch
        if launch is None:
            return []
        pgid = self.proc.pid if self.proc is not None else None
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 5.0)):
            if pgid is not None:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pgid = None
            left = launch_pids(launch)
            for pid in left:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait_s
            while (left or pgid is not None) and time.monotonic() < deadline:
                if self.proc is not None:
                    self.proc.poll()  # reap our own child (the watchdog), else it stays a zombie
                time.sleep(0.1)
                left = launch_pids(launch)
                pgid = pgid if pgid is not None and _group_alive(pgid) else None
            if not left and pgid is None:
                return []
        if left:
            logger.error("processes %s of the training job's launch %s outlived SIGKILL", left, launch)
        return left

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
        """Relaunch after a failure while restarts are left; False when it stays down (and for
        the exits a relaunch cannot change: :data:`NO_RELAUNCH`)."""
        rc = self.poll()
        if rc is None or rc in NO_RELAUNCH or self.restarts >= self.job.max_restarts:
            return False
        self.restarts += 1
        logger.warning("training job exited with code %s: restart %d of %d (it resumes from its checkpoint)",
                       rc, self.restarts, self.job.max_restarts)
        self.start(restart=True)
        return True

    def batch_job(self) -> tuple[str, str] | None:
        """(scheduler, job id) when the training job is a batch job submitted and waited for
        (pilot mode on PBS and LSF): its client printed the id when it submitted."""
        batch = schedulers.waiting_on(self.line or "")
        if batch is None:
            return None
        job_id = batch.parse_job_id(tail_text(self.run_dir / "train.out", 1 << 16))
        return (batch.name, job_id) if job_id else None

    def _scheduler(self, sig: int | None) -> bool:
        """Signal (or, ``sig`` None, cancel) a submitted batch job through its scheduler; the
        client's process group would only lose the client. False if it is no batch job."""
        job = self.batch_job()
        if job is None:
            return False
        kind, job_id = job
        cmd = schedulers.get(kind).signal_argv(job_id, signal.Signals(sig).name[3:] if sig is not None else None)
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
        """End the job and everything of it (:meth:`reap`; a submitted batch job is cancelled
        through its scheduler first)."""
        if self.proc is None:
            return
        self.stopped = self.stopped or self.proc.poll() is None
        if self.running:
            self._scheduler(None)
        self.reap()
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
        used = (f"; {self.restarts} of {self.job.max_restarts} restart(s) used, "
                f"{_NOT_RELAUNCHED.get(self.returncode, 'none left')}"
                if self.returncode not in (None, 0, NOT_FINISHED) and self.job.max_restarts else "")
        err = self.run_dir / "train.err"
        cause = cause_line(err) or cause_line(self.run_dir / "train.out") or " / ".join(
            [line for line in tail_text(err).splitlines() if line.strip() and not _NOISE.search(line)][-3:])
        return (f"training job {what} after {(self.ended or time.monotonic()) - self.started:.1f} s{used} "
                f"(see {self.run_dir / 'train.err'}){': ' + cause if cause else ''}")

    def summary(self) -> dict:
        return {"argv": self.job.argv, "ranks": self.job.ranks, "nodes": self.job.nodes, "launch": self.line,
                "returncode": self.returncode, "restarts": self.restarts,
                **({"stopped_by": "campaign"} if self.stopped else {}),  # its returncode is then the launcher's
                "wall_s": round((self.ended or time.monotonic()) - self.started, 3) if self.started else None}
