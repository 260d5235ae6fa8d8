"""Waiting for other ranks without spinning a core.

MPICH busy-polls inside a blocking call: a rank that waits for another burns its core
(measured here: 3.9 s of CPU in a 4 s ``Barrier``). On a node with a core per rank that is
the quickest wait; where ranks share cores -- a trainer beside the simulations that feed it,
one node of an ensemble, a laptop, 4 ranks on 2 cores -- the waiting rank takes the time
slice of the rank it waits for, and a simulation blocked on the trainer's backpressure
slows the trainer it waits for. These helpers test the requests in a loop for ``spin_s``
(a halo exchange or a small all-reduce on a quiet node completes within it), then sleep
between tests, the naps doubling up to ``nap_max_s`` (a long wait costs at most that much
latency at its end).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from hpcml.errors import ConfigError

#: Seconds of testing before the first nap.
SPIN_S = 1e-4
#: The first nap and the longest.
NAP_MIN_S, NAP_MAX_S = 5e-5, 1e-3


def wait_all(requests: Sequence, *, spin_s: float = SPIN_S, nap_max_s: float = NAP_MAX_S) -> None:
    """``MPI.Request.Waitall(requests)``, sleeping between tests once ``spin_s`` has passed."""
    from mpi4py import MPI

    requests = list(requests)
    if MPI.Request.Testall(requests):
        return
    t0, nap = time.perf_counter(), NAP_MIN_S
    while not MPI.Request.Testall(requests):
        if time.perf_counter() - t0 > spin_s:
            time.sleep(nap)
            nap = min(2 * nap, nap_max_s)


def barrier(comm) -> None:
    """``comm.Barrier()`` without spinning (for a wait that may be long: a peer writing or streaming)."""
    if comm.Get_size() > 1:
        wait_all([comm.Ibarrier()])


def allreduce(comm, values, op: str = "max"):
    """The ``op`` ("max", "min" or "sum") of an int64 array (or one int) over ``comm``,
    without spinning; the same type back."""
    import numpy as np
    from mpi4py import MPI

    ops = {"max": MPI.MAX, "min": MPI.MIN, "sum": MPI.SUM}
    if op not in ops:  # on every rank, before the collective
        raise ConfigError(f"waiting.allreduce: op={op!r}, expected one of {', '.join(ops)}")
    scalar = np.ndim(values) == 0
    buf = np.array(values, np.int64, ndmin=1)
    if comm.Get_size() > 1:
        wait_all([comm.Iallreduce(MPI.IN_PLACE, buf, op=ops[op])])
    return int(buf[0]) if scalar else buf


def allgather(comm, obj):
    """``comm.allgather(obj)``, entered once every rank is there (:func:`barrier`): the object
    collectives have no non-blocking form, so the wait happens in the barrier."""
    barrier(comm)
    return comm.allgather(obj)


def gather(comm, obj, root: int = 0):
    """``comm.gather(obj, root)``, entered once every rank is there."""
    barrier(comm)
    return comm.gather(obj, root=root)


def bcast(comm, obj, root: int = 0):
    """``comm.bcast(obj, root)``, entered once every rank is there (the root may have worked longer)."""
    barrier(comm)
    return comm.bcast(obj, root=root)
