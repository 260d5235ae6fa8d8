"""Check that the environment `make setup` built really works, and print the versions.

Fails (exit 1, one line per problem) unless h5py has MPI, torch has gloo, and
``mpiexec -n 4`` runs Python ranks that allreduce.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

ALLREDUCE = ("from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.rank); "
             "assert s == c.size * (c.size - 1) // 2, s; c.rank or print(f'allreduce over {c.size} ranks: {s}')")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mpiexec", default="mpiexec")
    parser.add_argument("-n", type=int, default=4)
    args = parser.parse_args()
    problems = []

    import h5py
    import mpi4py
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    if not h5py.get_config().mpi:
        problems.append("h5py was built without MPI support: rebuild with HDF5_MPI=ON against parallel HDF5")
    if not dist.is_gloo_available():
        problems.append(f"torch {torch.__version__} has no gloo backend")
    cmd = shlex.split(args.mpiexec) + ["-n", str(args.n), sys.executable, "-c", ALLREDUCE]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        problems.append(f"{' '.join(cmd[:3])} ... failed ({run.returncode}): {run.stderr.strip()[-300:]}")

    print(f"python {sys.version.split()[0]} | torch {torch.__version__} (gloo {dist.is_gloo_available()}) | "
          f"mpi4py {mpi4py.__version__} on {MPI.Get_library_version().splitlines()[0].strip()} | "
          f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, parallel {h5py.get_config().mpi}")
    print(run.stdout.strip())
    for p in problems:
        print(f"verify: error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
