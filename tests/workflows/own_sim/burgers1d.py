"""A user's own MPI simulation: 1-D viscous Burgers, u_t + u u_x = nu u_xx, periodic on [0, 1).

Explicit finite differences (conservative central flux for u^2/2, the 3-point Laplacian,
forward Euler), the grid split into one contiguous block per rank with one ghost cell on each
side, filled by a periodic halo exchange. Start: u = amp sin(2 pi x). Parameters: nu, amp.

Online (``--stream``) every rank streams its block of each output with
``hpcml.stream.Producer.from_campaign``; offline (``--out PATH.h5``) the ranks write the HDF5 layout
``hpcml.stream.files.FileSource`` reads (/fields/u [n_out, nx], /step, /time, attributes
``sim_id`` and ``params``), collectively, to ``PATH.tmp`` renamed to ``PATH`` at the end.

    mpiexec -n 2 python burgers1d.py --sim-id 0 --params-json '{"nu": 0.02, "amp": 1.0}' --out b.h5
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcml.grid import install_abort_handler

NU_MAX = 0.05  # one dt for every simulation of the design: stable up to this viscosity

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--sim-id", type=int, required=True)  # the Campaign appends these two
p.add_argument("--params-json", required=True)
p.add_argument("--nx", type=int, default=64)
p.add_argument("--steps", type=int, default=400)
p.add_argument("--every", type=int, default=40, help="an output every K time steps (steps // K outputs)")
p.add_argument("--stream", action="store_true", help="stream every output to the training job")
p.add_argument("--out", help="write every output to this HDF5 file")
p.add_argument("--hold-file", help="reliability tests: on attempt 0, wait before output --hold-at until this "
                                   "file exists")
p.add_argument("--hold-at", type=int, default=0, help="the output (1, 2, ...) to wait before")
args = p.parse_args()
params = json.loads(args.params_json)  # {"nu": ..., "amp": ...}

comm = MPI.COMM_WORLD
install_abort_handler(comm)  # one failing rank ends the job instead of hanging the halo exchange
rank, size = comm.Get_rank(), comm.Get_size()
nx, nu, amp = args.nx, float(params["nu"]), float(params["amp"])
if not 0 < nu <= NU_MAX or nx < size or args.every < 1 or args.steps < args.every:
    if rank == 0:
        print(f"burgers1d: error: need 0 < nu <= {NU_MAX}, nx >= ranks, 1 <= every <= steps; got nu={nu}, "
              f"nx={nx}, every={args.every}, steps={args.steps}", file=sys.stderr)
    sys.exit(2)

i0 = rank * nx // size  # this rank owns cells i0 .. i0 + n - 1
n = (rank + 1) * nx // size - i0
dx = 1.0 / nx
dt = 0.2 * dx * dx / NU_MAX  # diffusion-limited; |u| <= amp <= 1 keeps the CFL number below 0.1
x = (i0 + np.arange(n)) * dx
u = np.zeros(n + 2)  # one ghost cell each side
u[1:-1] = amp * np.sin(2 * np.pi * x)
left, right = (rank - 1) % size, (rank + 1) % size
n_out = args.steps // args.every

producer = None
if args.stream:
    from hpcml.stream import Producer

    producer = Producer.from_campaign(comm=comm, params=params, global_shape=(nx,), offset=(i0,), local_shape=(n,),
                                 fields=("u",), sim_id=args.sim_id, copy=False)
h5 = None
if args.out:
    import h5py

    h5 = h5py.File(args.out + ".tmp", "w", driver="mpio", comm=comm)
    field = h5.create_dataset("fields/u", (n_out, nx), dtype="f4")
    step_ds = h5.create_dataset("step", (n_out,), dtype="i8")
    time_ds = h5.create_dataset("time", (n_out,), dtype="f8")
    h5.attrs["sim_id"] = args.sim_id
    h5.attrs["params"] = json.dumps(params, sort_keys=True)
    h5.attrs["nx"] = nx
    for k, v in params.items():
        h5.attrs[k] = float(v)

t0 = time.perf_counter()
for step in range(1, args.steps + 1):
    comm.Sendrecv(u[1:2], dest=left, sendtag=0, recvbuf=u[-1:], source=right, recvtag=0)  # halo exchange
    comm.Sendrecv(u[-2:-1], dest=right, sendtag=1, recvbuf=u[0:1], source=left, recvtag=1)
    f = 0.5 * u * u
    u[1:-1] += dt * (-(f[2:] - f[:-2]) / (2 * dx) + nu * (u[2:] - 2 * u[1:-1] + u[:-2]) / (dx * dx))
    if step % args.every:
        continue
    k = step // args.every  # this output's number, 1 .. n_out
    if k == args.hold_at and args.hold_file and os.environ.get("HPCML_ATTEMPT", "0") == "0":
        deadline = time.monotonic() + 120
        while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    block = u[1:-1].astype(np.float32)  # a fresh copy: safe with copy=False
    if producer is not None:
        producer.send(step, t=step * dt, fields={"u": block})
    if h5 is not None:
        with field.collective:
            field[k - 1, i0:i0 + n] = block
        if rank == 0:
            step_ds[k - 1], time_ds[k - 1] = step, step * dt
if producer is not None:
    producer.close()  # the end marker; waits until everything has left
if h5 is not None:
    h5.close()
    comm.Barrier()
    if rank == 0:
        os.replace(args.out + ".tmp", args.out)
mass = comm.allreduce(float(u[1:-1].sum()) * dx)  # conserved by the flux form: ~0
max_u = comm.allreduce(float(np.abs(u[1:-1]).max()), op=MPI.MAX)
if rank == 0:
    print("HPCML_SIM_RESULT " + json.dumps({
        "sim_id": args.sim_id, "samples_sent": n_out, "outputs": n_out, "steps": args.steps, "dt": dt, "nx": nx,
        "ranks": size, "mass": mass, "max_u": max_u, "wall_s": time.perf_counter() - t0,
        "blocked_s": producer.blocked_s if producer else 0.0, "out": args.out}), flush=True)
