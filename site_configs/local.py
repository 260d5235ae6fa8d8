"""This machine (the default site): one node, no batch system, no GPU, MPICH's ``mpiexec``.

Simulations run in a ``ThreadPoolExecutor``: a bash_app's thread only waits on its
``mpiexec`` child, so threads cost nothing, and a task starts 5 to 15 ms after
submission. A ``HighThroughputExecutor`` on ``LocalProvider`` took about 1.8 s (2 s with
loading) to start its first task here, its interchange and worker-pool processes competing
for the 2 cores with the simulations, and needs the venv's ``bin`` on PATH. See
docs/sites/local.md.
"""

from __future__ import annotations

import os

from parsl.config import Config
from parsl.executors import ThreadPoolExecutor

from hpcml.ensemble import site
from hpcml.ensemble.site import SiteHardware

#: MPI ranks of one local "node" in ``train_launch``: 2, the cores of the reference
#: machine; ``train_launch(2, ...)`` runs 4 ranks, oversubscribed as in ``make test-mpi``.
RANKS_PER_NODE = 2

HARDWARE = SiteHardware(
    name="local",
    gpus_per_node=0,
    gpu_model="none",
    cpu_cores_per_node=os.cpu_count() or 1,
    memory_gb_per_node=site.host_memory_gib(),
    gpu_memory_gb=0.0,
    peak_tflops_bf16_per_gpu=0.0,
    peak_tflops_fp32_per_gpu=0.0,
    node_injection_gbps=0.0,
    intra_node_link="shared memory (one node)",
    scheduler="local",
)


def _config(request: site.SiteRequest) -> Config:
    """Threads that run up to ``max_concurrent_sims`` bash_apps at once, each an ``mpiexec``."""
    executor = ThreadPoolExecutor(label=site.SIMS_LABEL, max_threads=request.max_concurrent_sims)
    return Config(executors=[executor], run_dir=request.parsl_run_dir, retries=request.retries,
                  usage_tracking=0, strategy="none")


parsl_config = site.config_function(
    _config, doc="Threads running up to ``max_concurrent_sims`` simulations at once. All arguments are "
                 "checked as on a batch site; nodes, walltime, account, queue and worker_init have "
                 "nothing to act on here (no scheduler, no batch job).")


def sim_launch(ranks: int) -> str:
    """``mpiexec -n <ranks>``: the prefix of one simulation's command."""
    return f"mpiexec -n {site.check_count('ranks', ranks)}"


def sim_resource_spec(ranks: int) -> dict:
    """Nothing: threads take no resource specification (the ranks are in ``sim_launch``)."""
    site.check_count("ranks", ranks)
    return {}


def train_launch(nodes: int, argv: list[str], ranks: int | None = None) -> str:
    """``mpiexec -n <ranks, or nodes * RANKS_PER_NODE> <argv>`` (one machine: a rank count
    is the natural unit, e.g. ``TrainingJob(ranks=4)``)."""
    n = site.check_count("ranks", ranks) if ranks is not None else site.check_count("nodes", nodes) * RANKS_PER_NODE
    return site.shell_join(f"mpiexec -n {n}", argv)
