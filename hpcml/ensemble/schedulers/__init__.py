"""Batch systems as classes (Slurm, PBS, LSF, Local); a site names one by its ``scheduler``."""

from __future__ import annotations

from hpcml.ensemble.schedulers.base import Resubmitting, Scheduler, SubmitError
from hpcml.ensemble.schedulers.local import Local
from hpcml.ensemble.schedulers.lsf import LSF
from hpcml.ensemble.schedulers.pbs import PBS
from hpcml.ensemble.schedulers.slurm import Slurm
from hpcml.errors import ConfigError

__all__ = ["LSF", "PBS", "Local", "Resubmitting", "Scheduler", "Slurm", "SubmitError", "get", "waiting_on"]

_BY_NAME: dict[str, Scheduler] = {cls.name: cls() for cls in (Slurm, PBS, LSF, Local)}


def waiting_on(line: str) -> Resubmitting | None:
    """The scheduler whose submit-and-wait client heads ``line`` (``qsub -W block=true ...``,
    ``bsub -K < ...``): a pilot trainer that is a batch job of its own; None otherwise."""
    head = line.split(" ", 1)[0]
    return next((s for s in _BY_NAME.values() if isinstance(s, Resubmitting)
                 and s.submit_and_wait.split(" ", 1)[0] == head), None)


def get(name: str) -> Scheduler:
    """The scheduler called ``name`` (``slurm``, ``pbs``, ``lsf``, ``local``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"scheduler {name!r} is not one of {', '.join(_BY_NAME)}") from None
