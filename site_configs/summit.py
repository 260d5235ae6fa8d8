"""Summit (OLCF): NVIDIA V100, EDR InfiniBand, LSF + jsrun. RETIRED: decommissioned on
2024-11-15; kept as the reference for LSF and jsrun. Facts and sources: docs/sites/summit.md.

Parsl's ``MPIExecutor`` places tasks only in Slurm and PBS jobs, and composes no jsrun
line, so here a ``HighThroughputExecutor`` on the batch (launch) node runs bash_apps that
start their simulation with ``jsrun`` themselves.
"""

from __future__ import annotations

from hpcml.ensemble.site import Account, EnvVar, Fact, Queue, Site, SiteHardware, Source

GUIDE = Source(url="https://docs.olcf.ornl.gov/systems/summit_user_guide.html", read="2026-05-18")
_BIN = "batch queue bin; 4 eligible-to-run jobs per user"

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
    retired="decommissioned on 2024-11-15 (OLCF); no PyTorch wheel for POWER9 either",
    account=Account(required=True, why="OLCF's job-script table: '#BSUB -P ABC123 | Required'", source=GUIDE),
    queues=(
        Queue(name="batch", min_nodes=1, max_nodes=45, max_walltime="02:00:00", note=_BIN, source=GUIDE),
        Queue(name="batch", min_nodes=46, max_nodes=91, max_walltime="06:00:00", note=_BIN, source=GUIDE),
        Queue(name="batch", min_nodes=92, max_nodes=921, max_walltime="12:00:00", note=_BIN, source=GUIDE),
        Queue(name="batch", min_nodes=922, max_nodes=4608, max_walltime="24:00:00", note=_BIN, source=GUIDE),
        Queue(name="batch-hm", min_nodes=1, max_nodes=54, max_walltime="24:00:00", auto=False,
              note="high-memory nodes", source=GUIDE),
    ),
    modules=(Fact(text="module load gcc spectrum-mpi hdf5 python",
                  why="the compilers, MPI and parallel HDF5 h5py would be built against"),),
    environment=(EnvVar(name="HPCML_SOCKET_IFNAME", value="ib0", why="stream and rendezvous on InfiniBand"),),
    train_ranks_per_node=6,
    # one resource set per GPU: 1 rank, 1 GPU, 7 cores, the rank bound to all 7 (default: 1)
    train_launch="jsrun -n{ranks} -r{ranks_per_node} -a1 -g1 -c7 -b packed:7",
    train_launch_why="one resource set per GPU: 1 rank, 1 GPU, 7 cores, bound to all 7",
    train_launch_source=GUIDE,
    sim_launch="jsrun -n{ranks} -a1 -c1",  # one resource set (1 task, 1 core) per rank, packed
    mpi_launcher=None,
    block_options={"request_by_nodes": True},
    stream_interface="ib0",
)
