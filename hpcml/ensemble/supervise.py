"""The campaign's training job, watched: while simulations run (a trainer that stopped ends
the campaign, restarted first after a failure while allowed) and to its end (its exit code and
its accounting of samples decide the campaign's outcome). Exit 75 is a trainer that was told
to stop and saved: the campaign is interrupted, not failed."""

from __future__ import annotations

from collections.abc import Callable

from hpcml.ensemble import ledger
from hpcml.ensemble.stopping import StopPolicy
from hpcml.ensemble.trainer_proc import TrainerProcess
from hpcml.env import NOT_FINISHED
from hpcml.errors import LaunchError
from hpcml.log import get_logger

logger = get_logger(__name__)

TRAINER_STOPPED = "trainer saved and stopped (exit 75)"


class TrainerWatch:
    """``trainer`` under ``stops``; ``accounting()`` reads its summary's samples (expected,
    ingested, missing). After :meth:`check` or :meth:`wait`, ``samples`` holds that accounting
    and ``error`` why the campaign failed (LaunchError raised with it)."""

    def __init__(self, trainer: TrainerProcess, stops: StopPolicy, accounting: Callable[[], dict | None]) -> None:
        self.trainer, self.stops, self._accounting = trainer, stops, accounting
        self.samples: dict | None = None
        self.error: str | None = None

    def check(self) -> None:
        """While simulations remain: LaunchError when the trainer stopped for good."""
        t = self.trainer
        if t.poll() is None or (not self.stops.stopping() and t.restart_if_allowed()):
            return
        rc = t.returncode
        if rc == NOT_FINISHED:
            return self.stops.note(TRAINER_STOPPED)
        what = f"exited with code {rc}" if rc != 0 else "exited with code 0 before the simulations were done"
        # its accounting, as when it ends after the simulations: a trainer that read every end marker
        # may exit before this driver has seen the last simulation end (a loaded machine)
        self.samples = self._accounting()
        missing = (self.samples or {}).get("missing")
        self._fail(ledger.missing_line(self.samples) if missing else t.message(what))

    def wait(self, *, timeout_s: float | None, tick: Callable[[], None], poll_s: float) -> None:
        """To the trainer's end, and nothing of it left; LaunchError when it failed or lost samples."""
        t = self.trainer
        rc = t.wait(timeout_s=timeout_s, tick=tick, poll_s=poll_s, stop_requested=self.stops.stopping,
                    save_window=self.stops.save_window)
        t.reap()  # nothing of it may outlive the campaign (a launcher's orphaned ranks)
        self.samples = self._accounting()
        missing = (self.samples or {}).get("missing")
        if rc == NOT_FINISHED:
            self.stops.note(TRAINER_STOPPED)
        elif rc != 0 and self.stops.reason is not None:  # the last periodic checkpoint is what resumes
            logger.error(t.message(f"exited with code {rc} while stopping, not 75: the next run resumes from "
                                   f"its last periodic checkpoint"))
        elif rc != 0 or missing:
            self._fail(ledger.missing_line(self.samples) if missing else t.message(f"exited with code {rc}"))

    def _fail(self, error: str) -> None:
        self.error = error
        raise LaunchError(error)
