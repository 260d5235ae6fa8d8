"""Aurora (ALCF): Intel Data Center GPU Max 1550, Slingshot, PBS Pro + PALS. Facts and sources: docs/sites/aurora.md."""

from __future__ import annotations

from hpcml.ensemble.parsl_build import block_options
from hpcml.ensemble.site import Site, SiteHardware, SiteRequest

#: File systems the job needs (ALCF rejects jobs without ``-l filesystems``).
DIRECTIVES = ("#PBS -l filesystems=home:flare", "#PBS -l place=scatter")
#: Cores of the 12 ranks of a node, 8 each, skipping cores 0 and 52 (ALCF's binding).
CPU_BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"


def _provider(request: SiteRequest):
    """One PBS block; ``account`` and ``queue`` go on the ``qsub`` line. No ``MpiExecLauncher``:
    its default ``--bind-to`` is rejected by PALS (Parsl #2446), and ``MPIExecutor`` needs the
    ``SimpleLauncher`` anyway."""
    from parsl.providers import PBSProProvider

    return PBSProProvider(account=request.account, queue=SITE.queue_for(request.nodes, request.queue),
                          cpus_per_node=208, scheduler_options="\n".join(DIRECTIVES), **block_options(SITE, request))


SITE = Site(
    hardware=SiteHardware(
        name="aurora",
        gpus_per_node=12,
        gpu_model="Intel Data Center GPU Max 1550, one tile (6 GPUs = 12 tiles per node)",
        cpu_cores_per_node=102,  # 2 Xeon Max 9470C x 52 cores; cores 0 and 52 left to the OS
        memory_gb_per_node=1024.0,  # DDR5, plus 2 x 64 GiB HBM on the CPUs
        gpu_memory_gb=64.0,
        peak_tflops_bf16_per_gpu=367.0,  # 448 XMX engines x 512 flop/clock x 1.6 GHz
        peak_tflops_fp32_per_gpu=22.9,  # 448 vector engines x 32 flop/clock x 1.6 GHz
        node_injection_gbps=200.0,  # 8 Slingshot-11 NICs x 25 GB/s
        intra_node_link="Xe Link: all-to-all among the 6 GPUs, 28 GB/s per link; the 2 tiles of a GPU share "
                        "its package; PCIe 5 x16 (64 GB/s) to the CPUs",
        scheduler="pbs",
    ),
    modules=("module load frameworks cray-hdf5-parallel",),
    env={"ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "HPCML_SOCKET_IFNAME": "hsn0"},
    queues=((2, "debug"), (None, "prod")),
    train_ranks_per_node=12,
    # one rank per tile, 8 cores each (CPU_BIND); hpcml binds tile local_rank % 12
    train_launch=f"mpiexec -n {{ranks}} --ppn {{ranks_per_node}} --cpu-bind {CPU_BIND}",
    sim_launch="$PARSL_MPI_PREFIX",
    mpi_launcher="mpiexec",
    provider=_provider,
    job_directives=DIRECTIVES,
    stream_interface="hsn0",
)
