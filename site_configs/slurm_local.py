"""The two-node Slurm cluster that ``scripts/slurm_cluster.sh`` runs on this host (n1, n2).

The same contract as frontier.py, so every batch path runs for real in the tests: a
``SlurmProvider`` block, ``MPIExecutor`` with ``srun`` steps for the simulations, drain
before the walltime, the outer job script of ``hpcml job`` with its walltime signal and
requeue. Point Slurm's commands at the cluster first: ``eval $(scripts/slurm_cluster.sh env)``.
See docs/sites/slurm-local.md.
"""

from __future__ import annotations

from hpcml.ensemble.site import Queue, Site, SiteHardware, Source, host_memory_gib

#: CPUs slurm_cluster.sh gives each node (it oversubscribes this host's cores).
CPUS_PER_NODE = 4
#: The cluster's rules are those scripts/slurm_cluster.sh writes into its slurm.conf.
CLUSTER = Source(url="scripts/slurm_cluster.sh", read="2026-11-25")


SITE = Site(
    hardware=SiteHardware(
        name="slurm-local",
        gpus_per_node=0,
        gpu_model="none",
        cpu_cores_per_node=CPUS_PER_NODE,
        memory_gb_per_node=round(host_memory_gib() / 4, 1),
        gpu_memory_gb=0.0,
        peak_tflops_bf16_per_gpu=0.0,
        peak_tflops_fp32_per_gpu=0.0,
        node_injection_gbps=0.0,
        intra_node_link="shared memory (both nodes are this host)",
        scheduler="slurm",
    ),
    # one exclusive block of whole nodes in the debug partition, as on Frontier (Parsl's
    # template asks one task per node, too few CPUs for a simulation's srun step)
    queues=(Queue(name="debug", kind="partition", min_nodes=1, max_nodes=2, max_walltime="999:00:00",
                  note="PartitionName=debug Nodes=ALL MaxTime=INFINITE", source=CLUSTER),),
    train_ranks_per_node=2,
    train_launch="srun -N{nodes} -n{ranks} --ntasks-per-node={ranks_per_node} --mpi=pmi2",
    train_launch_why="2 ranks per node; --mpi=pmi2: MPICH's PMI-2 client talks to slurmd's pmi2 plugin",
    sim_launch="$PARSL_MPI_PREFIX",
    mpi_launcher="srun",
)
