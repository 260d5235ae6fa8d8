"""When a campaign stops, and how long its trainer then has to save.

A campaign stops at a walltime warning (SIGUSR1/SIGTERM reaching the driver), when its
walltime is :data:`SAVE_MARGIN_S` away and no warning came, or when its trainer stopped itself
(exit 75). The first reason is kept; the rest of the campaign reads it (cancel what runs, ask
the trainer to save and stop, report ``interrupted``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hpcml import stop
from hpcml.log import get_logger

logger = get_logger(__name__)

#: Seconds before the walltime at which the campaign stops by itself if no warning came:
#: time for the trainer's last save and the driver's report.
SAVE_MARGIN_S = 60.0
#: Seconds before the walltime by which a trainer asked to stop must be gone.
LAST_SECONDS_S = 5.0
#: A trainer's save window after a stop request when there is no walltime (a signal to a local driver).
SAVE_WINDOW_S = 120.0


class StopPolicy:
    """Whether the campaign must stop, and why (the first reason); ``deadline``: the walltime's
    end (seconds since the epoch, None: none known); ``signals``: a walltime warning to this
    process counts (the driver installed the handlers)."""

    def __init__(self, deadline: float | None, *, signals: bool, clock: Callable[[], float] = time.time) -> None:
        self.deadline, self.signals, self._clock = deadline, signals, clock
        self.reason: str | None = None

    def stopping(self) -> bool:
        """True once the campaign must stop (a warning came, the walltime is near, or a reason was noted)."""
        if self.reason is None:
            if self.signals and stop.requested():
                self.reason = stop.requested()
            elif self.deadline is not None and self._clock() > self.deadline - SAVE_MARGIN_S:
                self.reason = f"walltime: {SAVE_MARGIN_S:.0f} s left and no warning came"
            if self.reason is not None:
                logger.warning("%s: stopping the campaign: cancelling simulations, then the trainer saves and "
                               "stops", self.reason)
        return self.reason is not None

    def note(self, reason: str) -> None:
        """Stop for ``reason`` unless a reason came first (the trainer stopped itself)."""
        self.reason = self.reason or reason

    def save_window(self) -> float:
        """Seconds a trainer asked to stop has to save: until just before the walltime."""
        if self.deadline is None:
            return SAVE_WINDOW_S
        return self.deadline - self._clock() - LAST_SECONDS_S
