"""Launch-environment detection from faked scheduler variables (the only fakes allowed)."""

from __future__ import annotations

import re

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


def test_lsf_jsrun_summit():
    e = env.detect({"LSB_JOBID": "77", "JSM_NAMESPACE_RANK": "10", "JSM_NAMESPACE_SIZE": "12",
                    "JSM_NAMESPACE_LOCAL_RANK": "4", "JSM_NAMESPACE_LOCAL_SIZE": "6",
                    "OMPI_COMM_WORLD_RANK": "10", "OMPI_COMM_WORLD_SIZE": "12", "CUDA_VISIBLE_DEVICES": "0"})
    assert (e.scheduler, e.launcher, e.rank, e.world_size, e.local_rank, e.local_size) == ("lsf", "jsrun", 10, 12, 4, 6)
    assert env.device_index(e.local_rank, 1) == 0  # jsrun -g1: every rank sees device 0


def test_pbs_pals_polaris():
    e = env.detect({"PBS_JOBID": "5.polaris", "PALS_RANKID": "6", "PMI_SIZE": "8", "PMI_RANK": "6",
                    "PALS_LOCAL_RANKID": "2", "PALS_LOCAL_SIZE": "4", "PALS_NODEID": "1"})
    assert (e.scheduler, e.launcher, e.rank, e.world_size, e.local_rank, e.local_size) == ("pbs", "pals", 6, 8, 2, 4)
    assert env.device_index(e.local_rank, 4) == 2


def test_open_mpi():
    e = env.detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.local_size) == ("openmpi", 2, 3, 0, 1)


def test_device_index_round_robin_and_errors():
    assert [env.device_index(r, 4) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert env.device_index(7, 1) == 0
    with pytest.raises(LaunchError, match="device_count must be >= 1"):
        env.device_index(0, 0)


@pytest.mark.parametrize("environ,message", [
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, "PMI_RANK='x' is not an integer"),
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "rank 4 outside world size 4 (launcher mpich)"),
])
def test_bad_variables(environ, message):
    with pytest.raises(LaunchError) as info:
        env.detect(environ)
    assert str(info.value) == message and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("hostlist, names", [
    ("n1", ["n1"]), ("n[1-2]", ["n1", "n2"]), ("nid[001-003,007],login1", ["nid001", "nid002", "nid003", "nid007", "login1"]),
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
