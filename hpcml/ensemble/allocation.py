"""The batch job a campaign driver runs inside (one-allocation mode): its nodes and its end.

Inside an allocation the training job takes the first nodes and the simulations the
others (``split``); every timeout follows from the job's deadline, read from
``HPCML_JOB_DEADLINE`` (``hpcml job`` scripts set it) or asked of the scheduler.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from hpcml import env
from hpcml.ensemble.site import Site
from hpcml.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Allocation:
    """The running batch job: scheduler, id, its compute nodes in order, when its walltime ends."""

    scheduler: str
    job_id: str
    nodes: tuple[str, ...]
    deadline: float | None
    """Epoch seconds of the walltime's end; None when neither the job nor the scheduler says."""

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()

    def split(self, train_nodes: int, *, sims: bool = True) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(training nodes, simulation nodes): the first ``train_nodes`` for training; with
        no simulations (``sims`` False: offline training) none is kept for them."""
        if not sims:
            if len(self.nodes) < train_nodes:
                raise ConfigError(f"job {self.job_id} has {len(self.nodes)} node(s) ({', '.join(self.nodes)}); the "
                                  f"training job needs {train_nodes}: ask for {train_nodes} or more nodes")
            return self.nodes[:train_nodes], ()
        if len(self.nodes) <= train_nodes:
            raise ConfigError(f"job {self.job_id} has {len(self.nodes)} node(s) ({', '.join(self.nodes)}); the "
                              f"training job takes {train_nodes} and the simulations need at least one more: "
                              f"ask for {train_nodes + 1} or more nodes")
        return self.nodes[:train_nodes], self.nodes[train_nodes:]


def current(site: Site, environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The batch job of ``site``'s scheduler this process runs in, or None (a login node,
    another scheduler's job, or the local site)."""
    environ = os.environ if environ is None else environ
    launch = env.detect(environ)
    if site.scheduler == "local" or launch.scheduler != site.scheduler or not launch.job_id:
        return None
    deadline = env.job_deadline(environ)
    if deadline is None:
        deadline = site.batch.deadline(launch.job_id, environ)
    return Allocation(scheduler=site.scheduler, job_id=launch.job_id, nodes=site.batch.nodes(environ),
                      deadline=deadline)
