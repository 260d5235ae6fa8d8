"""Fault injection for reliability tests: a training rank that kills itself with SIGKILL (as a
lost node or the OOM killer would: no handler runs, nothing is saved) after a given step, in
the first ``times`` launches of a job -- so a test, or a user checking their own campaign's
restart policy, sees a real crash and a real relaunch that resumes from the checkpoint.

The launches are counted in a small file of the run directory (read as untrusted input:
bounded, a regular file, no link followed).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from hpcml import env, safeio
from hpcml.errors import ConfigError
from hpcml.numeric import is_int


@dataclass(frozen=True, kw_only=True)
class KillAtStep:
    """An ``on_step`` hook (:func:`hpcml.train.train_surrogate`, ``OnlineRun``): trainer rank
    ``rank`` kills itself after step ``step`` in each of the first ``times`` launches, counted
    in ``marker``."""

    step: int
    marker: Path
    rank: int = 0
    times: int = 1

    def __post_init__(self) -> None:
        for name, least in (("step", 1), ("rank", 0), ("times", 1)):
            v = getattr(self, name)
            if not is_int(v) or v < least:
                raise ConfigError(f"KillAtStep {name}={v!r}: expected an integer >= {least}")
        text = safeio.read_text(self.marker, 64, "a count of crashes")
        crashed = text.strip() if text is not None else "0"
        if not crashed.isdigit():
            raise ConfigError(f"{self.marker} holds {crashed[:20]!r}: expected a count of crashes (delete it)")
        object.__setattr__(self, "_crashed", int(crashed))  # the launches that crashed before this one
        object.__setattr__(self, "_rank", env.detect().rank)

    def __call__(self, metrics: dict) -> None:
        rank, crashed = self._rank, self._crashed  # type: ignore[attr-defined]
        if (metrics.get("step"), rank) != (self.step, self.rank) or crashed >= self.times:
            return
        safeio.replace(self.marker, str(crashed + 1))
        print(f"[train] reliability test: killing trainer rank {rank} after step {self.step} (crash "
              f"{crashed + 1} of {self.times})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["KillAtStep"]
