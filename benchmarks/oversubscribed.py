"""Ranks that outnumber their cores: an MPI collective's time, unbound against pinned.

    python benchmarks/oversubscribed.py --json

4 ranks on this 2-core host (``mpiexec -n 4``, nothing bound), each with ``--groups`` gloo
process groups as a training process gathers them (DeviceMeshes, sub-groups), then
``--splits`` ``MPI_Comm_split`` calls timed on rank 0:

- limit: the same splits bound at launch before any gloo group exists (nothing waking);
- unbound_fresh: unbound before any gloo group, for reference;
- peer: unbound, as MPICH and torch leave the ranks (``HPCML_CPU_BIND=none``);
- hpcml: :class:`hpcml.grid.ProcessGrid` pins each rank to one CPU, round-robin
  (:mod:`hpcml.grid.cpus`, the default);
- launcher: ``mpiexec -bind-to core``, binding at launch, for reference.

Ratios are total split time over the limit's (1.0 is no loss). Medians hide the effect: the
loss is in the tail, one rank starved of its CPU for seconds while its neighbour spins.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRESH = {"launcher": "limit", "peer": "unbound_fresh"}

WORKER = """
import json, os, sys, time
import numpy as np
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from hpcml.grid import ProcessGrid
grid = ProcessGrid(); grid.init_torch(); comm = grid.comm

def splits(n):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); comm.Split(color=comm.rank % 2, key=comm.rank).Free()
        ts.append(time.perf_counter() - t)
    return ts

fresh = splits({splits})
for _ in range({groups}):
    pg = dist.new_group(list(range(comm.size))); x = torch.ones(4); dist.all_reduce(x, group=pg)
comm.Barrier()
after = splits({splits})
if comm.rank == 0:
    print("RESULT " + json.dumps({{"fresh": fresh, "after": after, "cpus": sorted(os.sched_getaffinity(0)),
                                  "threads": len(os.listdir("/proc/self/task"))}}), flush=True)
"""


def run(mode: str, args) -> dict:
    env = dict(os.environ, HPCML_CPU_BIND="none" if mode == "peer" else "auto")
    launch = ["mpiexec", "-n", str(args.ranks)] + (["-bind-to", "core"] if mode == "launcher" else [])
    code = WORKER.format(root=str(ROOT), splits=args.splits, groups=args.groups)
    out = subprocess.run(launch + [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=args.timeout)
    if out.returncode != 0:
        raise SystemExit(f"oversubscribed: the {mode} run exited with {out.returncode}: {out.stderr.strip()[-400:]}")
    return json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).split(" ", 1)[1])


def stats(ts: list[float]) -> dict:
    s = sorted(ts)
    return {"median_ms": round(s[len(s) // 2] * 1e3, 2), "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 2),
            "max_ms": round(s[-1] * 1e3, 1), "total_s": round(sum(s), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--groups", type=int, default=40, help="gloo process groups each rank holds")
    p.add_argument("--splits", type=int, default=40, help="MPI_Comm_split calls timed")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    runs: dict[str, list[float]] = {"limit": [], "unbound_fresh": [], "peer": [], "hpcml": [], "launcher": []}
    cpus: dict[str, list[int]] = {}
    for _ in range(args.repeat):
        for mode in ("peer", "hpcml", "launcher"):
            r = run(mode, args)
            runs[mode] += r["after"]
            cpus[mode] = r["cpus"]
            if mode in FRESH:  # the splits before any gloo group: the limit (bound) and unbound
                runs[FRESH[mode]] += r["fresh"]
    out = {"bench": "oversubscribed", "ranks": args.ranks, "cores": os.cpu_count(), "groups": args.groups,
           "splits": args.splits * args.repeat, "rank0_cpus": cpus, **{k: stats(v) for k, v in runs.items()}}
    limit = out["limit"]["total_s"]
    out["ratios_to_limit"] = {k: round(out[k]["total_s"] / limit, 2)
                              for k in ("unbound_fresh", "peer", "hpcml", "launcher")}
    out["peer_over_hpcml"] = round(out["peer"]["total_s"] / out["hpcml"]["total_s"], 2)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
