"""End to end under mpiexec: the `hpcml grid --check` command, clean failures, no hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_LOCAL", "SLURM_", "OMPI_"))}


def mpiexec(n: int, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["mpiexec", "-n", str(n), *cmd], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT)


def test_grid_check_on_4_ranks():
    out = mpiexec(4, str(BIN / "hpcml"), "grid", "--tp", "2", "--check")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ProcessGrid: 4 ranks = pp(1) x dp(2) x cp(1) x tp(2) on 1 node(s); torch backend gloo")
    assert [line.split()[3:] for line in lines[2:6]] == [
        ["0", "0", "0", "0", "cpu"], ["0", "0", "0", "1", "cpu"],
        ["0", "1", "0", "0", "cpu"], ["0", "1", "0", "1", "cpu"]]
    assert "  tp: [[0, 1], [2, 3]]" in lines and "  dp: [[0, 2], [1, 3]]" in lines
    assert "check passed: 5 groups on each rank agree in layout, MPI and torch" in out.stderr


def test_grid_check_of_a_population_on_4_ranks():
    """Two members of tp 2: each member's groups, and the population's, checked in MPI and torch."""
    out = mpiexec(4, str(BIN / "hpcml"), "grid", "--pop", "2", "--tp", "2", "--check")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ProcessGrid: 2 ranks = pp(1) x dp(1) x cp(1) x tp(2) on 1 node(s); torch backend gloo")
    assert lines[1] == "population: 2 members of 2 ranks " \
                       "(world ranks 0-1 are member 0, shown below by their rank in it)"
    assert "check passed: 6 groups on each rank agree in layout, MPI and torch" in out.stderr


def test_grid_check_bad_input_one_line_every_rank_exits():
    out = mpiexec(4, str(BIN / "hpcml"), "grid", "--tp", "3", "--check")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "hpcml: error: cannot infer dp: tp(3) * pp(1) = 3 does not divide world size 4; "
        "4 ranks fit only dp(4), or run on a multiple of 3 ranks"]


def test_raising_rank_aborts_the_job():
    script = textwrap.dedent("""
        from mpi4py import MPI
        from hpcml.grid import install_abort_handler
        install_abort_handler()
        if MPI.COMM_WORLD.rank == 1:
            raise RuntimeError("rank 1 broke")
        MPI.COMM_WORLD.Barrier()   # the others would wait here for ever without the abort
    """)
    t0 = time.monotonic()
    out = mpiexec(3, sys.executable, "-c", script, timeout=60)
    assert out.returncode != 0
    assert "RuntimeError: rank 1 broke" in out.stderr
    assert time.monotonic() - t0 < 60


def test_failing_mpi_test_aborts_the_pytest_job(tmp_path):
    # A test that fails on rank 1 only, followed by a collective: the job must end, not hang.
    probe = tmp_path / "test_probe.py"
    probe.write_text(textwrap.dedent("""
        from mpi4py import MPI
        def test_fails_on_rank_1():
            assert MPI.COMM_WORLD.rank != 1, "deliberate failure on rank 1"
        def test_collective_after():
            MPI.COMM_WORLD.Barrier()
    """))
    (tmp_path / "conftest.py").write_text((ROOT / "tests/mpi/conftest.py").read_text())
    out = mpiexec(2, sys.executable, str(ROOT / "tests/mpi_pytest.py"), str(probe), "-q", "--rootdir", str(tmp_path),
                  timeout=120)
    assert out.returncode != 0
    assert "[rank 1] FAILED" in out.stderr and "deliberate failure on rank 1" in out.stderr


@pytest.mark.parametrize("n", [2])
def test_empty_mpi_test_run_is_not_a_failure(tmp_path, n):
    (tmp_path / "test_nothing.py").write_text("")
    out = mpiexec(n, sys.executable, str(ROOT / "tests/mpi_pytest.py"), str(tmp_path), "-q", "--rootdir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no tests ran" in out.stdout


def test_rank_dependent_grid_arguments_on_3_ranks_fail_fast_not_hang(tmp_path):
    """Issue 12: combos that differ by rank hung > 60 s on 3 ranks (a Split some rank never
    called). Now every rank raises the same one-line GridError from the first collective --
    also when one rank's own arguments are broken (it reaches the allgather with its error)."""
    code = textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from hpcml.errors import GridError
        from hpcml.grid import ProcessGrid
        r = MPI.COMM_WORLD.rank
        with open(f"{sys.argv[1]}/{r}.txt", "w") as out:  # a file per rank: mpiexec may interleave stdout
            for kw in (dict(combos=[("dp", "cp")] + ([("tp", "dp")] if r == 1 else [])),
                       dict(layout="tp=3" if r == 2 else None)):
                try:
                    ProcessGrid(**kw)
                except GridError as e:
                    out.write(f"{e}\\n")
        sys.exit(2)
    """)
    t0 = time.monotonic()
    out = mpiexec(3, sys.executable, "-c", code, str(tmp_path), timeout=60)
    assert time.monotonic() - t0 < 10 and out.returncode == 2, out.stderr  # every rank went on to exit(2)
    combos = ("ProcessGrid arguments differ across ranks: rank(s) 0, 2 gave pp(1) x dp(3) x cp(1) x tp(1), combos "
              "[['dp', 'cp']]; rank(s) 1 gave pp(1) x dp(3) x cp(1) x tp(1), combos [['dp', 'cp'], ['dp', 'tp']]; "
              "every rank must pass the same degrees and combos")
    layout = ("ProcessGrid arguments on rank 2: layout 'tp=3': expected a Layout (hpcml.grid.Layout) or degrees such "
              "as tp=2")
    got = {f.name: f.read_text() for f in tmp_path.iterdir()}
    assert got == {f"{r}.txt": f"{combos}\n{layout}\n" for r in range(3)}
