"""Perlmutter (NERSC), GPU nodes: NVIDIA A100, HPE Slingshot, Slurm. Facts and sources: docs/sites/perlmutter.md."""

from __future__ import annotations

from parsl.providers import SlurmProvider

from hpcml.ensemble import site
from hpcml.ensemble.site import SiteHardware

HARDWARE = SiteHardware(
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
)

#: Slurm QOS by node count (NERSC selects GPU nodes by ``--constraint gpu``, queues by QOS).
QUEUES: tuple[tuple[int | None, str | None], ...] = ((None, "regular"),)
#: The modules ``make setup`` built against (docs/install.md).
MODULES = ("module load PrgEnv-gnu cray-mpich cray-hdf5-parallel python",)
ENV = {"NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3", "HPCML_SOCKET_IFNAME": "hsn0"}


def _provider(request: site.SiteRequest) -> SlurmProvider:
    """One exclusive block of GPU nodes; ``queue`` is the QOS, ``account`` the GPU allocation
    (its name ends in ``_g``). No ``cores_per_node`` (Parsl #3006)."""
    return SlurmProvider(account=request.account, qos=request.queue_or(QUEUES), constraint="gpu",
                         gpus_per_node=HARDWARE.gpus_per_node, exclusive=True,
                         **request.block(modules=MODULES, env=ENV))


parsl_config = site.batch_config_function(
    HARDWARE, _provider, mpi_launcher="srun",
    doc="One Slurm block of ``nodes`` GPU nodes; simulations start with ``srun`` through ``MPIExecutor``.")

#: ``$PARSL_MPI_PREFIX``: ``srun --ntasks ... --nodelist ...``, composed by ``MPIExecutor``.
sim_launch = site.mpi_prefix
sim_resource_spec = site.mpi_resource_spec_function(HARDWARE)


def train_launch(nodes: int, argv: list[str]) -> str:
    """One rank per GPU, 16 cores (32 hardware threads) each; every rank sees all 4 GPUs.

    ``--gpu-bind=none``: with one visible GPU per rank, NCCL cannot use CUDA IPC between
    the ranks of a node and falls back from NVLink peer-to-peer; hpcml binds
    ``local_rank % 4`` itself.
    """
    n = site.check_count("nodes", nodes)
    return site.shell_join(f"srun -N{n} -n{HARDWARE.gpus_per_node * n} -c32 --cpu-bind=cores "
                           "--gpus-per-task=1 --gpu-bind=none", argv)
