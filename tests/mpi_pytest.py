"""Run pytest on every rank of an MPI job: ``mpiexec -n 4 python tests/mpi_pytest.py tests/mpi``.

Rank 0 prints pytest's report; other ranks stay quiet unless a test fails there. A test
that fails on any rank aborts the whole job (tests/mpi/conftest.py), so no rank waits for
ever in a collective the failed rank will never join. Exit status 5 (no tests) is 0.
"""

from __future__ import annotations

import os
import sys

from mpi4py import MPI

import pytest

from hpcml import waiting

rank = MPI.COMM_WORLD.Get_rank()
# the real stderr, for reports that must get out while pytest captures fd 2 (conftest.py)
os.environ["HPCML_TEST_STDERR_FD"] = str(os.dup(2))
args = sys.argv[1:] + ["-p", "no:cacheprovider", "-o", "timeout_method=thread"]
if rank != 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
code = pytest.main(args)
code = 0 if code == pytest.ExitCode.NO_TESTS_COLLECTED else int(code)
# Every rank must agree: a rank that ended badly outside a test still fails the job.
code = waiting.allreduce(MPI.COMM_WORLD, code)  # without spinning: each rank ends its tests at its own pace
sys.exit(code)
