"""What a checkpoint key costs, paired: the same state saved and loaded with and without a
key, alternated, each pair into swapped directories, so that neither side always gets the
same place on the disk (ckpt_vs_dcp.py saves each kind into a directory of its own, and on a
virtual disk the placement alone moved a save by up to 50%).

    mpiexec -n 2 python benchmarks/ckpt_key_paired.py [--gib 2] [--saves 4] [--loads 12] [--cold-loads 4] [--json]

Saves are cold (page cache dropped before each, as root); so are ``--cold-loads`` (a resume
after a job restart reads from the disk); warm loads have the page cache hold the
checkpoints of the first two pairs, each kind once in either directory: what is left is CPU
work, where the key's HMAC and chunk digests show most. Reports medians and
the paired ratios keyed / unkeyed, and -- as the paired ratios sit within the disk's spread --
the chunk digests' CPU timed alone on this rank's state (1 MiB chunks, as a save cuts them):
the GMAC a keyed save adds, and a keyed load's GMAC in place of the CRC-32, over the unkeyed
median save and load.
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
from hpcml.ckpt.chunkmac import ChunkMac  # noqa: E402
from hpcml.ckpt.shard import crc32  # noqa: E402


def digest_seconds(state: dict[str, torch.Tensor], repeat: int = 3) -> dict[str, float]:
    """Best-of-``repeat`` seconds over every 1 MiB chunk of ``state`` of what each side does per
    chunk: ``crc32`` (an unkeyed save or load), ``crc32+gmac`` (a keyed save: the tag taken
    right after the CRC, on the chunk in cache) and ``gmac`` (a keyed load: the tag in place
    of the CRC)."""
    chunks = [memoryview(v.numpy()).cast("B")[i:i + (1 << 20)] for v in state.values()
              for i in range(0, v.nbytes, 1 << 20)]
    mac = ChunkMac(bytes(32))
    out = {}
    for name, fn in (("crc32", lambda k, c: crc32(c)), ("crc32+gmac", lambda k, c: (crc32(c), mac.tag(k << 20, c))),
                     ("gmac", lambda k, c: mac.tag(k << 20, c))):
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            for k, c in enumerate(chunks):
                fn(k, c)
            best = min(best, time.perf_counter() - t)
        out[name] = best
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="state size over all ranks")
    p.add_argument("--saves", type=int, default=4, help="paired cold saves")
    p.add_argument("--loads", type=int, default=12, help="paired warm loads")
    p.add_argument("--cold-loads", type=int, default=4, help="paired cold loads (page cache dropped before each)")
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
        t_c = {"plain": [], "key": []}
        for i in range(args.cold_loads):
            src = pairs[i % len(pairs)]
            for kind in (("plain", "key") if (i // len(pairs)) % 2 == 0 else ("key", "plain")):
                if rank == 0:
                    drop_caches()
                comm.Barrier()
                t = time.perf_counter()
                ckpt.load(src[kind][0], dst, comm=comm, key=src[kind][1])
                t_c[kind].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        for src in pairs:  # warm again
            for kind in ("plain", "key"):
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
        comm.Barrier()
        digest = {k: comm.allreduce(v, op=MPI.MAX) for k, v in digest_seconds(state).items()}
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
           "key_warm_load_ratio": spread(paired(t_l["key"], t_l["plain"])),
           "cold_load_s": {k: spread(v) for k, v in t_c.items()} if args.cold_loads else None,
           "key_cold_load_ratio": spread(paired(t_c["key"], t_c["plain"])) if args.cold_loads else None,
           "digest_s_per_rank": digest,
           "digest_gb_per_s": {k: sum(v.nbytes for v in state.values()) / v / 1e9 for k, v in digest.items()}}
    med = {k: sorted(v)[len(v) // 2] for k, v in (("save", t_s["plain"]), ("load", t_l["plain"]),
                                                   ("cold", t_c["plain"])) if v}
    out["key_digest_share"] = {"save": max(0.0, digest["crc32+gmac"] - digest["crc32"]) / med["save"],
                               "warm_load": max(0.0, digest["gmac"] - digest["crc32"]) / med["load"]}
    if "cold" in med:
        out["key_digest_share"]["cold_load"] = max(0.0, digest["gmac"] - digest["crc32"]) / med["cold"]
    if args.json:
        print(json.dumps(out))
    else:
        for name in ("key_save_ratio", "key_cold_load_ratio", "key_warm_load_ratio"):
            s = out[name]
            if s is None:
                continue
            print(f"{name}: median {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}] (n={s['n']})")
        print("chunk digests per rank: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in out["digest_gb_per_s"].items())
              + "; the key's digest work / unkeyed: "
              + ", ".join(f"{k} {v:.2%}" for k, v in out["key_digest_share"].items()))
    if not ok:
        print("ckpt_key_paired: loaded values differ from the saved ones", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
