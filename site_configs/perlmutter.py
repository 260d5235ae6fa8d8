"""Perlmutter (NERSC), GPU nodes: NVIDIA A100, HPE Slingshot, Slurm. Facts and sources: docs/sites/perlmutter.md.

NERSC's pages could not be re-read where these rows were last checked (2026-11-25): the QOS
limits below are NERSC's policy page as known, marked so in their notes; check them with
``sacctmgr show qos`` on a login node before relying on a limit.
"""

from __future__ import annotations

from hpcml.ensemble.site import Account, EnvVar, Fact, Queue, Site, SiteHardware, Source

POLICY = Source(url="https://docs.nersc.gov/jobs/policy/", read="2026-11-25")
GPU_JOBS = Source(url="https://docs.nersc.gov/jobs/examples/", read="2026-11-25")
ML = Source(url="https://docs.nersc.gov/machinelearning/pytorch/", read="2026-11-25")
ARCH = Source(url="https://docs.nersc.gov/systems/perlmutter/architecture/", read="2026-11-25")
_UNCHECKED = "limits not re-read from the page (not reachable where checked)"

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
    account=Account(required=False, why="NERSC charges the user's default project without -A ('To charge to a "
                                         "non-default project, use the -A projectname flag'); GPU jobs need a GPU "
                                         "allocation (name ending in _g)", source=POLICY),
    queues=(  # NERSC selects GPU nodes by --constraint gpu and limits by QOS; "debug" is the default QOS
        # not chosen for a job that names no QOS, and never a requeue chain: NERSC keeps debug
        # for debugging, not production runs or job chaining (the rule Frontier's debug QOS has)
        Queue(name="debug", kind="qos", min_nodes=1, max_nodes=8, max_walltime="00:30:00", max_running=2,
              max_queued=5, requeue=False, auto=False,
              note=f"5 jobs submitted, 2 running per user; for debugging, not production runs or job chaining; "
                   f"{_UNCHECKED}", source=POLICY),
        Queue(name="regular", kind="qos", min_nodes=1, max_walltime="48:00:00", note=_UNCHECKED, source=POLICY),
        Queue(name="preempt", kind="qos", min_nodes=1, max_nodes=128, max_walltime="48:00:00", auto=False,
              note=f"preemptible after 2 h; made for --requeue with checkpoints; {_UNCHECKED}", source=POLICY),
        Queue(name="premium", kind="qos", min_nodes=1, max_walltime="48:00:00", auto=False,
              note=f"higher priority, higher charge; {_UNCHECKED}", source=POLICY),
    ),
    modules=(
        Fact(text="module load PrgEnv-gnu cray-mpich cray-hdf5-parallel python",
             why="the compilers, MPI and parallel HDF5 hpcml's h5py was built against (docs/install.md)"),
        # NERSC documents nccl-plugin as a Shifter container module (#SBATCH --module=gpu,nccl-plugin);
        # an ordinary module of that name is not on its pages: tried, with a warning, not stated
        Fact(text="module load nccl-plugin", why="NCCL's Slingshot plugin (aws-ofi-nccl): without it NCCL talks TCP "
                                                 "sockets between nodes", source=ML,
             unverified="module avail nccl; without a plugin module NCCL falls back to TCP sockets between nodes"),
    ),
    environment=(
        EnvVar(name="NCCL_SOCKET_IFNAME", value="hsn0,hsn1,hsn2,hsn3", why="NCCL's bootstrap on the Slingshot NICs",
               training_only=True),
        EnvVar(name="HPCML_GPU_MAP", value="3,2,1,0",
               why="the node is Polaris' design (one EPYC, 4 NUMA domains, A100 i on domain 3-i): local rank r "
                   "(cores 16r..16r+15) drives GPU 3-r", source=ARCH),
        EnvVar(name="HPCML_SOCKET_IFNAME", value="hsn0", why="stream and rendezvous on the Slingshot network"),
    ),
    train_ranks_per_node=4,
    # One rank per GPU, 16 cores (32 hardware threads) each; every rank sees all 4 GPUs
    # (--gpu-bind=none): with one visible GPU per rank NCCL cannot use CUDA IPC between the
    # ranks of a node and falls back from NVLink peer-to-peer; hpcml binds HPCML_GPU_MAP[r].
    # -C gpu on the step itself: a pilot trainer gets its own allocation from srun. The GPUs
    # are the node's (--gpus-per-node), not a task's: --gpus-per-task gives each task a device
    # cgroup of its own GPU, which --gpu-bind=none does not undo, and CUDA IPC between the
    # ranks of a node breaks (why WarpX's and E3SM's Perlmutter scripts avoid it; issue 41).
    train_launch="srun -C gpu -N{nodes} -n{ranks} -c32 --cpu-bind=cores --gpus-per-node=4 --gpu-bind=none",
    train_launch_why="GPU nodes (-C gpu, also when srun allocates in pilot mode), one rank per GPU on 16 cores; "
                     "the node's 4 GPUs visible to every rank (--gpus-per-node, not per task: CUDA IPC between "
                     "them) and each binds HPCML_GPU_MAP[r]",
    train_launch_source=GPU_JOBS,
    sim_launch="$PARSL_MPI_PREFIX",
    mpi_launcher="srun",
    job_directives=(
        Fact(text="#SBATCH --constraint=gpu", why="GPU nodes: NERSC selects them by constraint, not by partition",
             source=GPU_JOBS),
        Fact(text="#SBATCH --gpus-per-node=4", why="Slurm gives GPUs only when asked", source=GPU_JOBS),
    ),
    stream_interface="hsn0",
)
