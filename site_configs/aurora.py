"""Aurora (ALCF): Intel Data Center GPU Max 1550, Slingshot, PBS Pro + PALS. Facts and sources: docs/sites/aurora.md."""

from __future__ import annotations

from hpcml.ensemble.site import Account, EnvVar, Fact, Queue, Site, SiteHardware, Source

# The queue table changed in early 2026 (tiny and prod-large gone, prod from 256 nodes,
# debug-scaling to 256, capacity added): the rows below are the page's as of this date.
QUEUES = Source(url="https://docs.alcf.anl.gov/aurora/running-jobs-aurora/", read="2026-07-27")
QSUB = Source(url="https://docs.alcf.anl.gov/running-jobs/", read="2026-02-18")
CCL = Source(url="https://docs.alcf.anl.gov/aurora/data-science/frameworks/oneCCL/", read="2026-03-17")
PYTORCH = Source(url="https://docs.alcf.anl.gov/aurora/data-science/frameworks/pytorch/", read="2026-03-17")
KNOWN = Source(url="https://docs.alcf.anl.gov/aurora/known-issues/", read="2025-12-16")
PE = Source(url="https://docs.alcf.anl.gov/aurora/aurora-pe/", read="2026-11-28")
_CHAIN = "1 job running/accruing/queued per user: a running job cannot submit its successor"

#: Cores of the 12 ranks of a node, 8 each, skipping cores 0 and 52 (ALCF's binding).
CPU_BIND = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"

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
    account=Account(required=True, why="ALCF: '-A is a mandatory option ... qsub: Account_Name is required to be "
                                        "set'", source=QSUB),
    queues=(
        Queue(name="debug", min_nodes=1, max_nodes=2, max_walltime="01:00:00", min_walltime="00:05:00", max_running=1,
              max_queued=1, requeue=False, note=_CHAIN, source=QUEUES),
        Queue(name="debug-scaling", min_nodes=2, max_nodes=256, max_walltime="01:00:00", min_walltime="00:05:00",
              max_running=1, max_queued=1, requeue=False, note=_CHAIN, source=QUEUES),
        Queue(name="capacity", min_nodes=1, max_nodes=16, max_walltime="168:00:00", min_walltime="00:05:00",
              max_running=2, max_queued=5,
              note="5 jobs queued or running, 2 running, per user; 512 nodes across all jobs", source=QUEUES),
        # prod routes by size to small, medium and large; jobs are submitted to prod
        Queue(name="prod", min_nodes=256, max_nodes=1024, max_walltime="12:00:00", min_walltime="00:05:00",
              note="routed to small", source=QUEUES),
        Queue(name="prod", min_nodes=1025, max_nodes=1999, max_walltime="18:00:00", min_walltime="00:05:00",
              note="routed to medium", source=QUEUES),
        Queue(name="prod", min_nodes=2000, max_nodes=10624, max_walltime="24:00:00", min_walltime="00:05:00",
              note="routed to large", source=QUEUES),
        Queue(name="visualization", min_nodes=1, max_nodes=32, max_walltime="08:00:00", min_walltime="00:05:00",
              auto=False, note="by request only; nodes not exclusive", source=QUEUES),
    ),
    modules=(
        # no cray-hdf5-parallel: Aurora has no Cray PE; its default environment (oneAPI, MPICH and
        # the Spack PE, loaded by default) carries the HDF5 h5py is built against (docs/install.md)
        Fact(text="module load frameworks", why="ALCF's PyTorch with oneCCL (torch.distributed backend xccl); HDF5 "
                                                "comes with the default Aurora PE (oneAPI, MPICH, Spack PE)",
             source=PYTORCH),
    ),
    environment=(
        EnvVar(name="CCL_PROCESS_LAUNCHER", value="pmix", why="oneCCL's minimal set for training: ranks come "
                                                              "from PALS' PMIx", source=CCL, training_only=True),
        EnvVar(name="CCL_ATL_TRANSPORT", value="mpi", why="oneCCL's minimal set: MPI transport over Slingshot",
               source=CCL, training_only=True),
        EnvVar(name="CCL_KVS_MODE", value="mpi", why="oneCCL's minimal set: its key-value store over MPI",
               source=CCL, training_only=True),
        EnvVar(name="FI_MR_CACHE_MONITOR", value="userfaultfd", why="oneCCL's minimal set: a memory-registration "
                                                                    "cache monitor that is safe with GPU memory",
               source=CCL, training_only=True),
        EnvVar(name="ZE_FLAT_DEVICE_HIERARCHY", value="FLAT", why="each of the 12 tiles is a device, one rank each "
                                                                  "(the frameworks module's default, stated)",
               source=PYTORCH),
        EnvVar(name="TMPDIR", value="/tmp", why="a short TMPDIR: mpiexec's long one breaks AF_UNIX sockets "
                                                "(Python multiprocessing, PyTorch, Parsl)", source=KNOWN),
        EnvVar(name="HPCML_SOCKET_IFNAME", value="hsn0", why="stream and rendezvous on the Slingshot network"),
    ),
    train_ranks_per_node=12,
    # one rank per tile, 8 cores each (CPU_BIND); hpcml binds tile local_rank % 12
    train_launch=f"mpiexec -n {{ranks}} --ppn {{ranks_per_node}} --cpu-bind {CPU_BIND}",
    train_launch_why="PALS mpiexec, one rank per tile on 8 cores each, cores 0 and 52 left to the OS",
    train_launch_source=Source(url="https://docs.alcf.anl.gov/aurora/running-jobs-aurora/", read="2026-07-27"),
    sim_launch="$PARSL_MPI_PREFIX",
    mpi_launcher="mpiexec",
    # No MpiExecLauncher: its default --bind-to is rejected by PALS (Parsl #2446), and
    # MPIExecutor needs the SimpleLauncher anyway.
    block_options={"cpus_per_node": 208},
    job_directives=(
        Fact(text="#PBS -l filesystems=home:flare", why="mandatory at ALCF ('qsub: Resource: filesystems is required "
                                                       "to be set')", source=QSUB),
        Fact(text="#PBS -l place=scatter", why="each chunk (node) its own vnode: PBS packs chunks by default",
             source=QSUB),
    ),
    stream_interface="hsn0",
)
