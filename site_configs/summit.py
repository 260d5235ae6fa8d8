"""Summit (OLCF, retired 2024): NVIDIA V100, EDR InfiniBand, LSF + jsrun. Facts and sources: docs/sites/summit.md.

Parsl's ``MPIExecutor`` places tasks only in Slurm and PBS jobs, and composes no jsrun
line, so here a ``HighThroughputExecutor`` on the batch (launch) node runs bash_apps that
start their simulation with ``jsrun`` themselves.
"""

from __future__ import annotations

from hpcml.ensemble.parsl_build import block_options
from hpcml.ensemble.site import Site, SiteHardware, SiteRequest


def _provider(request: SiteRequest):
    """One LSF block of ``nodes``; ``account`` is the project (``#BSUB -P``)."""
    from parsl.providers import LSFProvider

    return LSFProvider(project=request.account, queue=SITE.queue_for(request.nodes, request.queue),
                       request_by_nodes=True, **block_options(SITE, request))


SITE = Site(
    hardware=SiteHardware(
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
    ),
    modules=("module load gcc spectrum-mpi hdf5 python",),
    env={"HPCML_SOCKET_IFNAME": "ib0"},
    queues=((None, "batch"),),
    train_ranks_per_node=6,
    # one resource set per GPU: 1 rank, 1 GPU, 7 cores, the rank bound to all 7 (default: 1)
    train_launch="jsrun -n{ranks} -r{ranks_per_node} -a1 -g1 -c7 -b packed:7",
    sim_launch="jsrun -n{ranks} -a1 -c1",  # one resource set (1 task, 1 core) per rank, packed
    mpi_launcher=None,
    provider=_provider,
    stream_interface="ib0",
)
