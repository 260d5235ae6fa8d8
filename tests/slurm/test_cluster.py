"""Two real Slurm nodes on one host: MPI across them, the grid's node map, `hpcml job --submit`."""

from __future__ import annotations

import json
import time

from tests.slurm.scenarios import BIN, PY, ROOT, sh, submit, wait_done

GRID = [str(BIN / "hpcml"), "grid", "--tp", "2", "--check"]


def _node_column(text: str) -> list[str]:
    """The node of each rank from `hpcml grid --check`'s table."""
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    return [r[1] for r in rows]


def test_both_nodes_answer():
    out = sh("sinfo", "-h", "-N", "-o", "%N %t %c", check=True)
    assert sorted(out.stdout.split("\n")[:2]) == ["n1 idle 4", "n2 idle 4"]


def test_grid_under_srun_sees_two_nodes_though_they_share_a_host():
    out = sh("srun", "-N2", "--ntasks-per-node=2", "--mpi=pmi2", *GRID, timeout=180, check=True)
    first = out.stdout.splitlines()[0]
    assert first.startswith("ProcessGrid: 4 ranks = pp(1) x dp(2) x cp(1) x tp(2) on 2 node(s)"), out.stdout
    assert _node_column(out.stdout) == ["n1", "n1", "n2", "n2"]
    assert "check passed: 5 groups" in out.stderr


def test_ranks_on_both_logical_nodes_share_the_cores_of_their_one_host():
    """n1 and n2 are one machine: the 4 ranks share its cores, so each takes a quarter of
    them for its threads. (MPI's shared-memory split counts srun's nodes apart: a rank per
    node would take every core, 4x oversubscribed, training ran ~10x slower.) The ranks of a
    node share a session (srun's), so they are not pinned, though they outnumber the cores
    (docs/grid.md "CPUs")."""
    def sharing(*wrapper: str) -> tuple[list[tuple[int, ...]], str]:
        """(rank, grid cpus, sharers, CPUs before the grid, CPUs after) of each of 4 srun ranks."""
        code = ("import os; from hpcml.grid import ProcessGrid; n = len(os.sched_getaffinity(0)); g = ProcessGrid(); "
                "print('sharing', g.rank, g.cpus, g.cpu_sharers, n, len(os.sched_getaffinity(0)), flush=True)")
        out = sh("srun", "-N2", "--ntasks-per-node=2", "--mpi=pmi2", *wrapper, PY, "-c", code, timeout=180, check=True)
        return sorted(tuple(int(x) for x in line.split()[1:]) for line in out.stdout.splitlines()
                      if line.startswith("sharing")), out.stdout

    rows, text = sharing()
    assert [r[0] for r in rows] == [0, 1, 2, 3], text
    assert all(sharers == 4 and cpus == before == after for _, cpus, sharers, before, after in rows), text
    # the same ranks, each in a session of its own (as Hydra starts them): pinned round-robin
    rows, text = sharing("setsid", "-w")
    n = rows[0][3]
    assert [(cpus, sharers, after) for _, cpus, sharers, _, after in rows] == [(1, len(range(r % n, 4, n)), 1)
                                                                                for r in range(4)], text


def test_grid_under_mpiexec_inside_sbatch_sees_two_nodes(tmp_path):
    """Hydra copies the batch shell's SLURMD_NODENAME to every rank; the node comes from
    SLURM_NODEID and the step's node list instead."""
    script = tmp_path / "grid.sbatch"
    script.write_text(f"#!/bin/bash\nmpiexec -n $SLURM_NTASKS {' '.join(GRID)}\n")
    job_id = sh("sbatch", "--parsable", "-N2", "--ntasks-per-node=2", "-o", str(tmp_path / "grid.out"), str(script),
                cwd=tmp_path, check=True).stdout.strip()
    record = wait_done(job_id, 180)
    text = (tmp_path / "grid.out").read_text()
    assert record["JobState"] == "COMPLETED", text
    head = next(line for line in text.splitlines() if line.startswith("ProcessGrid:"))
    assert "on 2 node(s)" in head and _node_column(text) == ["n1", "n1", "n2", "n2"], text


def test_hpcml_job_submit_runs_the_site_launch_line(tmp_path):
    """A real submission: the script `hpcml job` writes runs 2 ranks per node on both nodes
    (slurm-local's train launch line) and the job id is printed."""
    code = ("from mpi4py import MPI; import os, json; c = MPI.COMM_WORLD; "
            "print(json.dumps([c.rank, c.size, os.environ['SLURMD_NODENAME'], c.allreduce(c.rank), "
            "os.environ['HPCML_SITE'], os.environ['HPCML_JOB_DEADLINE']]), flush=True)")
    job_id = submit(tmp_path, "hello", nodes="2", walltime="00:05:00", cmd=[PY, "-c", code])
    record = wait_done(job_id, 180)
    text = (tmp_path / f"hello-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text
    rows = sorted(json.loads(line) for line in text.splitlines() if line.startswith("["))
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        (0, 4, "n1", 6, "slurm-local"), (1, 4, "n1", 6, "slurm-local"),
        (2, 4, "n2", 6, "slurm-local"), (3, 4, "n2", 6, "slurm-local")]
    assert 200 < int(rows[0][5]) - time.time() <= 300  # HPCML_JOB_DEADLINE: the job's start + its walltime
    script = (tmp_path / "hello.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@60" in script and "#SBATCH --requeue" in script
    assert "srun -N2 -n4 --ntasks-per-node=2 --mpi=pmi2 " in script


def test_hybrid_sharding_and_hpz_on_two_nodes_through_hpcml_job(tmp_path):
    """Issue 46 on the real scheduler: `hpcml job` on n1 and n2 (2 ranks each, the node map
    Slurm's): HSDP and hpZ train as one process (fp64, 1e-10; the reference transformer and a
    MoE model), and the bytes each kind sends
    inside and across the two nodes are the planner's exactly (tests/mpi/test_hsdp.py)."""
    select = "equal_one_process and (hsdp-node or hpz) or planners_exactly"  # the transformer's and MoE's
    job_id = submit(tmp_path, "hsdp", nodes="2", walltime="00:10:00",
                    cmd=["env", "HPCML_TEST_REAL_NODES=1", PY, str(ROOT / "tests" / "mpi_pytest.py"),
                         str(ROOT / "tests" / "mpi" / "test_hsdp.py"), "-q", "-p", "no:cacheprovider", "-k", select])
    record = wait_done(job_id, 420)
    text = (tmp_path / f"hsdp-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text[-3000:]
    assert "5 passed" in text, text[-3000:]
