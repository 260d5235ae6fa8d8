"""Frontier (OLCF): AMD MI250X, HPE Slingshot, Slurm. Facts and sources: docs/sites/frontier.md."""

from __future__ import annotations

from hpcml.ensemble.site import Account, EnvVar, Fact, Queue, Site, SiteHardware, Source

GUIDE = Source(url="https://docs.olcf.ornl.gov/systems/frontier_user_guide.html", read="2026-07-07")
PYTORCH = Source(url="https://docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html", read="2026-07-07")
# the same page as of this date (its source, olcf/olcf-user-docs): the module versions OLCF pins
# for torch 2.10 + ROCm 7.1.1 ("the current recommendation on Frontier")
PYTORCH_PIN = Source(url="https://docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html", read="2026-11-28")
_BIN = "batch partition bin; 4 eligible-to-run jobs per user"

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
    account=Account(required=True, why="every job charges an OLCF project: '#SBATCH -A ABC123' in every Frontier "
                                        "example", source=GUIDE),
    queues=(
        Queue(name="batch", kind="partition", min_nodes=1, max_nodes=91, max_walltime="02:00:00", note=_BIN,
              source=GUIDE),
        Queue(name="batch", kind="partition", min_nodes=92, max_nodes=183, max_walltime="06:00:00", note=_BIN,
              source=GUIDE),
        Queue(name="batch", kind="partition", min_nodes=184, max_nodes=9472, max_walltime="12:00:00", note=_BIN,
              source=GUIDE),
        Queue(name="extended", kind="partition", min_nodes=1, max_nodes=64, max_walltime="24:00:00", max_running=1,
              max_queued=2, note="1 running and 1 eligible job per user; more are held", source=GUIDE),
        Queue(name="debug", kind="qos", min_nodes=1, max_walltime="02:00:00", max_running=1, max_queued=1,
              requeue=False, auto=False,
              note="one job in any state per user; 'job chaining using the debug QOS is prohibited'", source=GUIDE),
    ),
    modules=(
        Fact(text="module load PrgEnv-gnu/8.7.0 cpe/26.03 cray-mpich cray-hdf5-parallel cray-python rocm/7.1.1",
             why="the compilers, MPI, parallel HDF5 and ROCm hpcml's h5py and torch were built against "
                 "(docs/install.md): OLCF's pinned pair for its torch wheels (cpe/26.03 with rocm/7.1.1), not "
                 "whatever is default on the day", source=PYTORCH_PIN),
        Fact(text="module load rccl-net-plugin craype-accel-amd-gfx90a",
             why="RCCL's Slingshot plugin ('RCCL defaults to ... TCP/IP Sockets, which does not scale') and "
                 "GPU-aware MPI for the MI250X", source=PYTORCH),
        Fact(text="export LD_LIBRARY_PATH=$CRAY_LD_LIBRARY_PATH:$LD_LIBRARY_PATH",
             why="the Cray libraries the modules name come first, as in OLCF's PyTorch script", source=PYTORCH),
    ),
    environment=(
        EnvVar(name="NCCL_SOCKET_IFNAME", value="hsn0,hsn1,hsn2,hsn3", why="RCCL's bootstrap on the Slingshot NICs "
                                                                          "(OLCF: 'highly recommend')",
               source=PYTORCH, training_only=True),
        EnvVar(name="MIOPEN_USER_DB_PATH", value="/tmp/hpcml-miopen",
               why="MIOpen's database in node-local /tmp: on shared file systems it fails with disk I/O errors",
               source=PYTORCH),
        EnvVar(name="MIOPEN_CUSTOM_CACHE_DIR", value="/tmp/hpcml-miopen", why="MIOpen's kernel cache beside it",
               source=PYTORCH),
        EnvVar(name="HPCML_SOCKET_IFNAME", value="hsn0", why="stream and rendezvous on the Slingshot network"),
    ),
    train_ranks_per_node=8,
    # one rank per GCD, 7 cores each, each rank sees the GCD closest to its cores; the RCCL
    # plugin's rendezvous protocol (FI_CXI_RDZV_PROTO=alt_read) needs --network=disable_rdzv_get,
    # which OLCF says "may negatively impact MPI performance": on the training step only
    train_launch="srun -N{nodes} -n{ranks} -c7 --gpus-per-task=1 --gpu-bind=closest --network=disable_rdzv_get",
    train_launch_why="one rank per GCD on 7 cores (low-noise mode keeps 8), each seeing the GCD on its L3 region; "
                     "--network=disable_rdzv_get for the RCCL plugin's alt_read rendezvous, on this step alone "
                     "(OLCF shows it on #SBATCH; as an srun step option it is unverified on OLCF's pages, seen in "
                     "users' Frontier scripts: check on the first run)",
    train_launch_source=GUIDE,
    # srun --ntasks ... --nodelist ..., composed by MPIExecutor; an MPI simulation keeps Cray
    # MPICH's own rendezvous: the RCCL plugin's setting is training's alone
    sim_launch="$PARSL_MPI_PREFIX",
    module_training_vars=("FI_CXI_RDZV_PROTO",),
    mpi_launcher="srun",
    stream_interface="hsn0",
)
