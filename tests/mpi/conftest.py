"""MPI test plumbing: world fixtures, and abort-the-job on a failure on any rank."""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
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


@pytest.fixture(autouse=True)
def together():
    """Every rank starts a test when all have finished the last one, waiting without spinning
    (MPICH busy-polls in a blocking collective: on 2 cores a rank that waits for another in a
    test's first collective takes its time slice)."""
    from hpcml import waiting

    waiting.barrier(MPI.COMM_WORLD)
    yield


@pytest.fixture(autouse=True)
def stacks_before_timeout(request):
    """A hung test prints every rank's Python stacks (stderr, headed by its rank) shortly
    before pytest-timeout ends the job: pytest-timeout's own dump goes to stdout, which only
    rank 0 keeps."""
    timeout = float(request.config.getini("timeout") or 0)
    if timeout <= 10:
        yield
        return

    def dump():
        time.sleep(0.5 * MPI.COMM_WORLD.rank)  # one rank's stacks after another, not interleaved
        err = os.fdopen(int(os.environ.get("HPCML_TEST_STDERR_FD", 2)), "w", closefd=False)
        err.write(f"\n[rank {MPI.COMM_WORLD.rank}] Timeout (> {timeout - 5:.0f} s) in {request.node.nodeid}\n")
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)

    timer = threading.Timer(timeout - 5, dump)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


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


@pytest.fixture(scope="module")
def fp64_default():
    """A module's tests in float64 (torch's default dtype), DTensor's redistribution notes quiet:
    the equality-to-one-process tests that hold parallel layouts to 1e-10."""
    import logging

    import torch

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


#: What MPI tests name the directories rank 0 makes with ``tempfile.mkdtemp`` and shares.
_SHARED_TMP = ("hpcml-ckpt-", "hpcml-fpdt-", "hpcml-hsdp-", "hpcml-moe-", "hpcml-pop-", "hpcml-pbt-",
               "hpcml-data-", "hpcml-llmpop-", "hpcml-llmmix-")


@pytest.fixture(autouse=True, scope="session")
def shared_tmp_removed():
    """The shared directories this session's tests made in the temporary directory are removed
    at its end, by rank 0 once every rank is done (those there before it are left alone)."""
    import shutil
    import tempfile

    from hpcml import waiting

    root = tempfile.gettempdir()

    def ours() -> set[str]:
        return {n for n in os.listdir(root) if n.startswith(_SHARED_TMP)} if MPI.COMM_WORLD.rank == 0 else set()

    before = ours()
    yield
    waiting.barrier(MPI.COMM_WORLD)
    for name in ours() - before:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
