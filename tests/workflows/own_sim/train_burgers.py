"""Trains a Burgers surrogate, (nu, amp, t) -> u[nx], on what burgers1d.py streams (online) or
wrote (offline): a user's model and ``hpcml.train.train_surrogate``, which reads everything
else from the campaign's contract. The rest is reliability tests (first launch only)."""

if __name__ == "__main__":  # first: a walltime warning (SIGUSR1/SIGTERM) from now on is a stop request
    from hpcml import stop

    stop.install()

import argparse
import math
import os
import signal
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

from hpcml.contract import Contract
from hpcml.stream import BufferConfig
from hpcml.train import FieldScales, FieldTrainConfig, PopulationConfig, TournamentConfig, train_surrogate
from hpcml.train.online import OnlineConfig

PARAMS = ("nu", "amp")  # the order of each sample's parameter vector
BOUNDS = {"nu": (0.01, 0.05), "amp": (0.5, 1.0)}


class BurgersMLP(nn.Module):
    """(params [B, 2], t [B]) -> u [B, nx]: an MLP on (params, t, sin/cos of t)."""

    def __init__(self, nx: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(len(PARAMS) + 3, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, nx))

    def forward(self, params: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1, 1)
        return self.net(torch.cat([params, t, torch.sin(math.pi * t), torch.cos(math.pi * t)], dim=1))


p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--mode", choices=("online", "offline"), default="online")
p.add_argument("--data", help="offline: the directory of the simulations' sim_*.h5 files")
p.add_argument("--nx", type=int, default=64)
p.add_argument("--t-max", type=float, required=True, help="the last output's time (input scaling)")
p.add_argument("--steps", type=int, default=None)
p.add_argument("--batch", type=int, default=None, help="default: the campaign's, else 4")
p.add_argument("--buffer", choices=("reservoir", "fifo", "firo"), default="reservoir")
p.add_argument("--capacity", type=int, default=64)
p.add_argument("--watermark", type=int, default=4)
p.add_argument("--ckpt-every", type=int, default=25)
p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
p.add_argument("--stop-at", type=int, default=0, help="rank 0 sends itself SIGUSR1 after this step")
p.add_argument("--crash-at", type=int, default=0, help="rank 0 SIGKILLs the job after this step (first launch)")
p.add_argument("--hold-at", type=int, default=0, help="the output the simulations hold before (burgers1d.py)")
p.add_argument("--release", help="the file the simulations wait for at --hold-at; a resumed launch writes it")
p.add_argument("--pop", type=int, default=1, help="members of a population in this job (tournaments)")
p.add_argument("--every", type=int, default=5, help="--pop: steps between tournaments")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--val", help="held-out simulations: the directory of their sim_*.h5 files")
p.add_argument("--crash-after-hold", action="store_true", help="once every sample sent before the hold is in a "
                                                               "checkpoint, SIGKILL the job (first launch)")
args = p.parse_args()
contract = Contract.from_env()
comm, armed = MPI.COMM_WORLD, []


def reliability(m: dict) -> None:  # on every rank after each step (and its checkpoint)
    rank = comm.rank
    if contract.resume:
        if args.release and rank == 0 and not Path(args.release).exists():
            Path(args.release).write_text(str(m["step"]))  # the relaunch is up: release the sims
        return
    if args.stop_at and m["step"] == args.stop_at and rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)  # as the scheduler's warning would: save and stop
    if args.crash_at and m["step"] == args.crash_at and rank == 0:
        print(f"[train] reliability test: killing the training job after step {m['step']}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.hold_at:
        if not armed and comm.allreduce(m["ingested"]) == contract.n_sims * (args.hold_at - 1):
            armed.append(m["step"])  # nothing more can come: the next checkpoint holds every sample so far
            if rank == 0:
                print(f"[train] every sample sent before the hold is in at step {m['step']}", flush=True)
        elif len(armed) == 1 and m["step"] % args.ckpt_every == 0:
            armed.append(m["step"])
            if rank == 0:
                print(f"[train] every sample sent before the hold is checkpointed at step {m['step']}", flush=True)
                if args.crash_after_hold:
                    print(f"[train] reliability test: killing the training job after the checkpoint at step "
                          f"{m['step']}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)


sys.exit(train_surrogate(
    BurgersMLP(args.nx), params=PARAMS, fields=("u",), steps=args.steps, batch=args.batch,
    scales=FieldScales(param_lo=tuple(BOUNDS[n][0] for n in PARAMS), param_hi=tuple(BOUNDS[n][1] for n in PARAMS),
                       t_max=args.t_max),
    config=FieldTrainConfig(lr=args.lr, log_every=50, seed=0, batch=4), on_step=reliability, torch_threads=1,
    buffer=BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark),
    online=OnlineConfig.from_campaign(contract, ckpt_every=args.ckpt_every, keep=args.keep),
    files=sorted(Path(args.data).glob("sim_*.h5")) if args.mode == "offline" else None, server={"end_grace_s": 10.0},
    val_files=sorted(Path(args.val).glob("sim_*.h5")) if args.val else (),
    population=PopulationConfig(members=args.pop, tournament=TournamentConfig(every=args.every)) if args.pop > 1
    else None))
