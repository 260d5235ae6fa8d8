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

from hpcml.ensemble.parsl_build import thread_config
from hpcml.ensemble.site import Site, SiteHardware, host_memory_gib

SITE = Site(
    hardware=SiteHardware(
        name="local",
        gpus_per_node=0,
        gpu_model="none",
        cpu_cores_per_node=os.cpu_count() or 1,
        memory_gb_per_node=host_memory_gib(),
        gpu_memory_gb=0.0,
        peak_tflops_bf16_per_gpu=0.0,
        peak_tflops_fp32_per_gpu=0.0,
        node_injection_gbps=0.0,
        intra_node_link="shared memory (one node)",
        scheduler="local",
    ),
    # 2 ranks per "node", the cores of the reference machine: a training job of nodes=2 runs
    # 4 ranks, oversubscribed as in `make test-mpi`; TrainingJob(ranks=...) sets any count.
    train_ranks_per_node=2,
    train_launch="mpiexec -n {ranks}",
    sim_launch="mpiexec -n {ranks}",
    mpi_launcher=None,
    config=thread_config,
)
