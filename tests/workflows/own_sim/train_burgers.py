"""Trains a Burgers surrogate, (nu, amp, t) -> u[nx], on what burgers1d.py streams (online) or
wrote (offline); the Campaign launches it under MPI, one data-parallel rank per process.

The Campaign gives it HPCML_RUN_DIR, HPCML_CAMPAIGN_ID, HPCML_RESUME (1: continue from the
checkpoint), HPCML_SIMS_DONE_FILE and HPCML_N_SIMS. Exit 0: trained, every expected sample
ingested; 75 (hpcml.env.NOT_FINISHED): saved on a stop request, run it again to resume;
anything else: failed (the reasons on stderr).
"""

if __name__ == "__main__":  # first: a walltime warning (SIGUSR1/SIGTERM) from now on is a stop request
    from hpcml import stop

    stop.install()

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from hpcml.env import NOT_FINISHED
from hpcml.grid import ProcessGrid, install_abort_handler
from hpcml.stream import Buffer, BufferConfig, read_endpoints, read_secret
from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer
from hpcml.train.online import OnlineConfig, train_online

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


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("online", "offline"), default="online")
    p.add_argument("--data", help="offline: the directory of the simulations' sim_*.h5 files")
    p.add_argument("--nx", type=int, default=64)
    p.add_argument("--t-max", type=float, required=True, help="the last output's time (input scaling)")
    p.add_argument("--outputs", type=int, required=True, help="outputs per simulation (what must arrive)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--buffer", choices=("reservoir", "fifo", "firo"), default="reservoir")
    p.add_argument("--capacity", type=int, default=64)
    p.add_argument("--watermark", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--host", default="127.0.0.1")
    # reliability tests (first launch only, never on a resume)
    p.add_argument("--stop-at", type=int, default=0, help="rank 0 sends itself SIGUSR1 (the walltime warning) after "
                                                          "this step")
    p.add_argument("--crash-after-hold", help="online: once every sample the simulations send before they hold is "
                                              "in, SIGKILL the job right after its next checkpoint; the relaunch "
                                              "creates this file, which releases the simulations")
    p.add_argument("--hold-at", type=int, default=0, help="the output the simulations hold before (burgers1d.py)")
    return p.parse_args()


def main() -> None:
    args = parse()
    install_abort_handler()
    grid = ProcessGrid(dp=-1)  # every rank data-parallel
    grid.init_torch()  # gloo on CPU
    torch.set_num_threads(1)  # the simulations need the cores
    rank, world, comm = grid.rank, grid.layout.world_size, grid.comm
    run_dir = Path(os.environ["HPCML_RUN_DIR"])
    campaign = os.environ["HPCML_CAMPAIGN_ID"]  # the same on every relaunch and resume
    resume = os.environ.get("HPCML_RESUME") == "1"

    scales = FieldScales(param_lo=tuple(BOUNDS[n][0] for n in PARAMS), param_hi=tuple(BOUNDS[n][1] for n in PARAMS),
                         t_max=args.t_max, field_offset=0.0, field_scale=1.0)
    trainer = FieldTrainer(BurgersMLP(args.nx), grid,
                           FieldTrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, run_dir=str(run_dir),
                                            log_every=50, seed=0), scales)
    buffer = Buffer(BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark, seed=rank))
    if args.mode == "online":
        from hpcml.stream.server import ServerConfig, StreamServer

        port = 0
        if resume and (run_dir / "endpoints.json").exists():  # rebind the published port: the simulations reconnect
            _, old = read_endpoints(run_dir / "endpoints.json")
            port = int(old[rank].rsplit(":", 1)[1]) if len(old) == world else 0
        source = StreamServer(campaign=campaign, secret=read_secret(run_dir / "stream.key"), rank=rank,
                              n_trainers=world, buffer=buffer,
                              config=ServerConfig(host=args.host, port=port, param_names=PARAMS, field_names=("u",),
                                                  end_grace_s=10.0, done_file=os.environ["HPCML_SIMS_DONE_FILE"]))
    else:
        from hpcml.stream.files import FileSource

        files = sorted(Path(args.data).glob("sim_*.h5"))
        source = FileSource(files, rank=rank, n_trainers=world, buffer=buffer, field_names=("u",), param_names=PARAMS)

    n_sims = int(os.environ.get("HPCML_N_SIMS", "0"))
    armed = []  # the step at which every sample sent before the hold was in

    def reliability(m: dict) -> None:  # on every rank after each step (and its checkpoint)
        if resume:
            if args.crash_after_hold and rank == 0 and not Path(args.crash_after_hold).exists():
                Path(args.crash_after_hold).write_text(str(m["step"]))  # the relaunch is up: release the sims
            return
        if args.stop_at and m["step"] == args.stop_at and rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)  # as the scheduler's warning would: save and stop
        if args.crash_after_hold:
            if not armed and comm.allreduce(source.stats()["samples"]) == n_sims * (args.hold_at - 1):
                armed.append(m["step"])  # nothing more can come: the next checkpoint holds every sample so far
                if rank == 0:
                    print(f"[train] every sample sent before the hold is in at step {m['step']}", flush=True)
            elif armed and m["step"] % args.ckpt_every == 0 and rank == 0:
                print(f"[train] reliability test: killing the training job after the checkpoint at step {m['step']}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if m["step"] == args.steps and rank == 0:  # no kill came: let the simulations go on (the test fails)
                Path(args.crash_after_hold).write_text("no kill")

    result = train_online(trainer, source, grid=grid, on_step=reliability, config=OnlineConfig(
        steps=args.steps, batch=args.batch, ckpt_dir=str(run_dir / "checkpoints"), ckpt_every=args.ckpt_every,
        keep=args.keep, resume=resume, campaign=campaign,
        endpoints_file=str(run_dir / "endpoints.json") if args.mode == "online" else None))
    if rank == 0 and result.resumed_at is not None:
        print(f"[train] resumed at step {result.resumed_at} from {run_dir / 'checkpoints'}", flush=True)
    if result.status == "stopped":  # the walltime warning: saved; the next launch resumes
        if rank == 0:
            print(f"[train] stopped at step {result.steps} after saving", flush=True)
        sys.exit(NOT_FINISHED)
    if rank != 0:
        return
    problems = list(result.problems)
    if args.mode == "online":
        done = json.loads(Path(os.environ["HPCML_SIMS_DONE_FILE"]).read_text())
        expected = len(done["completed"]) * args.outputs
    else:
        expected = len(sorted(Path(args.data).glob("sim_*.h5"))) * args.outputs
    missing = expected - result.summary.get("samples_ingested", 0)
    if missing:  # no silent success: every output of every completed simulation must have been trained on
        problems.append(f"{missing} of {expected} samples were never ingested")
    summary = {**result.summary, "status": "failed" if problems else "ok", "problems": problems,
               "samples_expected": expected, "resumed_at": result.resumed_at}
    (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    print("[train] summary: " + ", ".join(f"{k}={summary[k]}" for k in (
        "samples_ingested", "duplicate_samples", "dropped_messages", "gradient_steps", "final_loss")), flush=True)
    if problems:
        print("train_burgers: failed: " + "; ".join(problems), file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    finally:
        stop.finished()  # the outcome is decided: a late warning must not turn it into a kill
