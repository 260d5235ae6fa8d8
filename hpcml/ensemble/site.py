"""A machine as hpcml uses it: one typed :class:`Site` value per ``site_configs/<name>.py``.

A site is configuration, not code: its hardware facts, the module lines and environment of
its jobs, its queues, how a simulation and the training job are launched (command-line
templates), and the Parsl provider of a block. Everything that acts on a site -- building
the Parsl Config (:mod:`hpcml.ensemble.parsl_build`), writing batch scripts
(:mod:`hpcml.ensemble.jobscript`) -- reads these fields; nothing is looked up by ``getattr``.

Parsl is imported only inside builders: loading every site imports neither Parsl's
executors nor torch or mpi4py (``hpcml info``, ``hpcml job`` on a login node).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pkgutil
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hpcml.ensemble import rules, schedulers
from hpcml.ensemble.checks import check_count, drain_period, walltime_seconds, warning_seconds
from hpcml.ensemble.hardware import SCHEDULERS, SiteHardware
from hpcml.ensemble.rules import Account, EnvVar, Fact, Queue, Source
from hpcml.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from parsl.config import Config

__all__ = ["SCHEDULERS", "SIMS_LABEL", "Account", "EnvVar", "Fact", "Queue", "Site", "SiteHardware", "SiteRequest",
           "Source", "check_count", "drain_period", "list_sites", "load_site", "walltime_seconds", "warning_seconds"]

#: Label of the executor that runs simulations; the Campaign targets it by name.
SIMS_LABEL = "sims"
#: Package that holds one module per machine.
SITE_PACKAGE = "site_configs"
#: Launchers Parsl's ``MPIExecutor`` composes ``$PARSL_MPI_PREFIX`` for.
MPI_LAUNCHERS: tuple[str, ...] = ("srun", "mpiexec")

_PLACEHOLDERS = {"nodes", "ranks", "ranks_per_node"}


def _check_template(site: str, name: str, template: str) -> None:
    unknown = set(re.findall(r"{(\w*)}", template)) - _PLACEHOLDERS
    if unknown:
        raise ConfigError(f"site {site}: {name}={template!r} uses {sorted(unknown)}; "
                          f"templates may use {{nodes}}, {{ranks}} and {{ranks_per_node}}")


# ----------------------------------------------------------------------------- requests

@dataclass(frozen=True, kw_only=True)
class SiteRequest:
    """What a campaign asks of a site, validated once: the arguments of :meth:`Site.parsl_config`."""

    run_dir: str
    """Run directory of the campaign; Parsl writes under ``<run_dir>/parsl``."""
    nodes: int = 1
    """Nodes of the one block (batch job) that runs simulations (pilot mode)."""
    walltime: str = "01:00:00"
    """Walltime of that block, HH:MM:SS."""
    account: str | None = None
    """Allocation charged; None: the scheduler's default for the user."""
    queue: str | None = None
    """Queue, partition or QOS (the site says which); None: the site's default."""
    max_concurrent_sims: int = 4
    """Simulations wanted at once (a site may run fewer when they do not fit, and says so)."""
    sim_ranks: int = 2
    """MPI ranks of one simulation."""
    worker_init: str = ""
    """Extra shell lines run before the workers start, after the site's own."""
    retries: int = 2
    """Times Parsl reruns a failed simulation."""
    sim_nodes: tuple[str, ...] = ()
    """One-allocation mode: the nodes of the running job that simulations use (no block is
    submitted; Parsl's workers start here). Empty: pilot mode, Parsl submits a block."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_dir, (str, os.PathLike)) or not str(self.run_dir):
            raise ConfigError(f"run_dir={self.run_dir!r} must be a non-empty path")
        check_count("nodes", self.nodes)
        check_count("max_concurrent_sims", self.max_concurrent_sims)
        check_count("sim_ranks", self.sim_ranks)
        check_count("retries", self.retries, minimum=0)
        walltime_seconds(self.walltime)
        for field_name in ("account", "queue"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
                raise ConfigError(f"{field_name}={value!r} must be a non-empty word or None")
        if not isinstance(self.worker_init, str):
            raise ConfigError(f"worker_init={self.worker_init!r} must be a string of shell lines")
        object.__setattr__(self, "sim_nodes", tuple(self.sim_nodes))
        bad = [n for n in self.sim_nodes if not isinstance(n, str) or not re.fullmatch(r"[\w.-]+", n)]
        if bad:
            raise ConfigError(f"sim_nodes={bad!r} must be host names")

    @property
    def parsl_run_dir(self) -> str:
        """Where Parsl's own run directories (000, 001, ...) go: inside the campaign's."""
        return str(Path(self.run_dir) / "parsl")

    @property
    def block_nodes(self) -> int:
        """Nodes simulations run on: those given in one-allocation mode, else the block's."""
        return len(self.sim_nodes) or self.nodes


# ----------------------------------------------------------------------------- the site

@dataclass(frozen=True, kw_only=True)
class Site:
    """One machine: facts, job environment, launch lines and how Parsl reaches it.

    Launch lines are templates with ``{nodes}``, ``{ranks}`` and ``{ranks_per_node}``: a
    batch script fills them with shell expressions (``$SLURM_NNODES``) when the node count
    is only known at run time (``--nodes 1-2``).
    """

    hardware: SiteHardware
    modules: tuple[Fact, ...] = ()
    """Shell lines that load the modules hpcml was built against and its jobs need, each with why."""
    environment: tuple[EnvVar, ...] = ()
    """Environment of every job and worker (collective-network plugins, interfaces), each with why."""
    module_training_vars: tuple[str, ...] = ()
    """Variables a module of ``modules`` sets for the collective library alone (rccl-net-plugin's
    ``FI_CXI_RDZV_PROTO``): like ``EnvVar(training_only=True)``, MPI simulations run without them."""
    queues: tuple[Queue, ...] = ()
    """The facility's queue table (:func:`hpcml.ensemble.rules.pick_queue`); empty: the scheduler's default."""
    account: Account | None = None
    """Whether jobs must name their allocation (None: they need not)."""
    retired: str | None = None
    """Why and since when the machine takes no jobs (None: in service); ``hpcml job`` says so."""
    train_ranks_per_node: int = 1
    """Training ranks on one node: one per GPU (GCD, tile) on GPU machines."""
    train_launch: str = "mpiexec -n {ranks}"
    """The training job's launch line, e.g. ``srun -N{nodes} -n{ranks} -c7 --gpus-per-task=1``."""
    train_launch_why: str = "one training rank per device"
    """Why the launch line reads as it does (``hpcml job --explain``)."""
    train_launch_source: Source | None = None
    sim_launch: str = "$PARSL_MPI_PREFIX"
    """A simulation's launch prefix: ``$PARSL_MPI_PREFIX`` (composed by ``MPIExecutor`` from
    the task's resource spec) or a template with ``{ranks}`` (``jsrun -n{ranks} -a1 -c1``)."""
    mpi_launcher: str | None = None
    """``srun`` or ``mpiexec``: simulations run under Parsl's ``MPIExecutor``; None: a plain
    executor whose tasks name their launcher in ``sim_launch`` (jsrun, local ``mpiexec``)."""
    block_options: Mapping[str, Any] = field(default_factory=dict)
    """Facts for the Parsl provider of a block, e.g. ``{"constraint": "gpu", "gpus_per_node": 4}``."""
    select_options: str = ""
    """PBS only: what follows ``select=N:`` (``system=polaris``)."""
    select_source: Source | None = None
    job_directives: tuple[Fact, ...] = ()
    """Extra header lines of every batch job (``#PBS -l filesystems=...``, ``#SBATCH -C gpu``)."""
    stream_interface: str | None = None
    """Network interface the trainers' stream servers bind on this machine (None: loopback,
    one node only)."""
    config: Callable[[Site, SiteRequest], Config] | None = None
    """Builds the whole Parsl Config instead of the batch default (the local site's threads)."""

    def __post_init__(self) -> None:
        hw = self.hardware
        if not isinstance(hw, SiteHardware):
            raise ConfigError(f"Site.hardware must be a SiteHardware, got {type(hw).__name__}")
        check_count(f"site {hw.name}: train_ranks_per_node", self.train_ranks_per_node)
        if hw.gpus_per_node and self.train_ranks_per_node != hw.gpus_per_node:
            raise ConfigError(f"site {hw.name}: train_ranks_per_node={self.train_ranks_per_node} must equal "
                              f"gpus_per_node={hw.gpus_per_node} (one training rank per device)")
        _check_template(hw.name, "train_launch", self.train_launch)
        _check_template(hw.name, "sim_launch", self.sim_launch)
        if not isinstance(self.module_training_vars, tuple) or not all(
                isinstance(n, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in self.module_training_vars):
            raise ConfigError(f"site {hw.name}: module_training_vars={self.module_training_vars!r} must be a tuple of "
                              f"variable names")
        if self.mpi_launcher not in (None, *MPI_LAUNCHERS):
            raise ConfigError(f"site {hw.name}: mpi_launcher={self.mpi_launcher!r} must be one of "
                              f"{', '.join(MPI_LAUNCHERS)} or None")
        if (self.mpi_launcher is not None) != self.sim_launch.endswith("$PARSL_MPI_PREFIX"):
            raise ConfigError(f"site {hw.name}: sim_launch='[env ...] $PARSL_MPI_PREFIX' goes with an mpi_launcher "
                              f"(MPIExecutor composes it), got mpi_launcher={self.mpi_launcher!r} and "
                              f"sim_launch={self.sim_launch!r}")
        for name, items, kind in (("modules", self.modules, Fact), ("environment", self.environment, EnvVar),
                                  ("queues", self.queues, Queue), ("job_directives", self.job_directives, Fact)):
            if not isinstance(items, tuple) or not all(isinstance(i, kind) for i in items):
                raise ConfigError(f"site {hw.name}: {name} must be a tuple of {kind.__name__}")
        kinds = schedulers.get(hw.scheduler).queue_kinds
        bad = [q.name for q in self.queues if q.kind not in kinds]
        if bad:
            raise ConfigError(f"site {hw.name}: queues {bad} must be of kind {' or '.join(kinds)} on {hw.scheduler}")
        if hw.scheduler == "local" and (self.queues or self.account):
            raise ConfigError(f"site {hw.name}: a local site has no queues or accounts")

    # -- names ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.hardware.name

    @property
    def scheduler(self) -> str:
        return self.hardware.scheduler

    @property
    def has_gpus(self) -> bool:
        return self.hardware.gpus_per_node > 0

    @property
    def batch(self) -> schedulers.Scheduler:
        """The batch system's class: directives, submission, requeue, launcher."""
        return schedulers.get(self.scheduler)

    @property
    def env(self) -> dict[str, str]:
        return {v.name: v.value for v in self.environment}

    def pick_queue(self, nodes: int, walltime: str, queue: str | None = None) -> Queue | None:
        """The queue row a job of ``nodes`` for ``walltime`` goes to (``queue`` checked when named);
        a one-line ConfigError when none fits. None: no table, the scheduler's default (or ``queue``)."""
        return rules.pick_queue(self.name, self.queues, nodes, walltime, queue)

    def account_for(self, account: str | None) -> str | None:
        """``account`` or ``$HPCML_ACCOUNT``; refused in one line where the site requires one."""
        return rules.account_for(self.name, self.account, account)

    # -- launch lines -----------------------------------------------------------------------
    def train_ranks(self, nodes: int) -> int:
        """Ranks of a training job on ``nodes`` whole nodes."""
        return check_count("nodes", nodes) * self.train_ranks_per_node

    def train_line(self, argv: Sequence[str], *, nodes: int = 1, ranks: int | None = None,
                   hosts: Sequence[str] = ()) -> str:
        """The training job's command: the site's launch line for ``ranks`` (default: every
        device of ``nodes``) then ``argv``; ``hosts`` pins it to those nodes of the job."""
        nodes = check_count("nodes", nodes)
        if ranks is None:
            ranks = self.train_ranks(nodes)
        check_count("ranks", ranks)
        if ranks < nodes:
            raise ConfigError(f"ranks={ranks} < nodes={nodes}: every node needs a training rank")
        if self.has_gpus and ranks > self.train_ranks(nodes):
            raise ConfigError(f"ranks={ranks} > {self.train_ranks(nodes)} devices on nodes={nodes} of {self.name} "
                              f"({self.train_ranks_per_node} per node): one rank per device")
        line = self.train_launch.format(nodes=nodes, ranks=ranks, ranks_per_node=math.ceil(ranks / nodes))
        return shell_join(self.batch.pin_hosts(line, hosts), argv)

    def sim_prefix(self, ranks: int) -> str:
        """The launch prefix of one simulation of ``ranks`` MPI ranks, without the collective
        library's variables (``EnvVar(training_only=True)``): those are training's alone."""
        line = self.sim_launch.format(ranks=check_count("ranks", ranks), nodes=1, ranks_per_node=ranks)
        names = [*(v.name for v in self.environment if v.training_only), *self.module_training_vars]
        return " ".join(["env", *(f"-u {n}" for n in names), line]) if names else line

    def sim_resource_spec(self, ranks: int) -> dict[str, int]:
        """``parsl_resource_specification`` of one simulation: fewest whole nodes, ranks
        spread evenly, under ``MPIExecutor``; nothing for a plain executor."""
        check_count("ranks", ranks)
        if self.mpi_launcher is None:
            return {}
        num_nodes = math.ceil(ranks / self.hardware.cpu_cores_per_node)
        return {"num_nodes": num_nodes, "num_ranks": ranks, "ranks_per_node": math.ceil(ranks / num_nodes)}

    # -- Parsl --------------------------------------------------------------------------------
    def parsl_config(self, *, run_dir: str, nodes: int = 1, walltime: str = "01:00:00", account: str | None = None,
                     queue: str | None = None, max_concurrent_sims: int = 4, sim_ranks: int = 2,
                     worker_init: str = "", retries: int = 2, sim_nodes: Sequence[str] = ()) -> Config:
        """The Parsl Config that runs this site's simulations (see :class:`SiteRequest`)."""
        from hpcml.ensemble import parsl_build

        request = SiteRequest(run_dir=run_dir, nodes=nodes, walltime=walltime, account=account, queue=queue,
                              max_concurrent_sims=max_concurrent_sims, sim_ranks=sim_ranks, worker_init=worker_init,
                              retries=retries, sim_nodes=tuple(sim_nodes))
        if self.config is not None:
            return self.config(self, request)
        return parsl_build.sims_config(self, request)

    def __repr__(self) -> str:
        return f"Site(name={self.name!r}, scheduler={self.scheduler!r}, gpus_per_node={self.hardware.gpus_per_node})"


# ----------------------------------------------------------------------------- job environment

def python_env_line() -> str:
    """The shell line that puts this Python environment first on PATH in a batch job.

    Workers must run the interpreter (and ``process_worker_pool.py``) of the driver: the
    virtual environment it runs in is activated, or its ``bin`` put first on PATH.
    """
    prefix = shlex.quote(sys.prefix)
    if sys.prefix != sys.base_prefix:
        return f"source {prefix}/bin/activate"
    return f"export PATH={prefix}/bin:$PATH"


def environment_lines(site: Site, extra: str = "") -> list[str]:
    """The site's module lines, its environment, this Python environment, then ``extra``."""
    lines = [*(m.script for m in site.modules), *(v.line for v in site.environment), python_env_line()]
    if extra.strip():
        lines.append(extra.strip())
    return lines


def host_memory_gib() -> float:
    """Physical memory of this machine in GiB (for a local site's facts)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):  # not POSIX: a conservative guess
        return 1.0


def shell_join(prefix: str, argv: Sequence[str]) -> str:
    """``prefix`` then ``argv`` shell-quoted: the launch line of one MPI job."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"argv={argv!r} must be a non-empty list of strings")
    return f"{prefix} {shlex.join(argv)}"


# ----------------------------------------------------------------------------- finding sites

def _site_package() -> ModuleType:
    """``site_configs``: importable from the checkout root, else loaded from next to ``hpcml``.

    The package is not installed with hpcml (it is configuration to edit), so a script run
    from ``workflows/`` finds it through the checkout that holds this editable install.
    """
    if SITE_PACKAGE in sys.modules:
        return sys.modules[SITE_PACKAGE]
    try:
        return importlib.import_module(SITE_PACKAGE)
    except ModuleNotFoundError as exc:
        if exc.name != SITE_PACKAGE:
            raise
    init = Path(__file__).resolve().parents[2] / SITE_PACKAGE / "__init__.py"
    if not init.is_file():
        raise ConfigError(f"no {SITE_PACKAGE} package: not importable and not at {init.parent}")
    spec = importlib.util.spec_from_file_location(SITE_PACKAGE, init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[SITE_PACKAGE] = package
    spec.loader.exec_module(package)
    return package


def _module_name(name: str) -> str:
    return name.replace("-", "_")


def list_sites() -> list[str]:
    """Names of the sites, sorted, as users type them (``slurm-local`` for ``slurm_local.py``)."""
    package = _site_package()
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(package.__path__)
                  if not m.name.startswith("_"))


def load_site(name: str | Site) -> Site:
    """The :class:`Site` of ``site_configs/<name>.py`` (``-`` and ``_`` alike); an unknown
    name raises ConfigError listing the known ones."""
    if isinstance(name, Site):
        return name
    known = list_sites()
    if not isinstance(name, str) or name.replace("_", "-") not in known:
        raise ConfigError(f"unknown site {name!r}: known sites are {', '.join(known)}")
    module = importlib.import_module(f"{SITE_PACKAGE}.{_module_name(name)}")
    site = getattr(module, "SITE", None)
    if not isinstance(site, Site):
        raise ConfigError(f"{module.__name__} must define SITE = Site(...), got {type(site).__name__}")
    return site
