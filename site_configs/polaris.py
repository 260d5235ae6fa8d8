"""Polaris (ALCF): NVIDIA A100, HPE Slingshot, PBS Pro + PALS. Facts and sources: docs/sites/polaris.md."""

from __future__ import annotations

from hpcml.ensemble.parsl_build import block_options
from hpcml.ensemble.site import Site, SiteHardware, SiteRequest

#: File systems the job needs (ALCF rejects jobs without ``-l filesystems``).
DIRECTIVES = ("#PBS -l filesystems=home:eagle", "#PBS -l place=scatter")


def _provider(request: SiteRequest):
    """One PBS block; ``account`` and ``queue`` go on the ``qsub`` line."""
    from parsl.providers import PBSProProvider

    return PBSProProvider(account=request.account, queue=SITE.queue_for(request.nodes, request.queue),
                          cpus_per_node=64, select_options=SITE.select_options, scheduler_options="\n".join(DIRECTIVES),
                          **block_options(SITE, request))


SITE = Site(
    hardware=SiteHardware(
        name="polaris",
        gpus_per_node=4,
        gpu_model="NVIDIA A100-SXM4-40GB",
        cpu_cores_per_node=32,  # one AMD EPYC 7543P (2 hardware threads per core)
        memory_gb_per_node=512.0,
        gpu_memory_gb=40.0,
        peak_tflops_bf16_per_gpu=312.0,
        peak_tflops_fp32_per_gpu=19.5,
        node_injection_gbps=50.0,  # 2 Slingshot-11 NICs x 25 GB/s
        intra_node_link="NVLink 3: 4 links (100 GB/s per direction) between each pair of the 4 GPUs; "
                        "PCIe 4 x16 (32 GB/s) to the CPU",
        scheduler="pbs",
    ),
    modules=("module use /soft/modulefiles", "module load PrgEnv-gnu cray-hdf5-parallel conda"),
    env={"NCCL_SOCKET_IFNAME": "hsn0,hsn1", "HPCML_SOCKET_IFNAME": "hsn0"},
    queues=((2, "debug"), (10, "debug-scaling"), (None, "prod")),
    train_ranks_per_node=4,
    # one rank per GPU, 8 cores each (--depth); every rank sees all 4 GPUs and hpcml binds
    # local_rank % 4 (what ALCF's set_affinity_gpu_polaris.sh does by mask)
    train_launch="mpiexec -n {ranks} --ppn {ranks_per_node} --depth=8 --cpu-bind depth",
    sim_launch="$PARSL_MPI_PREFIX",  # mpiexec -n ... -ppn ... -hosts ..., composed by MPIExecutor
    mpi_launcher="mpiexec",
    provider=_provider,
    select_options="system=polaris",
    job_directives=DIRECTIVES,
    stream_interface="hsn0",
)
