"""What a machine is and how Parsl reaches it: shared by every ``site_configs/<name>.py``.

A site module holds configuration only -- hardware facts, module lines, the provider it
uses, its launch lines -- and calls the builders here, so that the checks (walltime,
counts), the layout of simulations on nodes and the Parsl executor are written once.

Parsl is imported inside the builders: ``SiteHardware``, ``list_sites`` and the checks stay
cheap to import (``hpcml info``, the CLI). Nothing here imports torch or mpi4py.
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
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from hpcml.errors import ConfigError
from hpcml.log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from parsl.config import Config
    from parsl.providers.base import ExecutionProvider

logger = get_logger(__name__)

#: Batch systems a site may declare.
SCHEDULERS: tuple[str, ...] = ("slurm", "lsf", "pbs", "local")
#: Label of the executor that runs simulations; the Campaign targets it by name.
SIMS_LABEL = "sims"
#: Package that holds one module per machine.
SITE_PACKAGE = "site_configs"
#: Stands for the worker-pool command in a rendered batch script: Parsl composes the real
#: one (interchange addresses, ports) only when the executor starts.
WORKER_COMMAND_PLACEHOLDER = "process_worker_pool.py <composed by Parsl at start>"

_WALLTIME = re.compile(r"(\d{1,3}):([0-5]\d):([0-5]\d)")


@dataclass(frozen=True, kw_only=True)
class SiteHardware:
    """One compute node of a machine, as the facility documents it (sources: docs/sites/).

    A "GPU" is the device one training rank drives: a GCD of an MI250X on Frontier, a
    tile (stack) of a Max 1550 on Aurora, a whole GPU elsewhere.
    """

    name: str
    """Site name, as in ``site_configs/<name>.py``."""
    gpus_per_node: int
    """Devices one node offers to training ranks (0 on a CPU-only machine)."""
    gpu_model: str
    """Device model in words, e.g. "AMD MI250X (one GCD)"; "none" without GPUs."""
    cpu_cores_per_node: int
    """Physical CPU cores a job can use per node, after the cores the site keeps for the OS."""
    memory_gb_per_node: float
    """Host memory per node in GiB."""
    gpu_memory_gb: float
    """Memory of one device in GiB (0 without GPUs)."""
    peak_tflops_bf16_per_gpu: float
    """Dense bf16 peak of one device in TFLOP/s (matrix units, no sparsity); the MFU denominator."""
    peak_tflops_fp32_per_gpu: float
    """Dense FP32 peak of one device in TFLOP/s without TF32: matrix units where the hardware
    has FP32 ones (MI250X), vector units otherwise."""
    node_injection_gbps: float
    """Network bandwidth into one node in GB/s, all NICs together, one direction (0: one node)."""
    intra_node_link: str
    """How devices talk inside a node, with bandwidths, e.g. "NVLink 3: 100 GB/s per pair"."""
    scheduler: str
    """Batch system: one of ``SCHEDULERS``."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ConfigError(f"site name {self.name!r} must be a Python identifier (it names a module)")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"site {self.name}: scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        for field_name in ("gpus_per_node", "cpu_cores_per_node"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"site {self.name}: {field_name}={value!r} must be an integer >= 0")
        if self.cpu_cores_per_node < 1:
            raise ConfigError(f"site {self.name}: cpu_cores_per_node={self.cpu_cores_per_node} must be >= 1")
        if not self.memory_gb_per_node > 0:
            raise ConfigError(f"site {self.name}: memory_gb_per_node={self.memory_gb_per_node} must be > 0")
        if self.node_injection_gbps < 0:
            raise ConfigError(f"site {self.name}: node_injection_gbps={self.node_injection_gbps} must be >= 0")
        per_gpu = ("gpu_memory_gb", "peak_tflops_bf16_per_gpu", "peak_tflops_fp32_per_gpu")
        for field_name in per_gpu:
            value = getattr(self, field_name)
            if self.gpus_per_node > 0 and not value > 0:
                raise ConfigError(f"site {self.name}: {field_name}={value} must be > 0 "
                                  f"with gpus_per_node={self.gpus_per_node}")
            if self.gpus_per_node == 0 and value != 0:
                raise ConfigError(f"site {self.name}: {field_name}={value} must be 0 with gpus_per_node=0")

    @property
    def peak_tflops_bf16_per_node(self) -> float:
        """Dense bf16 peak of all devices of one node in TFLOP/s."""
        return self.gpus_per_node * self.peak_tflops_bf16_per_gpu


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


def list_sites() -> list[str]:
    """Names of the site modules, sorted (``local`` is the default for this machine)."""
    package = _site_package()
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def load_site(name: str) -> ModuleType:
    """The module ``site_configs.<name>``; an unknown name raises ConfigError listing the known ones."""
    known = list_sites()
    if name not in known:
        raise ConfigError(f"unknown site {name!r}: known sites are {', '.join(known)}")
    return importlib.import_module(f"{SITE_PACKAGE}.{name}")


# ----------------------------------------------------------------------------- checks

def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else a one-line ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
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


def drain_period(walltime: str) -> int:
    """Seconds after a block starts at which its workers stop taking new simulations.

    The last tenth of the walltime (1 to 10 minutes) starts nothing, so a simulation is not
    killed by the walltime half-way and charged a retry (Parsl #1905, #3059).
    """
    total = walltime_seconds(walltime)
    return total - min(600, max(60, total // 10)) if total > 120 else total // 2


def shell_join(prefix: str, argv: Sequence[str]) -> str:
    """``prefix`` then ``argv`` shell-quoted: the launch line of one MPI job."""
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"argv={argv!r} must be a non-empty list of strings")
    return f"{prefix} {shlex.join(argv)}"


@dataclass(frozen=True, kw_only=True)
class SiteRequest:
    """The arguments of every ``parsl_config``, validated once."""

    run_dir: str
    """Run directory of the campaign; Parsl writes under ``<run_dir>/parsl``."""
    nodes: int = 1
    """Nodes of the one block (batch job) that runs simulations."""
    walltime: str = "01:00:00"
    """Walltime of that block, HH:MM:SS."""
    account: str | None = None
    """Allocation charged; None: the scheduler's default for the user."""
    queue: str | None = None
    """Queue, partition or QOS (the site module says which); None: the site's default."""
    max_concurrent_sims: int = 4
    """Simulations wanted at once (a site may run fewer when they do not fit, and says so)."""
    sim_ranks: int = 2
    """MPI ranks of one simulation."""
    worker_init: str = ""
    """Extra shell lines run before the workers start, after the site's own."""
    retries: int = 2
    """Times Parsl reruns a failed simulation."""

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

    @property
    def parsl_run_dir(self) -> str:
        """Where Parsl's own run directories (000, 001, ...) go: inside the campaign's."""
        return str(Path(self.run_dir) / "parsl")

    def queue_or(self, defaults: Sequence[tuple[int | None, str | None]]) -> str | None:
        """The requested queue, else the site's default for this many nodes.

        ``defaults``: ``(max_nodes, queue)`` pairs in order, ``max_nodes`` None for no limit;
        queue None leaves the choice to the scheduler.
        """
        if self.queue is not None:
            return self.queue
        for max_nodes, queue in defaults:
            if max_nodes is None or self.nodes <= max_nodes:
                return queue
        return None

    def block(self, *, modules: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
        """Provider arguments shared by every batch site: one block of ``nodes`` held for the campaign.

        ``min_blocks=1`` keeps the allocation through pauses between waves of simulations
        (no new queue wait); ``SimpleLauncher`` is what ``MPIExecutor`` requires: one worker
        pool on the first node, which starts each simulation with the MPI launcher. The
        worker init is the site's ``modules`` and ``env``, this Python environment, then the
        caller's lines.
        """
        from parsl.launchers import SimpleLauncher

        return {"nodes_per_block": self.nodes, "walltime": self.walltime, "init_blocks": 1,
                "min_blocks": 1, "max_blocks": 1, "launcher": SimpleLauncher(),
                "worker_init": worker_init(modules=modules, env=env, extra=self.worker_init)}


def config_function(build: Callable[[SiteRequest], Config], doc: str) -> Callable[..., Config]:
    """A site's ``parsl_config``: the one signature every site exposes, checked, then ``build``."""

    def parsl_config(*, run_dir: str, nodes: int = 1, walltime: str = "01:00:00", account: str | None = None,
                     queue: str | None = None, max_concurrent_sims: int = 4, sim_ranks: int = 2,
                     worker_init: str = "", retries: int = 2) -> Config:
        return build(SiteRequest(run_dir=run_dir, nodes=nodes, walltime=walltime, account=account, queue=queue,
                                 max_concurrent_sims=max_concurrent_sims, sim_ranks=sim_ranks,
                                 worker_init=worker_init, retries=retries))

    parsl_config.__doc__, parsl_config.__qualname__ = doc, "parsl_config"
    return parsl_config


def batch_config_function(hardware: SiteHardware, provider: Callable[[SiteRequest], ExecutionProvider],
                          *, mpi_launcher: str | None, doc: str) -> Callable[..., Config]:
    """The ``parsl_config`` of a batch site: ``provider(request)`` under the ``sims`` executor."""
    return config_function(lambda request: sims_config(hardware, request, provider(request),
                                                       mpi_launcher=mpi_launcher), doc)


def host_memory_gib() -> float:
    """Physical memory of this machine in GiB (for the local site's facts)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):  # not POSIX: a conservative guess
        return 1.0


# ----------------------------------------------------------------------------- worker init

def python_env_line() -> str:
    """The shell line that puts this Python environment first on PATH in the batch job.

    Workers must run the interpreter (and ``process_worker_pool.py``) of the driver: the
    virtual environment it runs in is activated, or its ``bin`` put first on PATH.
    """
    prefix = shlex.quote(sys.prefix)
    if sys.prefix != sys.base_prefix:
        return f"source {prefix}/bin/activate"
    return f"export PATH={prefix}/bin:$PATH"


def worker_init(*, modules: Sequence[str], env: Mapping[str, str], extra: str) -> str:
    """The site's module lines, its environment, this Python environment, then the user's lines."""
    lines = [*modules, *(f"export {k}={shlex.quote(v)}" for k, v in env.items()), python_env_line()]
    if extra.strip():
        lines.append(extra.strip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- simulations

def mpi_resource_spec(hardware: SiteHardware, ranks: int) -> dict[str, int]:
    """``parsl_resource_specification`` of one CPU simulation: fewest whole nodes, ranks spread evenly."""
    check_count("ranks", ranks)
    num_nodes = math.ceil(ranks / hardware.cpu_cores_per_node)
    return {"num_nodes": num_nodes, "num_ranks": ranks, "ranks_per_node": math.ceil(ranks / num_nodes)}


def mpi_resource_spec_function(hardware: SiteHardware) -> Callable[[int], dict[str, int]]:
    """A site's ``sim_resource_spec``: ``mpi_resource_spec`` on its hardware."""

    def sim_resource_spec(ranks: int) -> dict[str, int]:
        return mpi_resource_spec(hardware, ranks)

    sim_resource_spec.__doc__ = (f"Fewest whole {hardware.name} nodes for ``ranks`` "
                                 f"({hardware.cpu_cores_per_node} cores each), ranks spread evenly.")
    return sim_resource_spec


def mpi_prefix(ranks: int) -> str:
    """``$PARSL_MPI_PREFIX``: the launcher line ``MPIExecutor`` composes from the task's resource spec."""
    check_count("ranks", ranks)
    return "$PARSL_MPI_PREFIX"


def sims_at_once(hardware: SiteHardware, request: SiteRequest, *, whole_nodes: bool) -> int:
    """How many simulations of ``request.sim_ranks`` ranks can run at once in the block.

    ``whole_nodes``: Parsl's ``MPIExecutor`` gives every task whole nodes, so simulations
    never share a node (Parsl #3927); otherwise (jsrun) ranks are packed on cores. A wish
    above what fits is lowered with a warning; one simulation that does not fit is an error
    (it would wait forever).
    """
    ranks, nodes = request.sim_ranks, request.nodes
    if whole_nodes:
        fit = nodes // mpi_resource_spec(hardware, ranks)["num_nodes"]
    else:
        fit = nodes * hardware.cpu_cores_per_node // ranks
    if fit < 1:
        raise ConfigError(f"a simulation of sim_ranks={ranks} does not fit in nodes={nodes} of {hardware.name} "
                          f"({hardware.cpu_cores_per_node} cores each)")
    if request.max_concurrent_sims > fit:
        why = "whole nodes per MPI task, Parsl #3927" if whole_nodes else "one core per rank"
        logger.warning("%s: max_concurrent_sims=%d lowered to %d: %d sims of %d ranks fit in %d nodes (%s)",
                       hardware.name, request.max_concurrent_sims, fit, fit, ranks, nodes, why)
    return min(request.max_concurrent_sims, fit)


def sims_config(hardware: SiteHardware, request: SiteRequest, provider: ExecutionProvider,
                *, mpi_launcher: str | None) -> Config:
    """The Parsl Config of a batch site: one executor labelled ``sims`` on ``provider``.

    ``mpi_launcher`` ("srun", "mpiexec", "aprun") selects Parsl's ``MPIExecutor``, which
    fills ``$PARSL_MPI_PREFIX`` from each task's ``parsl_resource_specification``; None
    selects a plain ``HighThroughputExecutor`` whose tasks name their launcher themselves
    (jsrun on LSF, which ``MPIExecutor`` cannot place tasks on). Connections between the
    driver and workers are encrypted: other users share the login nodes' network.
    """
    from parsl.config import Config
    from parsl.executors import HighThroughputExecutor, MPIExecutor

    at_once = sims_at_once(hardware, request, whole_nodes=mpi_launcher is not None)
    common = {"label": SIMS_LABEL, "provider": provider, "drain_period": drain_period(request.walltime),
              "encrypted": True}
    if mpi_launcher is not None:
        executor = MPIExecutor(mpi_launcher=mpi_launcher, max_workers_per_block=at_once, **common)
    else:
        executor = HighThroughputExecutor(max_workers_per_node=at_once, cores_per_worker=1e-3, **common)
    return Config(executors=[executor], run_dir=request.parsl_run_dir, retries=request.retries, usage_tracking=0)


# ----------------------------------------------------------------------------- batch scripts

@dataclass(frozen=True, kw_only=True)
class BatchScript:
    """What a provider would submit for one block: the command and the script."""

    submit_command: str
    """e.g. ``sbatch submit_scripts/parsl.sims.block``, ``qsub -q debug -A proj ...``."""
    text: str
    """The batch script, as the provider's own template renders it."""


def render_batch_script(config: Config, *, worker_command: str = WORKER_COMMAND_PLACEHOLDER,
                        script_dir: str = "submit_scripts") -> BatchScript:
    """The batch script the ``sims`` executor's provider would submit, without submitting it.

    Fills the provider's template with the values its ``submit()`` computes (Parsl
    2026.10.26: Slurm, LSF and PBS Pro providers) and renders it with the provider's own
    ``_write_submit_script``; for previews (a dry run) and tests.
    """
    from parsl.providers import LSFProvider, PBSProProvider, SlurmProvider
    from parsl.providers.lsf.template import template_string as lsf_template
    from parsl.providers.slurm.template import template_string as slurm_template
    from parsl.utils import wtime_to_minutes

    executor = next((e for e in config.executors if e.label == SIMS_LABEL), None)
    provider = getattr(executor, "provider", None)
    if not isinstance(provider, (SlurmProvider, LSFProvider, PBSProProvider)):
        raise ConfigError(f"the {SIMS_LABEL!r} executor submits no batch script "
                          f"(provider {type(provider).__name__})")
    job_name = f"parsl.{SIMS_LABEL}.block"
    script_path = f"{script_dir}/{job_name}"
    nodes = provider.nodes_per_block
    values: dict[str, Any] = {
        "submit_script_dir": script_dir, "nodes": nodes, "tasks_per_node": 1,
        "scheduler_options": provider.scheduler_options, "worker_init": provider.worker_init,
        "job_stdout_path": f"{script_path}.stdout", "job_stderr_path": f"{script_path}.stderr",
        "user_script": provider.launcher(worker_command, 1, nodes, script_dir),
    }
    if isinstance(provider, SlurmProvider):
        template, values["walltime"] = slurm_template, wtime_to_minutes(provider.walltime)
        if provider.mem_per_node is not None:
            values["scheduler_options"] += f"#SBATCH --mem={provider.mem_per_node}g\n"
            values["worker_init"] += f"export PARSL_MEMORY_GB={provider.mem_per_node}\n"
        if provider.cores_per_node is not None:  # as Parsl writes it (no newline): see Parsl #3006
            cpus_per_task = math.floor(provider.cores_per_node / 1)
            values["scheduler_options"] += f"#SBATCH --cpus-per-task={cpus_per_task}"
            values["worker_init"] += f"export PARSL_CORES={cpus_per_task}\n"
        submit = f"sbatch {script_path}"
    elif isinstance(provider, LSFProvider):
        template, values["walltime"] = lsf_template, wtime_to_minutes(provider.walltime)
        script_path += ".submit"
        submit = f"bsub {'< ' if provider.bsub_redirection else ''}{script_path}"
    else:
        template, values["walltime"] = provider.template_string, provider.walltime
        values["nodes_per_block"], values["ncpus"] = nodes, provider.cpus_per_node
        select = provider.select_options
        values["select_options"] = f":{select}" if select and not select.startswith(":") else select
        options = "".join(f" -{flag} {value}" for flag, value in (("q", provider.queue), ("A", provider.account))
                          if value is not None)
        submit = f"qsub{options} {script_path}"
    with tempfile.TemporaryDirectory(prefix="hpcml-batch-") as tmp:
        out = Path(tmp) / "script"
        provider._write_submit_script(template, str(out), job_name, values)
        return BatchScript(submit_command=submit, text=out.read_text())
