"""MPI test plumbing: world fixtures, and abort-the-job on a failure on any rank."""

from __future__ import annotations

import sys
import time

import pytest
from mpi4py import MPI


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        comm = MPI.COMM_WORLD
        sys.stderr.write(f"\n[rank {comm.rank}] FAILED {item.nodeid} ({report.when})\n{report.longreprtext}\n"
                         f"[rank {comm.rank}] aborting the MPI job so no rank hangs\n")
        sys.stderr.flush()
        time.sleep(0.5)  # let mpiexec forward the report before Abort tears the job down
        comm.Abort(1)


@pytest.fixture(scope="session")
def comm() -> MPI.Comm:
    return MPI.COMM_WORLD



@pytest.fixture(scope="session", autouse=True)
def torch_bootstrap():
    """torch.distributed, bootstrapped from MPI once per launch before any test (tests reuse it;
    none destroys it: torch's DTensor caches outlive a destroyed process group)."""
    from hpcml.grid import ProcessGrid

    grid = ProcessGrid()
    return grid.init_torch()
