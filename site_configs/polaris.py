"""Polaris (ALCF): NVIDIA A100, HPE Slingshot, PBS Pro + PALS. Facts and sources: docs/sites/polaris.md."""

from __future__ import annotations

from parsl.providers import PBSProProvider

from hpcml.ensemble import site
from hpcml.ensemble.site import SiteHardware

HARDWARE = SiteHardware(
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
)

#: PBS queue by node count: debug up to 2 nodes, debug-scaling up to 10, then prod.
QUEUES: tuple[tuple[int | None, str | None], ...] = ((2, "debug"), (10, "debug-scaling"), (None, "prod"))
#: File systems the job needs (ALCF rejects jobs without ``-l filesystems``).
SCHEDULER_OPTIONS = "#PBS -l filesystems=home:eagle\n#PBS -l place=scatter"
#: The modules ``make setup`` built against (docs/install.md).
MODULES = ("module use /soft/modulefiles", "module load PrgEnv-gnu cray-hdf5-parallel conda")
ENV = {"NCCL_SOCKET_IFNAME": "hsn0,hsn1", "HPCML_SOCKET_IFNAME": "hsn0"}


def _provider(request: site.SiteRequest) -> PBSProProvider:
    """One PBS block; ``account`` and ``queue`` go on the ``qsub`` line."""
    return PBSProProvider(account=request.account, queue=request.queue_or(QUEUES), cpus_per_node=64,
                          select_options="ngpus=4", scheduler_options=SCHEDULER_OPTIONS,
                          **request.block(modules=MODULES, env=ENV))


parsl_config = site.batch_config_function(
    HARDWARE, _provider, mpi_launcher="mpiexec",
    doc="One PBS block of ``nodes``; simulations start with PALS ``mpiexec`` through ``MPIExecutor``.")

#: ``$PARSL_MPI_PREFIX``: ``mpiexec -n ... -ppn ... -hosts ...``, composed by ``MPIExecutor``.
sim_launch = site.mpi_prefix
sim_resource_spec = site.mpi_resource_spec_function(HARDWARE)


def train_launch(nodes: int, argv: list[str]) -> str:
    """One rank per GPU, 8 cores each (``--depth``); every rank sees all 4 GPUs and hpcml
    binds ``local_rank % 4`` (what ALCF's ``set_affinity_gpu_polaris.sh`` does by mask)."""
    n = site.check_count("nodes", nodes)
    g = HARDWARE.gpus_per_node
    return site.shell_join(f"mpiexec -n {g * n} --ppn {g} --depth=8 --cpu-bind depth", argv)
