"""A simulation beside a waiting trainer: how much of the cores the trainer's wait takes.

    python benchmarks/colocated_wait.py --json

An online trainer whose batch is ready waits for its slower data-parallel peers in the
per-step agreement (:mod:`hpcml.stream.loader`). When it shares cores with the simulations
that feed it (one node, a laptop, this 2-core host), how it waits decides how fast they run:

- limit: the simulation alone (``kernels.heat2d`` on 2 MPI ranks, its step time);
- peer: beside a 2-rank trainer waiting in MPICH's blocking ``MPI_Allreduce`` (it polls);
- hpcml: beside the same trainer waiting in :func:`hpcml.stream.loader.agree_min`
  (non-blocking all-reduce, napping between tests).

The trainer emulates a starved step: rank 0 has its batch and enters the agreement at once,
rank 1 waits ``--late`` seconds for data first (the loader's buffer poll), then joins.
Ratios are simulation step time over the alone figure (1.0 is no slowdown).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAINER = """
import sys, time
import numpy as np
from mpi4py import MPI
sys.path.insert(0, {root!r})
from hpcml.stream.loader import agree_min
comm, flags = MPI.COMM_WORLD, np.ones(4, np.int32)
while True:  # until terminated
    if comm.rank == 1:
        time.sleep({late!r})
    if sys.argv[1] == "blocking":
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MIN)
    else:
        agree_min(comm, flags)
"""


def sim_step_s(args) -> float:
    """One heat2d run on 2 ranks; its step time from the result line."""
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "kernels.heat2d", "--nx", str(args.nx),
                          "--ny", str(args.nx), "--steps", str(args.steps), "--every", str(args.steps)],
                         capture_output=True, text=True, cwd=ROOT, check=True, timeout=600)
    line = next(x for x in out.stdout.splitlines() if x.startswith("HPCML_SIM_RESULT "))
    return json.loads(line.split(" ", 1)[1])["step_s"]


def beside(mode: str, args) -> float:
    """The simulation's step time while a trainer waits in ``mode``."""
    code = TRAINER.format(root=str(ROOT), late=args.late)
    trainer = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, "-c", code, mode], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # mpiexec's notes on SIGTERM
    time.sleep(args.warmup)  # its ranks are up and waiting
    try:
        if trainer.poll() is not None:
            raise SystemExit(f"colocated_wait: the {mode} trainer exited with {trainer.returncode}")
        return sim_step_s(args)
    finally:
        trainer.terminate()
        trainer.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nx", type=int, default=64, help="simulation grid (nx x nx)")
    p.add_argument("--steps", type=int, default=20000, help="simulation time steps")
    p.add_argument("--late", type=float, default=0.05, help="seconds the starved trainer rank polls its buffer")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds for the trainer's ranks to start")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs: dict[str, list[float]] = {"alone": [], "blocking": [], "agree_min": []}
    for _ in range(args.repeat):
        runs["alone"].append(sim_step_s(args))
        for mode in ("blocking", "agree_min"):
            runs[mode].append(beside(mode, args))
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"bench": "colocated_wait", "nx": args.nx, "steps": args.steps, "late_s": args.late, "cores": os.cpu_count(),
           "sim_step_ms": {k: round(v * 1e3, 4) for k, v in med.items()},
           "runs_ms": {k: [round(x * 1e3, 4) for x in v] for k, v in runs.items()},
           "slowdown_blocking": round(med["blocking"] / med["alone"], 2),
           "slowdown_agree_min": round(med["agree_min"] / med["alone"], 2),
           "blocking_over_agree_min": round(med["blocking"] / med["agree_min"], 2)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
