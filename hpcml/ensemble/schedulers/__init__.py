"""Batch systems as classes (Slurm, PBS, LSF, Local); a site names one by its ``scheduler``."""

from __future__ import annotations

from hpcml.ensemble.schedulers.base import Scheduler, SubmitError
from hpcml.ensemble.schedulers.local import Local
from hpcml.ensemble.schedulers.lsf import LSF
from hpcml.ensemble.schedulers.pbs import PBS
from hpcml.ensemble.schedulers.slurm import Slurm
from hpcml.errors import ConfigError

__all__ = ["LSF", "PBS", "Local", "Scheduler", "Slurm", "SubmitError", "get"]

_BY_NAME: dict[str, Scheduler] = {cls.name: cls() for cls in (Slurm, PBS, LSF, Local)}


def get(name: str) -> Scheduler:
    """The scheduler called ``name`` (``slurm``, ``pbs``, ``lsf``, ``local``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"scheduler {name!r} is not one of {', '.join(_BY_NAME)}") from None
