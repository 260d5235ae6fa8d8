"""Polaris (ALCF): NVIDIA A100, HPE Slingshot, PBS Pro + PALS. Facts and sources: docs/sites/polaris.md."""

from __future__ import annotations

from hpcml.ensemble.site import Account, EnvVar, Fact, Queue, Site, SiteHardware, Source

QUEUES = Source(url="https://docs.alcf.anl.gov/polaris/running-jobs/", read="2026-02-17")
QSUB = Source(url="https://docs.alcf.anl.gov/running-jobs/", read="2026-02-18")
NCCL = Source(url="https://docs.alcf.anl.gov/polaris/applications-and-libraries/libraries/nccl/", read="2025-01-21")
PYTORCH = Source(url="https://docs.alcf.anl.gov/polaris/data-science/frameworks/pytorch/", read="2026-03-11")
AFFINITY = Source(url="https://docs.alcf.anl.gov/polaris/running-jobs/using-gpus/", read="2025-04-03")
TOPOLOGY = Source(url="https://docs.alcf.anl.gov/polaris/", read="2025-03-11")
KNOWN = Source(url="https://docs.alcf.anl.gov/polaris/known-issues/", read="2026-07-30")
_CHAIN = "1 job running/accruing/queued per user: a running job cannot submit its successor"

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
    account=Account(required=True, why="ALCF: '-A is a mandatory option ... qsub: Account_Name is required to be "
                                        "set'", source=QSUB),
    queues=(
        Queue(name="debug", min_nodes=1, max_nodes=2, max_walltime="01:00:00", min_walltime="00:05:00",
              note="at most 24 nodes in use by the queue, 8 of them exclusive", source=QUEUES),
        Queue(name="debug-scaling", min_nodes=1, max_nodes=10, max_walltime="01:00:00", min_walltime="00:05:00",
              max_running=1, max_queued=1, requeue=False, note=_CHAIN, source=QUEUES),
        # prod routes by size to small, medium and large; jobs are submitted to prod
        Queue(name="prod", min_nodes=10, max_nodes=24, max_walltime="03:00:00", min_walltime="00:05:00",
              note="routed to small", source=QUEUES),
        Queue(name="prod", min_nodes=25, max_nodes=99, max_walltime="06:00:00", min_walltime="00:05:00",
              note="routed to medium", source=QUEUES),
        Queue(name="prod", min_nodes=100, max_nodes=496, max_walltime="24:00:00", min_walltime="00:05:00",
              note="routed to large", source=QUEUES),
        Queue(name="capacity", min_nodes=1, max_nodes=4, max_walltime="168:00:00", min_walltime="00:05:00",
              max_running=1, max_queued=2,
              note="2 jobs queued or running, 1 running, per user; 32 nodes across all jobs", source=QUEUES),
        Queue(name="preemptable", min_nodes=1, max_nodes=10, max_walltime="72:00:00", min_walltime="00:05:00",
              auto=False, note="killed when a demand job needs the nodes; #PBS -r y reruns it", source=QUEUES),
        Queue(name="demand", min_nodes=1, max_nodes=56, max_walltime="01:00:00", min_walltime="00:05:00", auto=False,
              note="by request only", source=QUEUES),
    ),
    modules=(
        Fact(text="module use /soft/modulefiles", why="ALCF's module tree (conda, the NCCL plugin's libraries)",
             source=PYTORCH),
        Fact(text="module load PrgEnv-gnu cray-hdf5-parallel conda",
             why="the compilers and parallel HDF5 h5py was built against (docs/install.md), and ALCF's PyTorch",
             source=PYTORCH),
        Fact(text="export LD_LIBRARY_PATH=/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib/"
                  ":$LD_LIBRARY_PATH",
             why="NCCL's Slingshot plugin (aws-ofi-nccl) and its hwloc: without it NCCL talks TCP sockets",
             source=NCCL),
    ),
    environment=(
        EnvVar(name="NCCL_NET", value="AWS Libfabric", why="use the aws-ofi-nccl plugin (ALCF: 2-3x for some "
                                                             "communication workloads)",
               source=NCCL, training_only=True),
        EnvVar(name="NCCL_NET_GDR_LEVEL", value="PHB", why="GPUDirect RDMA through the PCIe host bridge",
               source=NCCL, training_only=True),
        EnvVar(name="NCCL_CROSS_NIC", value="1", why="rings may use both NICs of a node",
               source=NCCL, training_only=True),
        EnvVar(name="NCCL_COLLNET_ENABLE", value="1", why="ALCF's measured best setting",
               source=NCCL, training_only=True),
        EnvVar(name="FI_CXI_DISABLE_HOST_REGISTER", value="1", why="libfabric CXI setting ALCF pairs with the plugin",
               source=NCCL, training_only=True),
        EnvVar(name="FI_MR_CACHE_MONITOR", value="userfaultfd", why="libfabric's memory-registration cache monitor "
                                                                    "that is safe with CUDA",
               source=NCCL, training_only=True),
        EnvVar(name="FI_CXI_DEFAULT_CQ_SIZE", value="131072", why="a larger completion queue for collectives",
               source=NCCL, training_only=True),
        EnvVar(name="HPCML_GPU_MAP", value="3,2,1,0",
               why="GPU i sits on NUMA domain 3-i: local rank r (cores 8r..8r+7) drives GPU 3-r, as ALCF's "
                   "set_affinity_gpu_polaris.sh does", source=AFFINITY),
        EnvVar(name="TMPDIR", value="/tmp", why="a short TMPDIR: mpiexec's long one breaks AF_UNIX sockets "
                                                "(Python multiprocessing, Parsl)", source=KNOWN),
        EnvVar(name="HPCML_SOCKET_IFNAME", value="hsn0", why="stream and rendezvous on the Slingshot network"),
    ),
    train_ranks_per_node=4,
    # one rank per GPU, 8 cores each (--depth): rank r on NUMA domain r, GPU 3-r (HPCML_GPU_MAP)
    train_launch="mpiexec -n {ranks} --ppn {ranks_per_node} --depth=8 --cpu-bind depth",
    train_launch_why="PALS mpiexec, one rank per GPU on 8 cores each (rank r on NUMA domain r); every rank sees "
                     "the 4 GPUs and binds HPCML_GPU_MAP[r]",
    train_launch_source=PYTORCH,
    sim_launch="$PARSL_MPI_PREFIX",  # mpiexec -n ... -ppn ... -hosts ..., composed by MPIExecutor
    mpi_launcher="mpiexec",
    block_options={"cpus_per_node": 64},
    select_options="system=polaris",
    select_source=QSUB,
    job_directives=(
        Fact(text="#PBS -l filesystems=home:eagle", why="mandatory at ALCF ('qsub: Resource: filesystems is required "
                                                       "to be set')", source=QSUB),
        Fact(text="#PBS -l place=scatter", why="each chunk (node) its own vnode: PBS packs chunks by default",
             source=QSUB),
    ),
    stream_interface="hsn0",
)
