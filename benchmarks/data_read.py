"""How fast a packed token file serves training sequences, against the disk and against memmap.

    python benchmarks/data_read.py --json                     # 1, 2 and 4 ranks, sequences of 4096
    python benchmarks/data_read.py --json --tokens 64 --ranks 1,2

A corpus of ``--tokens`` million random uint16 tokens (64 documents) is packed with
``hpcml data pack``'s function into one HDF5 token file. Under ``mpiexec -n R``, every rank
reads its dp share of ``--steps`` global batches of ``8 x R`` sequences of ``--seq-len``
tokens in the seeded order (``TokenDataset.rows``: ``pread``, each 64 Ki-token block's CRC
checked the first time it is read, ids checked against the vocabulary). Side by side, in
the same run and on the same bytes:

- the limit: ``O_DIRECT`` reads of the same windows in the same order, each its 4 KiB-aligned
  span, nothing checked (what the file system gives this access pattern without the page cache);
- the peer: ``numpy.memmap`` of a flat token file (nanoGPT's ``train.bin``) holding the
  same tokens, the same windows read in the same order.

The page cache is dropped before each (where the system allows: ``cache_dropped``).
Per rank count: ``tokens_per_s_per_rank`` (hpcml), ``limit_tokens_per_s_per_rank``,
``memmap_tokens_per_s_per_rank``, ``read_over_limit``, ``read_over_memmap``; the last line
is the largest rank count with the figures at every count.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _drop() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _rank_main(path: str, flat: str, seq: int, steps: int, kind: str) -> None:
    """One rank under mpiexec: read its share; print its tokens/s."""
    import torch  # noqa: F401 -- a trainer has it imported: not part of reading
    from mpi4py import MPI

    from hpcml.data import TokenDataset

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ds = TokenDataset(path, seq_len=seq, seed=0)
    n = 8 * size
    lo, hi = rank * 8, (rank + 1) * 8
    comm.Barrier()
    t0 = time.perf_counter()
    got = 0
    if kind == "hpcml":
        for step in range(steps):
            got += ds.rows(step, n, lo, hi).numel()
    elif kind == "memmap":
        arr = np.memmap(flat, dtype=np.uint16, mode="r")
        for step in range(steps):
            for _, w in ds.sample_ids(step, n, lo, hi):
                got += np.asarray(arr[w * seq:w * seq + seq + 1], np.int64).size
    else:  # O_DIRECT: the same windows' bytes in the same order, each read once, no page cache, no check
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, ((seq + 1) * 2 // 4096 + 2) * 4096)
        for step in range(steps):
            for _, w in ds.sample_ids(step, n, lo, hi):
                a = ds.m.tokens_offset + w * seq * 2
                b = a + (seq + 1) * 2
                a0 = a - a % 4096
                k = os.preadv(fd, [memoryview(buf)[:-(-(b - a0) // 4096) * 4096]], a0)
                got += min(k - (a - a0), b - a) // 2
        os.close(fd)
    dt = time.perf_counter() - t0
    rates = comm.gather(got / dt, root=0)
    if rank == 0:
        print(json.dumps({"per_rank": sum(rates) / len(rates)}))


def _run(ranks: int, args, path: Path, flat: Path, kind: str) -> float:
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.data_read import _rank_main; "
            f"_rank_main({str(path)!r}, {str(flat)!r}, {args.seq_len}, {args.steps}, {kind!r})")
    out = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=900)
    if out.returncode:
        sys.exit(f"data_read: {kind} at {ranks} ranks failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["per_rank"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="millions of tokens in the corpus")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64, help="global batches (8 sequences a rank each)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--dir", help="where the corpus goes (default: a temporary directory)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from mpi4py import MPI

    from hpcml.data import pack

    with tempfile.TemporaryDirectory(prefix="hpcml-data-read-", dir=args.dir) as d:
        d = Path(d)
        rng = np.random.default_rng(0)
        per = args.tokens * 1_000_000 // 64
        for k in range(64):
            np.save(d / f"doc_{k:02d}.npy", rng.integers(0, 50000, per, dtype=np.uint16))
        t0 = time.perf_counter()
        m = pack(d / "corpus.h5", sorted(d.glob("doc_*.npy")), vocab_size=50257, eod=50256, comm=MPI.COMM_SELF)
        pack_s = time.perf_counter() - t0
        flat = d / "train.bin"  # nanoGPT's layout: the same tokens, flat
        with open(d / "corpus.h5", "rb") as f, open(flat, "wb") as g:
            f.seek(m.tokens_offset)
            left = m.n_tokens * 2
            while left:
                chunk = f.read(min(left, 64 << 20))
                g.write(chunk)
                left -= len(chunk)
        for x in d.glob("doc_*.npy"):
            x.unlink()
        rows = []
        for r in [int(x) for x in args.ranks.split(",")]:
            fig = {}
            for kind in ("limit", "hpcml", "memmap"):
                dropped = _drop()
                fig[kind] = _run(r, args, d / "corpus.h5", flat, kind)
            row = {"ranks": r, "seq_len": args.seq_len, "tokens_m": args.tokens, "pack_s": round(pack_s, 2),
                   "tokens_per_s_per_rank": fig["hpcml"], "limit_tokens_per_s_per_rank": fig["limit"],
                   "memmap_tokens_per_s_per_rank": fig["memmap"], "read_over_limit": fig["hpcml"] / fig["limit"],
                   "read_over_memmap": fig["hpcml"] / fig["memmap"], "cache_dropped": dropped}
            rows.append(row)
            print(json.dumps(row) if args.json else json.dumps(row, indent=1), flush=True)
        last = dict(rows[-1])
        last["by_ranks"] = {str(r["ranks"]): {k: r[k] for k in ("read_over_limit", "read_over_memmap")} for r in rows}
        print(json.dumps(last))


if __name__ == "__main__":
    main()
