"""Summit (OLCF, retired 2024): NVIDIA V100, EDR InfiniBand, LSF + jsrun. Facts and sources: docs/sites/summit.md.

Parsl's ``MPIExecutor`` places tasks only in Slurm and PBS jobs, and composes no jsrun
line, so here a ``HighThroughputExecutor`` on the batch (launch) node runs bash_apps that
start their simulation with ``jsrun`` themselves.
"""

from __future__ import annotations

from parsl.providers import LSFProvider

from hpcml.ensemble import site
from hpcml.ensemble.site import SiteHardware

HARDWARE = SiteHardware(
    name="summit",
    gpus_per_node=6,
    gpu_model="NVIDIA V100-SXM2-16GB",
    cpu_cores_per_node=42,  # 2 POWER9 x 22 cores, one per socket kept for the OS
    memory_gb_per_node=512.0,
    gpu_memory_gb=16.0,
    peak_tflops_bf16_per_gpu=15.7,  # no bf16 units: bf16 runs at best at the FP32 rate
    peak_tflops_fp32_per_gpu=15.7,
    node_injection_gbps=25.0,  # dual-rail EDR InfiniBand, 2 x 12.5 GB/s
    intra_node_link="NVLink 2: 50 GB/s per direction among the CPU and 3 GPUs of one socket; "
                    "X-Bus 64 GB/s between the sockets",
    scheduler="lsf",
)

#: LSF queue by node count.
QUEUES: tuple[tuple[int | None, str | None], ...] = ((None, "batch"),)
#: The modules ``make setup`` built against (docs/install.md).
MODULES = ("module load gcc spectrum-mpi hdf5 python",)
ENV = {"HPCML_SOCKET_IFNAME": "ib0"}


def _provider(request: site.SiteRequest) -> LSFProvider:
    """One LSF block of ``nodes``; ``account`` is the project (``#BSUB -P``)."""
    return LSFProvider(project=request.account, queue=request.queue_or(QUEUES), request_by_nodes=True,
                       **request.block(modules=MODULES, env=ENV))


parsl_config = site.batch_config_function(
    HARDWARE, _provider, mpi_launcher=None,
    doc="One LSF block of ``nodes``; each simulation starts itself with ``jsrun`` (``sim_launch``).")


def sim_launch(ranks: int) -> str:
    """``jsrun -n<ranks> -a1 -c1``: one resource set (1 task, 1 core) per rank, packed by jsrun."""
    return f"jsrun -n{site.check_count('ranks', ranks)} -a1 -c1"


def sim_resource_spec(ranks: int) -> dict:
    """Nothing: the ranks are in ``sim_launch`` (a plain HighThroughputExecutor takes no MPI spec)."""
    site.check_count("ranks", ranks)
    return {}


def train_launch(nodes: int, argv: list[str]) -> str:
    """One resource set per GPU: 1 rank, 1 GPU, 7 cores, the rank bound to all 7 (default: 1)."""
    n = site.check_count("nodes", nodes)
    return site.shell_join(f"jsrun -n{HARDWARE.gpus_per_node * n} -r{HARDWARE.gpus_per_node} -a1 -g1 -c7 "
                           "-b packed:7", argv)
