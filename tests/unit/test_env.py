"""Launch-environment detection from faked scheduler variables (the only fakes allowed)."""

from __future__ import annotations

import re
import socket

import pytest

from hpcml import env
from hpcml.errors import LaunchError


def test_plain_process():
    e = env.detect({})
    assert (e.scheduler, e.launcher, e.rank, e.world_size, e.local_rank, e.local_size) == ("none", "none", 0, 1, 0, 1)


def test_slurm_srun_frontier():
    e = env.detect({"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0", "SLURM_PROCID": "13", "SLURM_STEP_NUM_TASKS": "16",
                    "SLURM_LOCALID": "5", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
                    "SLURMD_NODENAME": "frontier00042", "ROCR_VISIBLE_DEVICES": "5"})
    assert (e.scheduler, e.launcher, e.rank, e.world_size) == ("slurm", "srun", 13, 16)
    assert (e.local_rank, e.local_size, e.node, e.job_id) == (5, 8, "frontier00042", "123")
    assert e.visible_devices == {"ROCR_VISIBLE_DEVICES": "5"}


def test_slurm_uneven_tasks_per_node():
    base = {"SLURM_JOB_ID": "1", "SLURM_STEPID": "2", "SLURM_PROCID": "17", "SLURM_STEP_NUM_TASKS": "20",
            "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2),4"}
    assert env.detect({**base, "SLURM_NODEID": "2"}).local_size == 4
    assert env.detect({**base, "SLURM_NODEID": "0", "SLURM_PROCID": "1"}).local_size == 8
    with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE='8x2'"):
        env.detect({**base, "SLURM_STEP_TASKS_PER_NODE": "8x2"})


def test_batch_script_is_not_a_task():
    # The sbatch script itself has SLURM_PROCID=0 and SLURM_NTASKS=64 but no step: one process.
    e = env.detect({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "64", "SLURM_LOCALID": "0"})
    assert (e.scheduler, e.launcher, e.world_size) == ("slurm", "none", 1)


def test_mpiexec_inside_slurm_uses_pmi_not_inherited_procid():
    e = env.detect({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "PMI_RANK": "3", "PMI_SIZE": "4",
                    "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"})
    assert (e.scheduler, e.launcher, e.rank, e.world_size, e.local_rank, e.local_size) == \
        ("slurm", "mpich", 3, 4, 3, 4)


@pytest.mark.parametrize("environ,message", [
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, "PMI_RANK='x' is not an integer"),
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "rank 4 outside world size 4 (launcher mpich)"),
])
def test_bad_variables(environ, message):
    with pytest.raises(LaunchError) as info:
        env.detect(environ)
    assert str(info.value) == message and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("hostlist, names", [
    ("n1", ["n1"]), ("n[1-2]", ["n1", "n2"]),
    ("nid[001-003,007],login1", ["nid001", "nid002", "nid003", "nid007", "login1"]),
    ("x1000c0s[0-1]b0n0", ["x1000c0s0b0n0", "x1000c0s1b0n0"]), ("a[1-2]-ib,b9", ["a1-ib", "a2-ib", "b9"]),
])
def test_slurm_host_lists_expand_in_order(hostlist, names):
    assert env.expand_hostlist(hostlist) == names


@pytest.mark.parametrize("hostlist, message", [
    ("n[1-2", "unmatched '['"), ("n]1", "unmatched ']'"), ("n[2-1]", "bad range '2-1'"), ("n[a]", "bad range 'a'"),
])
def test_bad_host_lists_are_one_line(hostlist, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        env.expand_hostlist(hostlist)


def test_node_under_mpiexec_inside_sbatch_comes_from_the_node_id():
    """Hydra copies the batch shell's SLURMD_NODENAME (n1) to every rank; the rank on the
    second node knows it by SLURM_NODEID and the proxies' step node list (seen on slurm-local)."""
    base = {"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "n1", "SLURM_STEP_NODELIST": "n[1-2]", "PMI_RANK": "2",
            "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert env.detect({**base, "SLURM_NODEID": "1"}).node == "n2"
    assert env.detect({**base, "SLURM_NODEID": "0"}).node == "n1"
    assert env.detect({"SLURM_JOB_ID": "9", "SLURMD_NODENAME": "frontier01"}).node == "frontier01"


def test_job_deadline_from_the_job_script_or_slurm():
    assert env.job_deadline({}) is None
    assert env.job_deadline({"HPCML_JOB_DEADLINE": "1795400000"}) == 1795400000.0
    assert env.job_deadline({"SLURM_JOB_END_TIME": "1795400060"}) == 1795400060.0
    with pytest.raises(LaunchError, match="HPCML_JOB_DEADLINE='soon' is not epoch seconds"):
        env.job_deadline({"HPCML_JOB_DEADLINE": "soon"})


# ---- Every launcher, with the whole environment it gives a rank that is neither rank 0 nor on node 0:
# rank 9 of 16, local rank 1 of 8, node 1 of 2, batch-job variables included. Sources are in the comment of
# each set; hpcml/env.py's _LAUNCHERS cites the same.

# What the batch shell of `sbatch -N2 --ntasks-per-node=8` holds and every step inherits: sbatch(1)/srun(1)
# OUTPUT ENVIRONMENT VARIABLES (https://slurm.schedmd.com/sbatch.html); SchedMD/slurm src/common/env.c.
SLURM_BATCH = {
    "SLURM_JOB_ID": "1234567", "SLURM_JOBID": "1234567", "SLURM_JOB_NAME": "train", "SLURM_JOB_ACCOUNT": "abc123",
    "SLURM_JOB_PARTITION": "batch", "SLURM_CLUSTER_NAME": "frontier", "SLURM_SUBMIT_DIR": "/lustre/run",
    "SLURM_JOB_NODELIST": "frontier[00041-00042]", "SLURM_NODELIST": "frontier[00041-00042]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_NPROCS": "16",
    "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_CPUS_PER_NODE": "56(x2)", "SLURM_JOB_END_TIME": "1795400060",
}

# What slurmstepd adds to task 9 of step 0 (`srun -n16`, 8 per node): src/common/env.c setup_env() and
# env_array_for_step(); --gpu-bind=closest gives local rank 1 GCD 5 (OLCF Frontier guide, hello_jobstep).
SRUN_TASK_9 = {
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "frontier[00041-00042]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURMD_NODENAME": "frontier00042",
    "SLURM_GTIDS": "8,9,10,11,12,13,14,15", "SLURM_TASK_PID": "48213", "SLURM_CPUS_ON_NODE": "56",
    "SLURM_LAUNCH_NODE_IPADDR": "10.128.0.41", "SLURM_SRUN_COMM_HOST": "10.128.0.41", "SLURM_SRUN_COMM_PORT": "40713",
    "SLURM_STEP_LAUNCHER_PORT": "40713", "ROCR_VISIBLE_DEVICES": "5",
}

# srun --mpi=cray_shasta since Slurm 23.02: SchedMD/slurm src/plugins/mpi/cray_shasta/mpi_cray_shasta.c,
# mpi_p_slurmstepd_task(), and _set_pmi_port(); no PALS_LOCAL_SIZE.
CRAY_SHASTA_TASK_9 = {
    "SLURM_MPI_TYPE": "cray_shasta", "PALS_APID": "1234567.0", "PALS_RANKID": "9", "PALS_NODEID": "1",
    "PALS_LOCAL_RANKID": "1", "PALS_SPOOL_DIR": "/var/spool/slurmd/mpi_cray_shasta/1234567.0",
    "PALS_APINFO": "/var/spool/slurmd/mpi_cray_shasta/1234567.0/apinfo", "PMI_JOBID": "1234567",
    "PMI_RANK": "9", "PMI_SIZE": "16", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "8", "PMI_UNIVERSE_SIZE": "16",
    "PMI_CONTROL_PORT": "11998", "PMI_SHARED_SECRET": "8467329148392017",
}
# Before Slurm 23.02 (the parent of commit 0dbdbf9399): PALS_RANKID, PALS_NODEID and the spool paths only.
CRAY_SHASTA_OLD_TASK_9 = {k: v for k, v in CRAY_SHASTA_TASK_9.items()
                          if k in ("SLURM_MPI_TYPE", "PALS_APID", "PALS_RANKID", "PALS_NODEID", "PALS_SPOOL_DIR",
                                   "PALS_APINFO", "PMI_CONTROL_PORT")}


def _launch(e: env.LaunchEnv) -> tuple:
    return (e.scheduler, e.launcher, e.rank, e.world_size, e.local_rank, e.local_size, e.node, e.node_id, e.guessed)


@pytest.mark.parametrize("plugin", [CRAY_SHASTA_TASK_9, CRAY_SHASTA_OLD_TASK_9], ids=["slurm>=23.02", "slurm<23.02"])
def test_srun_cray_shasta_frontier_perlmutter(plugin):
    """The default MPI plugin on Frontier and Perlmutter sets no PALS_LOCAL_SIZE (and before 23.02
    no local rank or size at all): both come from srun's own SLURM_LOCALID and
    SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID, never a guess (once 'local 1/2' for 1 of 8)."""
    e = env.detect({**SLURM_BATCH, **SRUN_TASK_9, **plugin})
    assert _launch(e) == ("slurm", "pals", 9, 16, 1, 8, "frontier00042", 1, ())
    assert e.job_id == "1234567" and e.visible_devices == {"ROCR_VISIBLE_DEVICES": "5"}


def test_srun_without_an_mpi_plugin():
    e = env.detect({**SLURM_BATCH, **SRUN_TASK_9, "SLURM_MPI_TYPE": "none"})
    assert _launch(e) == ("slurm", "srun", 9, 16, 1, 8, "frontier00042", 1, ())


def test_srun_pmi2_takes_locals_from_slurm():
    # src/plugins/mpi/pmi2/mpi_pmi2.c: PMI_FD, PMI_JOBID, PMI_RANK, PMI_SIZE and nothing local.
    e = env.detect({**SLURM_BATCH, **SRUN_TASK_9, "SLURM_MPI_TYPE": "pmi2", "PMI_FD": "7",
                    "PMI_JOBID": "1234567.0", "PMI_RANK": "9", "PMI_SIZE": "16"})
    assert _launch(e) == ("slurm", "mpich", 9, 16, 1, 8, "frontier00042", 1, ())


def test_pbs_pals_mpiexec_polaris():
    """PBS batch shell variables (OpenPBS start_exec.c; mpiexec passes them on, so PBS_NODENUM=0
    reaches every rank) and PALS's own: the PALS_*/PMI_* set of Slurm's commit 0dbdbf9399 message,
    flux-coral2 cray_pals.c unset_pals_env(), ALCF's Polaris guide (PMI_LOCAL_RANK/SIZE)."""
    e = env.detect({
        "PBS_JOBID": "123456.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov", "PBS_JOBNAME": "train", "PBS_QUEUE": "small",
        "PBS_ACCOUNT": "abc123", "PBS_O_WORKDIR": "/eagle/abc123/run", "PBS_O_HOST": "polaris-login-01",
        "PBS_NODEFILE": "/var/spool/pbs/aux/123456.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov",
        "PBS_ENVIRONMENT": "PBS_BATCH", "PBS_NODENUM": "0", "PBS_VNODENUM": "0", "PBS_TASKNUM": "1",
        "PBS_MOMPORT": "15003", "PBS_JOBCOOKIE": "5E0D1C2B3A49",
        "PALS_APID": "8c1e4a52-3f0b-4f1e-9d8e-2b7a6c5d4e3f", "PALS_APINFO": "/var/run/palsd/8c1e4a52/apinfo",
        "PALS_SPOOL_DIR": "/var/run/palsd/8c1e4a52", "PALS_DEPTH": "8", "PALS_RANKID": "9", "PALS_NODEID": "1",
        "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "8", "PMI_RANK": "9", "PMI_SIZE": "16", "PMI_LOCAL_RANK": "1",
        "PMI_LOCAL_SIZE": "8", "PMI_UNIVERSE_SIZE": "16", "PMI_JOBID": "8c1e4a52", "PMI_CONTROL_PORT": "11998,11999",
        "PMI_SHARED_SECRET": "1530046254398432"})
    assert _launch(e) == ("pbs", "pals", 9, 16, 1, 8, socket.gethostname(), 1, ())


# Hydra's slurm bootstrap starts one proxy per node with `srun -N2 -n2 ... hydra_pmi_proxy` (pmodels/mpich
# src/pm/hydra/lib/tools/bootstrap/external/slurm_launch.c); the proxy sets PMI_RANK, PMI_SIZE, PMI_FD,
# MPI_LOCALRANKID, MPI_LOCALNRANKS (src/pm/hydra/proxy/pmip_cb.c; also seen from Hydra 4.0.2 here with
# `mpiexec -n 2 env`). So rank 9 sees the proxy step's SLURM_STEP_* and SLURM_NODEID=1, and:
HYDRA_TASK_9 = {"PMI_RANK": "9", "PMI_SIZE": "16", "PMI_FD": "6", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "8",
                "HYDI_CONTROL_FD": "7", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_NODES": "2",
                "SLURM_STEP_NODELIST": "frontier[00041-00042]", "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"}
# MPICH 4.0-4.2 copy mpiexec's (the batch shell's) SLURM_* over the proxy's (slurm_env.c, fixed in 572eb059d4
# for 4.3), as tests/slurm/test_cluster.py sees on slurm-local: batch task 0 on node frontier00041 ...
HYDRA_4_0_BATCH = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "frontier00041"}
# ... while 4.3 and later keep the proxy step's own: task 1 of 2, the only one on its node.
HYDRA_4_3_PROXY = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2",
                   "SLURM_TASKS_PER_NODE": "1(x2)", "SLURMD_NODENAME": "frontier00042"}


@pytest.mark.parametrize("slurm", [HYDRA_4_0_BATCH, HYDRA_4_3_PROXY], ids=["mpich4.0-4.2", "mpich>=4.3"])
def test_hydra_mpiexec_inside_sbatch(slurm):
    """The proxy step's SLURM_LOCALID is 0 on every rank: its locals describe the proxy, not
    this rank (SLURM_PROCID differs), so none of them is taken; no node index from Hydra."""
    e = env.detect({**SLURM_BATCH, **HYDRA_TASK_9, **slurm})
    assert _launch(e) == ("slurm", "mpich", 9, 16, 1, 8, "frontier00042", None, ())


def test_hydra_rank_0_does_not_take_the_proxy_steps_locals():
    # SLURM_PROCID=0 names rank 0 too, but the proxy step has 2 tasks, not 16: another process.
    e = env.detect({**SLURM_BATCH, **HYDRA_TASK_9, **HYDRA_4_0_BATCH, "SLURM_NODEID": "0", "PMI_RANK": "0",
                    "MPI_LOCALRANKID": "0"})
    assert _launch(e) == ("slurm", "mpich", 0, 16, 0, 8, "frontier00041", None, ())


def test_open_mpi_mpirun_inside_sbatch():
    """https://docs.open-mpi.org/en/v5.0.x/tuning-apps/environment-var.html plus PMIx's; PRRTE
    starts daemons with one srun step on the nodes that have none (openpmix/prrte
    src/mca/plm/slurm/plm_slurm_module.c), so rank 9 sees task 0 of a 1-task step on its node."""
    e = env.detect({**SLURM_BATCH, "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "OMPI_UNIVERSE_SIZE": "16",
                    "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "9", "PMIX_NAMESPACE": "prterun-login1-2718@1",
                    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "frontier00042",
                    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1",
                    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_CPU_BIND": "none",
                    "SLURMD_NODENAME": "frontier00042"})
    assert _launch(e) == ("slurm", "openmpi", 9, 16, 1, 8, "frontier00042", None, ())


def test_lsf_jsrun_summit():
    """JSM_NAMESPACE_* as Lightning's LSFEnvironment documents them; Spectrum MPI's
    OMPI_COMM_WORLD_RANK/SIZE (OLCF Summit guide's per-rank nsys example); LSF's batch variables."""
    e = env.detect({"LSB_JOBID": "2718281", "LSB_JOBNAME": "train", "LSB_JOBINDEX": "0",
                    "LSB_DJOB_RANKFILE": "/ccs/home/u/.lsbatch/1700000000.2718281.hostfile",
                    "LSB_DJOB_HOSTFILE": "/ccs/home/u/.lsbatch/1700000000.2718281.hostfile",
                    "LSB_MCPU_HOSTS": "batch1 1 h41n01 42 h41n02 42", "LS_JOBPID": "31337",
                    "JSM_NAMESPACE_RANK": "9", "JSM_NAMESPACE_SIZE": "16", "JSM_NAMESPACE_LOCAL_RANK": "1",
                    "JSM_NAMESPACE_LOCAL_SIZE": "8", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16",
                    "PMIX_RANK": "9", "CUDA_VISIBLE_DEVICES": "1"})
    assert _launch(e) == ("lsf", "jsrun", 9, 16, 1, 8, socket.gethostname(), None, ())
    assert env.device_index(e.local_rank, 1) == 0  # jsrun -g1: every rank sees one device, index 0


def test_missing_counts_are_marked_not_invented():
    # A rank variable and nothing else: the least sizes that fit, flagged as guesses.
    e = env.detect({"PALS_RANKID": "9", "PALS_LOCAL_RANKID": "1"})
    assert (e.world_size, e.local_size, e.guessed) == (10, 2, ("world_size", "local_size"))
    assert env.detect({"PALS_RANKID": "3"}).guessed == ("world_size", "local_rank", "local_size")


def test_launchers_that_disagree_are_an_error_not_a_clamp():
    with pytest.raises(LaunchError, match=re.escape("local rank 8 outside local size 8 (launcher srun)")):
        env.detect({**SLURM_BATCH, **SRUN_TASK_9, "SLURM_LOCALID": "8"})


# ---- The GPU a local rank binds to.

def test_device_index_round_robin_and_errors():
    assert [env.device_index(r, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert env.device_index(7, 1) == 0
    with pytest.raises(LaunchError, match="device_count must be >= 1"):
        env.device_index(0, 0)
    with pytest.raises(LaunchError, match="local_rank must be >= 0, got -1"):
        env.device_index(-1, 4)


def test_gpu_map_reverses_polaris_and_perlmutter():
    # ALCF set_affinity_gpu_polaris.sh: gpu = num_gpus - 1 - local_rank % num_gpus.
    reverse = env.gpu_map({"HPCML_GPU_MAP": "3,2,1,0"})
    assert reverse == (3, 2, 1, 0)
    assert [env.device_index(r, 4, reverse) for r in range(8)] == [3, 2, 1, 0, 3, 2, 1, 0]
    assert [env.device_index(r, 4, reverse) for r in range(8)] == [4 - 1 - r % 4 for r in range(8)]
    assert [env.device_index(r, 4, None) for r in range(4)] == [0, 1, 2, 3]


def test_gpu_map_ignored_where_the_process_sees_one_device():
    # --gpu-bind=closest, jsrun -g1 or a CUDA_VISIBLE_DEVICES of one: device 0 is already the near one.
    assert [env.device_index(r, 1, (3, 2, 1, 0)) for r in range(8)] == [0] * 8


def test_gpu_map_from_the_job_environment_on_perlmutter():
    # Perlmutter, `srun -N2 -n8 --gpu-bind=none`: every rank sees the 4 A100s (WarpX's
    # Tools/machines/perlmutter-nersc/perlmutter_gpu.sbatch sets CUDA_VISIBLE_DEVICES=$((3-SLURM_LOCALID)) for the
    # same reason); the site file puts the map in the job environment. Rank 5 of 8 is local rank 1 of node 1.
    environ = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "nid[001000-001001]", "SLURM_NTASKS": "8",
               "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "nid[001000-001001]",
               "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_PROCID": "5",
               "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURMD_NODENAME": "nid001001", "PALS_RANKID": "5",
               "PALS_NODEID": "1", "PALS_LOCAL_RANKID": "1", "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1",
               "PMI_LOCAL_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "HPCML_GPU_MAP": "3,2,1,0"}
    e = env.detect(environ)
    assert (e.launcher, e.rank, e.local_rank, e.local_size, e.node, e.node_id) == ("pals", 5, 1, 4, "nid001001", 1)
    assert env.device_index(e.local_rank, 4, env.gpu_map(environ)) == 2


@pytest.mark.parametrize("value", ["", "  "])
def test_gpu_map_unset(value):
    assert env.gpu_map({}) is None and env.gpu_map({"HPCML_GPU_MAP": value}) is None
    assert env.gpu_map({"HPCML_GPU_MAP": " 1, 0 "}) == (1, 0)


@pytest.mark.parametrize("value, message", [
    ("3,2,x,0", "HPCML_GPU_MAP='3,2,x,0': expected device indices separated by commas, e.g. '3,2,1,0'"),
    ("3;2;1;0", "HPCML_GPU_MAP='3;2;1;0': expected device indices separated by commas, e.g. '3,2,1,0'"),
    ("3,2,", "HPCML_GPU_MAP='3,2,': expected device indices separated by commas, e.g. '3,2,1,0'"),
    ("1,1", "HPCML_GPU_MAP='1,1': expected distinct device indices >= 0, e.g. '3,2,1,0'"),
    ("0,-1", "HPCML_GPU_MAP='0,-1': expected distinct device indices >= 0, e.g. '3,2,1,0'"),
])
def test_bad_gpu_map_is_one_line(value, message):
    with pytest.raises(LaunchError) as info:
        env.gpu_map({"HPCML_GPU_MAP": value})
    assert str(info.value) == message


@pytest.mark.parametrize("gpu_map, count, message", [
    ((3, 2, 1, 0), 2, "GPU map 3,2,1,0 names device 3, but this process sees 2 (0-1): expected indices < 2, "
                      "or unset HPCML_GPU_MAP"),
    ((0, 1, 1), 4, "GPU map 0,1,1 lists device 1 twice: expected each device once"),
    ((), 4, "GPU map is empty: expected device indices such as 3,2,1,0"),
])
def test_gpu_map_that_does_not_fit_the_devices(gpu_map, count, message):
    with pytest.raises(LaunchError) as info:
        env.device_index(0, count, gpu_map)
    assert str(info.value) == message and "\n" not in message
