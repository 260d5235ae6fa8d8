"""What the compile flags of the source-built bindings cost at run time (`make setup`, issue 44).

mpi4py and h5py are Cython wrappers around the system's MPI and HDF5; `scripts/setup.sh`
compiles them at low optimisation to keep the cold set-up short. This times the calls whose
cost is the wrapper's own -- small collectives and point-to-point at 2 ranks (best of 3 x 20,000
calls), small HDF5 reads (20 files x 10 datasets, best of 5) -- and a 128 MiB write and read,
whose cost is the library's and the memory's (the limit). Compare two builds by putting one's
unpacked wheels first on PYTHONPATH (docs/benchmarks.md, "Set-up").

    mpiexec -n 2 python benchmarks/binding_calls.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import h5py
import mpi4py
import numpy as np
from mpi4py import MPI


def mpi_calls(comm: MPI.Comm, n: int) -> dict[str, float]:
    """Microseconds a call, best of 3 rounds of ``n`` (both ranks in step)."""
    a, b = np.ones(8), np.empty(8)
    sbuf, rbuf, small = bytearray(100), bytearray(100), {"a": 1, "b": [1, 2, 3]}
    peer = (comm.rank + 1) % comm.size
    calls = {"allreduce(1)": lambda: comm.allreduce(1), "Allreduce 8 doubles": lambda: comm.Allreduce(a, b),
             "bcast small dict": lambda: comm.bcast(small),
             "Sendrecv 100 B": lambda: comm.Sendrecv(sbuf, peer, recvbuf=rbuf, source=(comm.rank - 1) % comm.size),
             "Barrier": comm.Barrier}
    out = {}
    for name, call in calls.items():
        best = float("inf")
        for _ in range(3):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(n):
                call()
            best = min(best, time.perf_counter() - t)
        out[name] = round(best / n * 1e6, 3)
    return out


def h5_calls(where: str) -> dict[str, float]:
    """Small reads (the wrapper's cost) and a 128 MiB write + read (the library's and memory's)."""
    for i in range(20):
        with h5py.File(f"{where}/f{i}.h5", "w") as f:
            for j in range(10):
                f.create_dataset(f"d{j}", data=np.arange(64.0)).attrs["a"] = j

    def small() -> float:
        t = time.perf_counter()
        for i in range(20):
            with h5py.File(f"{where}/f{i}.h5", "r") as f:
                for j in range(10):
                    d = f[f"d{j}"]
                    d[...], d.attrs["a"], d[3:9]
        return time.perf_counter() - t

    big = np.random.default_rng(0).random(16 * 1024 * 1024)

    def large() -> float:
        t = time.perf_counter()
        with h5py.File(f"{where}/big.h5", "w") as f:
            f.create_dataset("x", data=big)
        with h5py.File(f"{where}/big.h5", "r") as f:
            back = f["x"][...]
        assert np.array_equal(back, big)
        return time.perf_counter() - t

    dst = np.ones_like(big)  # touched: the copy's time, not page faults

    def copy() -> float:
        t = time.perf_counter()
        np.copyto(dst, big)
        return time.perf_counter() - t

    return {"small_reads_ms": round(min(small() for _ in range(5)) * 1e3, 2),
            "write_read_128mib_s": round(min(large() for _ in range(3)), 4),
            "memcpy_128mib_s": round(min(copy() for _ in range(3)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000, help="calls a round (default 20,000)")
    ap.add_argument("--json", action="store_true", help="one JSON line")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        raise SystemExit("binding_calls.py: run on 2 ranks: mpiexec -n 2 python benchmarks/binding_calls.py")
    result = {"mpi4py": os.path.dirname(mpi4py.__file__), "h5py": os.path.dirname(h5py.__file__),
              "ranks": comm.size, "mpi_us": mpi_calls(comm, args.calls)}
    if comm.rank == 0:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as where:
            result["h5py_io"] = h5_calls(where)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
