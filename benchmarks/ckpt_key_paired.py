"""What a checkpoint key costs, paired: the same state saved and loaded with and without a
key, alternated, each pair into swapped directories, so that neither side always gets the
same place on the disk (ckpt_vs_dcp.py saves each kind into a directory of its own, and on a
virtual disk the placement alone moved a save by up to 50%).

    mpiexec -n 2 python benchmarks/ckpt_key_paired.py [--gib 2] [--saves 4] [--loads 12] [--json]

Saves are cold (page cache dropped before each, as root); loads are warm (the page cache
holds the checkpoints of the first two pairs, each kind once in either directory: what is
left is CPU work, where the key's HMAC would show). Reports
medians and the paired ratios keyed / unkeyed.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_disk import drop_caches, paired, spread  # noqa: E402

from hpcml import ckpt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="state size over all ranks")
    p.add_argument("--saves", type=int, default=4, help="paired cold saves")
    p.add_argument("--loads", type=int, default=12, help="paired warm loads")
    p.add_argument("--dir", default=None, help="where to write (default: the temp directory)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    key = comm.bcast(secrets.token_hex(32).encode() if rank == 0 else None)
    torch.manual_seed(rank)
    cols, n = 4096, 24
    rows = max(1, int(args.gib * 2**30 / world / n / cols / 4))
    state = {f"model/r{rank}/w{i}": torch.randn(rows, cols) for i in range(n)}
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-key-", dir=args.dir) if rank == 0 else None))
    t_s = {"plain": [], "key": []}
    try:
        for i in range(args.saves):
            d = base / f"s{i}"
            dirs = ("a", "b") if i % 2 == 0 else ("b", "a")
            ops = [("plain", d / dirs[0], False), ("key", d / dirs[1], key)]
            if (i // 2) % 2:
                ops.reverse()  # which kind goes first alternates too
            for kind, root, k in ops:
                if rank == 0:
                    drop_caches()
                comm.Barrier()
                t = time.perf_counter()
                ckpt.save(root, 1, state, comm=comm, key=k)
                t_s[kind].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        # the two pairs of the first two saves: each kind once in "a", once in "b"
        pairs = [{"plain": (base / "s0" / "a", False), "key": (base / "s0" / "b", key)}]
        if args.saves > 1:
            pairs.append({"plain": (base / "s1" / "b", False), "key": (base / "s1" / "a", key)})
        for src in pairs:
            for kind in ("plain", "key", "plain", "key"):  # warm all into the page cache
                ckpt.load(src[kind][0], dst, comm=comm, key=src[kind][1])
        t_l = {"plain": [], "key": []}
        for i in range(args.loads):
            src = pairs[(i // 2) % len(pairs)]
            for kind in (("plain", "key") if i % 2 == 0 else ("key", "plain")):
                comm.Barrier()
                t = time.perf_counter()
                ckpt.load(src[kind][0], dst, comm=comm, key=src[kind][1])
                t_l[kind].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        ok = all(torch.equal(dst[k], state[k]) for k in state)
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if rank:
        return
    out = {"benchmark": "ckpt_key_paired", "ranks": world, "state_bytes": sum(v.nbytes for v in state.values()) * world,
           "values_equal": ok,
           "save_s": {k: spread(v) for k, v in t_s.items()}, "warm_load_s": {k: spread(v) for k, v in t_l.items()},
           "key_save_ratio": spread(paired(t_s["key"], t_s["plain"])),
           "key_warm_load_ratio": spread(paired(t_l["key"], t_l["plain"]))}
    if args.json:
        print(json.dumps(out))
    else:
        for name in ("key_save_ratio", "key_warm_load_ratio"):
            s = out[name]
            print(f"{name}: median {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}] (n={s['n']})")
    if not ok:
        print("ckpt_key_paired: loaded values differ from the saved ones", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
