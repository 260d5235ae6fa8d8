"""Perlmutter (NERSC), GPU nodes: NVIDIA A100, HPE Slingshot, Slurm. Facts and sources: docs/sites/perlmutter.md."""

from __future__ import annotations

from hpcml.ensemble.parsl_build import block_options
from hpcml.ensemble.site import Site, SiteHardware, SiteRequest


def _provider(request: SiteRequest):
    """One exclusive block of GPU nodes; ``queue`` is the QOS, ``account`` the GPU allocation
    (its name ends in ``_g``). No ``cores_per_node`` (Parsl #3006)."""
    from parsl.providers import SlurmProvider

    return SlurmProvider(account=request.account, qos=SITE.queue_for(request.nodes, request.queue), constraint="gpu",
                         gpus_per_node=SITE.hardware.gpus_per_node, exclusive=True, **block_options(SITE, request))


SITE = Site(
    hardware=SiteHardware(
        name="perlmutter",
        gpus_per_node=4,
        gpu_model="NVIDIA A100-SXM4-40GB",
        cpu_cores_per_node=64,  # one AMD EPYC 7763 (2 hardware threads per core)
        memory_gb_per_node=256.0,
        gpu_memory_gb=40.0,
        peak_tflops_bf16_per_gpu=312.0,
        peak_tflops_fp32_per_gpu=19.5,
        node_injection_gbps=100.0,  # 4 Slingshot-11 NICs x 25 GB/s
        intra_node_link="NVLink 3: 4 links (100 GB/s per direction) between each pair of the 4 GPUs; "
                        "PCIe 4 x16 (32 GB/s) to the CPU",
        scheduler="slurm",
    ),
    modules=("module load PrgEnv-gnu cray-mpich cray-hdf5-parallel python",),
    env={"NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3", "HPCML_SOCKET_IFNAME": "hsn0"},
    queues=((None, "regular"),),  # NERSC selects GPU nodes by --constraint gpu, queues by QOS
    queue_kind="qos",
    train_ranks_per_node=4,
    # One rank per GPU, 16 cores (32 hardware threads) each; every rank sees all 4 GPUs
    # (--gpu-bind=none): with one visible GPU per rank NCCL cannot use CUDA IPC between the
    # ranks of a node and falls back from NVLink peer-to-peer; hpcml binds local_rank % 4.
    train_launch="srun -N{nodes} -n{ranks} -c32 --cpu-bind=cores --gpus-per-task=1 --gpu-bind=none",
    sim_launch="$PARSL_MPI_PREFIX",
    mpi_launcher="srun",
    provider=_provider,
    job_directives=("#SBATCH --constraint=gpu", "#SBATCH --gpus-per-node=4"),
    stream_interface="hsn0",
)
