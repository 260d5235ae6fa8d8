"""hpcml.waiting on one rank (the waits themselves: tests/mpi/test_grid.py): what it returns,
and a wrong operation refused in one line before any collective."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpcml import waiting
from hpcml.errors import ConfigError


def test_one_rank_returns_at_once_with_its_own_values():
    comm = MPI.COMM_SELF
    waiting.barrier(comm)
    waiting.wait_all([])
    waiting.wait_all([comm.Ibarrier()])
    assert waiting.allreduce(comm, 7) == 7 and isinstance(waiting.allreduce(comm, 7, "sum"), int)
    assert waiting.allreduce(comm, np.array([3, -2]), "min").tolist() == [3, -2]


def test_an_unknown_operation_is_one_line():
    with pytest.raises(ConfigError, match=r"^waiting.allreduce: op='avg', expected one of max, min, sum$"):
        waiting.allreduce(MPI.COMM_SELF, 1, "avg")
