"""Aurora (ALCF): Intel Data Center GPU Max 1550, Slingshot, PBS Pro + PALS. Facts and sources: docs/sites/aurora.md."""

from __future__ import annotations

from parsl.providers import PBSProProvider

from hpcml.ensemble import site
from hpcml.ensemble.site import SiteHardware

HARDWARE = SiteHardware(
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
)

#: PBS queue by node count: debug up to 2 nodes, then prod.
QUEUES: tuple[tuple[int | None, str | None], ...] = ((2, "debug"), (None, "prod"))
#: File systems the job needs (ALCF rejects jobs without ``-l filesystems``).
SCHEDULER_OPTIONS = "#PBS -l filesystems=home:flare\n#PBS -l place=scatter"
#: The modules ``make setup`` built against (docs/install.md).
MODULES = ("module load frameworks cray-hdf5-parallel",)
ENV = {"ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "HPCML_SOCKET_IFNAME": "hsn0"}
#: Cores of the 12 ranks of a node, 8 each, skipping cores 0 and 52 (ALCF's binding).
CPU_BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"


def _provider(request: site.SiteRequest) -> PBSProProvider:
    """One PBS block; ``account`` and ``queue`` go on the ``qsub`` line. No ``MpiExecLauncher``:
    its default ``--bind-to`` is rejected by PALS (Parsl #2446), and ``MPIExecutor`` needs the
    ``SimpleLauncher`` anyway."""
    return PBSProProvider(account=request.account, queue=request.queue_or(QUEUES), cpus_per_node=208,
                          scheduler_options=SCHEDULER_OPTIONS, **request.block(modules=MODULES, env=ENV))


parsl_config = site.batch_config_function(
    HARDWARE, _provider, mpi_launcher="mpiexec",
    doc="One PBS block of ``nodes``; simulations start with PALS ``mpiexec`` through ``MPIExecutor``.")

#: ``$PARSL_MPI_PREFIX``: ``mpiexec -n ... -ppn ... -hosts ...``, composed by ``MPIExecutor``.
sim_launch = site.mpi_prefix
sim_resource_spec = site.mpi_resource_spec_function(HARDWARE)


def train_launch(nodes: int, argv: list[str]) -> str:
    """One rank per tile, 8 cores each (``CPU_BIND``); hpcml binds tile ``local_rank % 12``."""
    n = site.check_count("nodes", nodes)
    g = HARDWARE.gpus_per_node
    return site.shell_join(f"mpiexec -n {g * n} --ppn {g} --cpu-bind {CPU_BIND}", argv)
