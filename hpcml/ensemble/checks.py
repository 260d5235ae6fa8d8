"""Checked values of a job request: counts and walltimes, with the warning and drain times that
follow from a walltime. Pure functions; every site, scheduler and job script reads them."""

from __future__ import annotations

import re

from hpcml.errors import ConfigError
from hpcml.numeric import is_int

__all__ = ["check_count", "drain_period", "walltime_seconds", "warning_seconds"]

_WALLTIME = re.compile(r"(\d{1,3}):([0-5]\d):([0-5]\d)")


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else a one-line ConfigError naming it."""
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def walltime_seconds(walltime: object) -> int:
    """Seconds of an ``HH:MM:SS`` walltime; at least one minute (Slurm reads 0 minutes as no limit)."""
    match = _WALLTIME.fullmatch(walltime) if isinstance(walltime, str) else None
    if match is None:
        raise ConfigError(f"walltime={walltime!r} must be HH:MM:SS, e.g. '01:30:00'")
    hours, minutes, seconds = (int(g) for g in match.groups())
    if hours * 60 + minutes < 1:
        raise ConfigError(f"walltime={walltime!r} is under one minute: schedulers round it to 0 (no limit or reject)")
    return hours * 3600 + minutes * 60 + seconds


def warning_seconds(walltime: str) -> int:
    """Seconds before the walltime at which a job is told to save and stop: a tenth of it,
    1 to 10 minutes (Slurm may send its signal up to a minute early; a save must fit), at
    most half of a walltime of 2 minutes or less."""
    total = walltime_seconds(walltime)
    return min(600, max(60, total // 10), total // 2)


def drain_period(walltime: str) -> int:
    """Seconds after a block starts at which its workers stop taking new simulations.

    The last tenth of the walltime (1 to 10 minutes) starts nothing, so a simulation is not
    killed by the walltime half-way and charged a retry (Parsl #1905, #3059).
    """
    total = walltime_seconds(walltime)
    return total - warning_seconds(walltime) if total > 120 else total // 2
