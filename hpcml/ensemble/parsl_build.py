"""Parsl Configs for a :class:`~hpcml.ensemble.site.Site`: the one place Parsl executors
and providers are built.

Two ways a campaign meets a batch system:

- **pilot** (driver on a login node): the site's provider submits one block of
  ``nodes``; its workers start each simulation with the MPI launcher on nodes of the block.
- **one allocation** (driver inside the user's batch job): no block is submitted; Parsl's
  workers start on this node under a ``LocalProvider`` and place simulations on the nodes
  given to them (``SiteRequest.sim_nodes``); the training job has the others. Parsl's
  ``MPIExecutor`` reads a job's nodes from ``$SLURM_NODELIST`` / ``$PBS_NODEFILE``, so the
  workers' environment names only the simulations' nodes.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcml.ensemble.site import SIMS_LABEL, Site, SiteRequest, drain_period, environment_lines
from hpcml.errors import ConfigError
from hpcml.log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from parsl.config import Config
    from parsl.providers.base import ExecutionProvider

logger = get_logger(__name__)


def block_options(site: Site, request: SiteRequest) -> dict[str, Any]:
    """Provider arguments shared by every batch scheduler: one block of ``nodes`` held for the campaign.

    ``min_blocks=1`` keeps the allocation through pauses between waves of simulations (no
    new queue wait); ``SimpleLauncher`` is what ``MPIExecutor`` requires: one worker pool on
    the first node, which starts each simulation with the MPI launcher.
    """
    from parsl.launchers import SimpleLauncher

    return {"nodes_per_block": request.nodes, "walltime": request.walltime, "init_blocks": 1,
            "min_blocks": 1, "max_blocks": 1, "launcher": SimpleLauncher(),
            "worker_init": "\n".join(environment_lines(site, request.worker_init))}


def sims_at_once(site: Site, request: SiteRequest) -> int:
    """How many simulations of ``request.sim_ranks`` ranks can run at once on their nodes.

    Under ``MPIExecutor`` every task gets whole nodes, so simulations never share a node
    (Parsl #3927); otherwise (jsrun) ranks are packed on cores. A wish above what fits is
    lowered with a warning; one simulation that does not fit is an error (it would wait for ever).
    """
    hw, ranks, nodes = site.hardware, request.sim_ranks, request.block_nodes
    whole_nodes = site.mpi_launcher is not None
    if whole_nodes:
        fit = nodes // site.sim_resource_spec(ranks)["num_nodes"]
    else:
        fit = nodes * hw.cpu_cores_per_node // ranks
    if fit < 1:
        raise ConfigError(f"a simulation of sim_ranks={ranks} does not fit in nodes={nodes} of {hw.name} "
                          f"({hw.cpu_cores_per_node} cores each)")
    if request.max_concurrent_sims > fit:
        why = "whole nodes per MPI task, Parsl #3927" if whole_nodes else "one core per rank"
        logger.log(logging.INFO if request.sim_nodes else logging.WARNING,
                   "%s: max_concurrent_sims=%d lowered to %d: %d sims of %d ranks fit in %d nodes (%s)",
                   hw.name, request.max_concurrent_sims, fit, fit, ranks, nodes, why)
    return min(request.max_concurrent_sims, fit)


def allocation_worker_init(site: Site, request: SiteRequest) -> str:
    """Worker init inside a running job: the site's environment, and the job's node list
    narrowed to the simulations' nodes (what ``MPIExecutor`` places tasks on)."""
    lines = environment_lines(site, request.worker_init)
    lines += site.batch.narrow_nodes(request.sim_nodes, Path(request.run_dir))
    return "\n".join(lines)


def provider_for(site: Site, request: SiteRequest) -> ExecutionProvider:
    """The site's block provider (pilot), or a ``LocalProvider`` inside the running job.

    A block is a batch job like any other: its queue is chosen from the site's table by
    nodes and walltime, and a site that requires an account refuses one without (here,
    before Parsl submits anything)."""
    if not request.sim_nodes:
        queue = site.pick_queue(request.nodes, request.walltime, request.queue)
        account = site.account_for(request.account)
        request = dataclasses.replace(request, account=account)
        return site.batch.provider(site, request, queue, block_options(site, request))
    from parsl.launchers import SimpleLauncher
    from parsl.providers import LocalProvider

    return LocalProvider(launcher=SimpleLauncher(), init_blocks=1, min_blocks=1, max_blocks=1,
                         worker_init=allocation_worker_init(site, request))


def sims_config(site: Site, request: SiteRequest) -> Config:
    """The Parsl Config of a batch site: one executor labelled ``sims``.

    ``mpi_launcher`` ("srun", "mpiexec") selects Parsl's ``MPIExecutor``, which fills
    ``$PARSL_MPI_PREFIX`` from each task's ``parsl_resource_specification``; None selects a
    plain ``HighThroughputExecutor`` whose tasks name their launcher themselves (jsrun on
    LSF, which ``MPIExecutor`` cannot place tasks on). Connections between the driver and
    workers are encrypted: other users share the login nodes' network.
    """
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor, MPIExecutor

    at_once = sims_at_once(site, request)
    provider = provider_for(site, request)
    common: dict[str, Any] = {"label": SIMS_LABEL, "provider": provider, "encrypted": True}
    interchange = Path(sys.prefix) / "bin" / "interchange.py"
    if interchange.is_file():  # the driver's own environment, whether or not it is on PATH (a path:
        common["interchange_launch_cmd"] = str(interchange)  # MPIExecutor types it str, HTEX Sequence[str])
    if request.sim_nodes:  # the workers start beside the interchange: loopback
        common["address"] = "127.0.0.1"
    else:  # a block of its own: stop taking simulations before its walltime
        common["drain_period"] = drain_period(request.walltime)
    if site.mpi_launcher is not None:
        executor = MPIExecutor(mpi_launcher=site.mpi_launcher, max_workers_per_block=at_once, **common)
    else:
        executor = HighThroughputExecutor(max_workers_per_node=at_once, cores_per_worker=1e-3, **common)
    return Config(executors=[executor], run_dir=request.parsl_run_dir, retries=request.retries, usage_tracking=0,
                  strategy_period=0.5)


def thread_config(site: Site, request: SiteRequest) -> Config:
    """Threads that run up to ``max_concurrent_sims`` bash_apps at once, each an ``mpiexec``:
    one machine, no scheduler (a thread only waits on its child, so threads cost nothing)."""
    from parsl.config import Config
    from parsl.executors import ThreadPoolExecutor

    executor = ThreadPoolExecutor(label=SIMS_LABEL, max_threads=request.max_concurrent_sims)
    return Config(executors=[executor], run_dir=request.parsl_run_dir, retries=request.retries,
                  usage_tracking=0, strategy="none")


def resolve_config(given: Any, run_dir: Path, make: Callable[[], Config]) -> Config:
    """The Parsl Config a driver loads: ``given`` (a Config, or a zero-argument callable making
    one), else ``make()`` (the site's); one whose ``run_dir`` is Parsl's default keeps its
    files in the campaign's or search's run directory."""
    cfg = (given() if callable(given) else given) if given is not None else make()
    if getattr(cfg, "run_dir", None) == "runinfo":
        cfg.run_dir = str(run_dir / "parsl")
    return cfg


def executor_label(cfg: Any) -> str:
    """The label of the executor that runs simulations in ``cfg``."""
    labels = [e.label for e in getattr(cfg, "executors", [])]
    if SIMS_LABEL in labels:
        return SIMS_LABEL
    if len(labels) == 1:
        return labels[0]
    raise ConfigError(f"the Parsl config needs an executor labelled {SIMS_LABEL!r} for the simulations, got {labels}")
