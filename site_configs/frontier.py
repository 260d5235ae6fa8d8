"""Frontier (OLCF): AMD MI250X, HPE Slingshot, Slurm. Facts and sources: docs/sites/frontier.md."""

from __future__ import annotations

from hpcml.ensemble.parsl_build import block_options
from hpcml.ensemble.site import Site, SiteHardware, SiteRequest


def _provider(request: SiteRequest):
    """One exclusive Slurm block; ``queue`` is the partition. No ``cores_per_node``: it adds
    ``--cpus-per-task``, which every srun step inherits (Parsl #3006)."""
    from parsl.providers import SlurmProvider

    return SlurmProvider(account=request.account, partition=SITE.queue_for(request.nodes, request.queue),
                         exclusive=True, **block_options(SITE, request))


SITE = Site(
    hardware=SiteHardware(
        name="frontier",
        gpus_per_node=8,
        gpu_model="AMD Instinct MI250X, one GCD (4 MI250X = 8 GCDs per node)",
        cpu_cores_per_node=56,  # 64-core EPYC 7A53; low-noise mode keeps core 0 of each 8-core CCD
        memory_gb_per_node=512.0,
        gpu_memory_gb=64.0,
        peak_tflops_bf16_per_gpu=191.5,  # 383 per MI250X
        peak_tflops_fp32_per_gpu=47.9,  # FP32 matrix 95.7 per MI250X
        node_injection_gbps=100.0,  # 4 Slingshot-11 NICs x 25 GB/s
        intra_node_link="Infinity Fabric: 200 GB/s between the 2 GCDs of one MI250X, 50-100 GB/s between GCDs "
                        "of different MI250X, 36 GB/s CPU-GCD",
        scheduler="slurm",
    ),
    modules=("module load PrgEnv-gnu cray-mpich cray-hdf5-parallel cray-python rocm",),
    env={"NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3", "HPCML_SOCKET_IFNAME": "hsn0"},
    queues=((None, None),),  # the default partition, "batch"
    queue_kind="partition",
    train_ranks_per_node=8,
    # one rank per GCD, 7 cores each, each rank sees the GCD closest to its cores
    train_launch="srun -N{nodes} -n{ranks} -c7 --gpus-per-task=1 --gpu-bind=closest",
    sim_launch="$PARSL_MPI_PREFIX",  # srun --ntasks ... --nodelist ..., composed by MPIExecutor
    mpi_launcher="srun",
    provider=_provider,
    stream_interface="hsn0",
)
