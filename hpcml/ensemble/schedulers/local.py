"""No batch system: this machine, MPICH's Hydra ``mpiexec``."""

from __future__ import annotations

from hpcml.ensemble.schedulers.base import Scheduler


class Local(Scheduler):
    name = "local"
    launcher = "mpiexec"
