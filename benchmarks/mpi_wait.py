"""What a wait for another rank costs: MPICH's blocking calls against hpcml.waiting, in one run.

    mpiexec -n 2 python benchmarks/mpi_wait.py --json

Three figures, each for ``comm.Barrier()`` (MPICH busy-polls) and ``hpcml.waiting.barrier``:

- the CPU a rank spends waiting ``--late`` seconds for the last rank (the spin);
- the time of a barrier no rank is late for (the latency the naps may add), best of
  ``--repeat`` rounds of ``--rounds`` barriers;
- a heat kernel's halo exchange, ``MPI.Request.Waitall`` against ``waiting.wait_all``: the
  time per step of ``--steps`` steps (the kernels' own exchange, 64 x 64 cells).

The last line (rank 0) is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcml import waiting  # noqa: E402


def late_wait(comm, late_s: float, polite: bool) -> float:
    """CPU seconds this rank spends in the barrier while the last rank sleeps ``late_s``."""
    waiting.barrier(comm)
    if comm.rank == comm.size - 1:
        time.sleep(late_s)
    cpu = time.process_time()
    waiting.barrier(comm) if polite else comm.Barrier()
    return time.process_time() - cpu


def barrier_us(comm, rounds: int, repeat: int, polite: bool) -> float:
    best = float("inf")
    for _ in range(repeat):
        waiting.barrier(comm)
        t0 = time.perf_counter()
        for _ in range(rounds):
            waiting.barrier(comm) if polite else comm.Barrier()
        best = min(best, (time.perf_counter() - t0) / rounds)
    return float(comm.allreduce(best, op=MPI.MAX)) * 1e6


def halo_us(comm, steps: int, polite: bool) -> float:
    from kernels import grid as kgrid

    decomp = kgrid.decompose(comm, 64, 64, periodic=False)
    halo = kgrid.Halo(decomp, 1)
    state = kgrid.new_state(decomp, 1)
    if not polite:
        kgrid.wait_all = MPI.Request.Waitall
    try:
        waiting.barrier(comm)
        t0 = time.perf_counter()
        for _ in range(steps):
            halo.exchange(state)
        dt = (time.perf_counter() - t0) / steps
    finally:
        kgrid.wait_all = waiting.wait_all
        halo.free()
    return float(comm.allreduce(dt, op=MPI.MAX)) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--late", type=float, default=2.0, help="seconds the last rank is late")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        sys.exit("mpi_wait: run it on 2 or more ranks (mpiexec -n 2 python benchmarks/mpi_wait.py)")
    # the CPU of the ranks that waited (not the late one's)
    waited = comm.rank < comm.size - 1
    spin, nap = (comm.allreduce(late_wait(comm, args.late, polite) * waited, op=MPI.MAX) for polite in (False, True))
    b_mpi, b_nap = (barrier_us(comm, args.rounds, args.repeat, polite) for polite in (False, True))
    h_mpi, h_nap = (halo_us(comm, args.steps, polite) for polite in (False, True))
    out = {"benchmark": "mpi_wait", "ranks": comm.size, "late_s": args.late,
           "wait_cpu_s_mpi": spin, "wait_cpu_s_hpcml": nap, "wait_cpu_ratio": nap / spin if spin else None,
           "barrier_us_mpi": b_mpi, "barrier_us_hpcml": b_nap, "barrier_ratio": b_nap / b_mpi,
           "halo_us_mpi": h_mpi, "halo_us_hpcml": h_nap, "halo_ratio": h_nap / h_mpi}
    if comm.rank == 0:
        print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()), flush=True)


if __name__ == "__main__":
    main()
