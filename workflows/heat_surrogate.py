"""Online training of a heat-equation surrogate from an ensemble of MPI simulations.

    python workflows/heat_surrogate.py --site local --sims 16 --mode online --run-dir runs/demo
    python workflows/heat_surrogate.py --site local --sims 16 --mode offline --run-dir runs/offline

Online: a Parsl campaign runs ``--sims`` heat simulations (``kernels.heat2d``, MPI,
``--sim-ranks`` each) whose output streams over ZeroMQ into a data-parallel training job
(``--train-ranks``) of an MLP surrogate (parameters, t) -> temperature field, which
checkpoints as it goes. Offline: the same simulations write HDF5 first, then the same
trainer trains from the files, for the same number of gradient steps. Both validate on
held-out simulations and write ``summary.json`` and ``report.png`` into the run directory.

The driver (this script without ``--role``) launches everything; ``--role train`` is the
training job it starts under the site's MPI launcher. A run directory holds one campaign
(the Campaign records it): running again in it needs ``--resume`` and the same design and
training flags; another campaign needs a new directory.
"""

from __future__ import annotations

if __name__ == "__main__":  # first thing: a walltime warning from now on is a stop request, not a kill
    from hpcml import stop

    stop.install()

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from hpcml.env import NOT_FINISHED

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ("alpha", "t_left", "t_right", "t_bottom", "t_top")
BOUNDS = {"alpha": (0.5, 1.5), "t_left": (0.0, 1.0), "t_right": (0.0, 1.0), "t_bottom": (0.0, 1.0), "t_top": (0.0, 1.0)}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--site", default="local", help="site config (site_configs/<name>.py)")
    a("--sims", type=int, default=16, help="training simulations")
    a("--val-sims", type=int, default=2, help="held-out simulations for validation (never trained on)")
    a("--mode", choices=("online", "offline"), default="online")
    a("--run-dir", default="runs/demo")
    a("--nx", type=int, default=32)
    a("--ny", type=int, default=32)
    a("--sim-steps", type=int, default=800, help="time steps per simulation")
    a("--every", type=int, default=40, help="output every K time steps")
    a("--sim-ranks", type=int, default=2)
    a("--train-ranks", type=int, default=None, help="trainer ranks (default: one per device of --train-nodes; "
                                                    "2 locally)")
    a("--train-nodes", type=int, default=1, help="nodes of the training job (one allocation: the job's first)")
    a("--max-concurrent", type=int, default=4, help="simulations running at once")
    a("--retries", type=int, default=2, help="Parsl retries per simulation")
    a("--steps", type=int, default=1500, help="gradient steps")
    a("--batch", type=int, default=8, help="samples per step per trainer rank")
    a("--lr", type=float, default=2e-3)
    a("--buffer", choices=("fifo", "firo", "reservoir"), default="reservoir")
    a("--capacity", type=int, default=256, help="buffer capacity per trainer rank (samples)")
    a("--watermark", type=int, default=16, help="samples in the buffer before training starts")
    a("--ckpt-every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    a("--host", default=None, help="address the trainers' stream servers bind (default: the site's stream "
                                  "interface, else loopback)")
    a("--resume", action="store_true", help="continue the campaign in --run-dir (a requeued batch job): "
                                            "completed simulations are not run again, the trainer resumes; "
                                            "without it a --run-dir holding a campaign is refused")
    a("--nodes", type=int, default=None, help="batch sites: nodes of the simulations' Parsl block")
    a("--walltime", default=None, help="batch sites: walltime of the block, e.g. 02:00:00")
    a("--account", default=None, help="batch sites: project/account to charge")
    a("--queue", default=None, help="batch sites: queue or partition")
    a("--seed", type=int, default=0)
    a("--crash-sim", default=None, help="reliability test: SIM:STEP kills simulation SIM at STEP on attempt 0")
    a("--crash-trainer-at", type=int, default=None,
      help="reliability test: the first training job kills itself (SIGKILL) after this gradient step")
    a("--crash-trainer-times", type=int, default=1, help="reliability test: that many training jobs in a row crash")
    a("--crash-trainer-rank", type=int, default=0, help="reliability test: the trainer rank that kills itself")
    a("--trainer-restarts", type=int, default=1,
      help="relaunches of a failed training job (it resumes from its checkpoint); past them the run fails")
    a("--no-report", action="store_true", help="skip report.png")
    a("--quiet", action="store_true", help="no progress display")
    # the training job's own flags (set by the driver)
    a("--role", choices=("driver", "train"), default="driver", help=argparse.SUPPRESS)
    a("--stream-interface", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("sims", "val_sims", "nx", "ny", "sim_steps", "every", "sim_ranks", "train_ranks", "train_nodes",
                 "max_concurrent", "steps", "batch", "capacity"):
        if getattr(args, name) is not None and getattr(args, name) < (0 if name == "val_sims" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sim_steps < args.every:
        p.error(f"--sim-steps {args.sim_steps} < --every {args.every}: the simulations would output nothing")
    for name in ("ckpt_every", "trainer_restarts", "crash_trainer_times", "crash_trainer_rank", "retries"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr {args.lr}: expected a finite learning rate > 0")
    from hpcml.errors import ConfigError
    from hpcml.stream.buffer import BufferConfig

    try:  # the trainer's own checks, here in the driver: one line now, not an MPI_Abort later
        BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark)
    except ConfigError as e:
        p.error(f"--capacity {args.capacity} --watermark {args.watermark}: {e}")
    return args


def dt_for(args) -> float:
    """One time step for every simulation: stable for the largest diffusivity in the design."""
    dx = 1.0 / (max(args.nx, args.ny) + 1)
    return 0.2 * dx * dx / BOUNDS["alpha"][1]


def t_max(args) -> float:
    return args.sim_steps * dt_for(args)


# ------------------------------------------------------------------------------------- driver
def sim_argv(args, run_dir: Path, out: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "kernels.heat2d", "--nx", str(args.nx), "--ny", str(args.ny), "--steps",
            str(args.sim_steps), "--every", str(args.every), "--dt", repr(dt_for(args)), "--t-init", "0"]
    return argv + (["--out", str(out)] if out else ["--stream"])


def driver(args) -> dict:
    from hpcml.ensemble import Campaign, SimSpec, TrainingJob, design, load_site
    from hpcml.errors import ConfigError, LaunchError
    from hpcml.stream import new_secret

    t0, started = time.perf_counter(), time.time()
    run_dir = Path(args.run_dir).resolve()
    try:
        site = load_site(args.site)
        run_dir.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as e:  # usage errors: one line, exit 2 as argparse's
        print(f"heat_surrogate: error: {e}" if isinstance(e, ConfigError) else f"heat_surrogate: error: --run-dir "
              f"{run_dir}: {e.strerror}; expected a directory (or a path to create one) under a directory",
              file=sys.stderr)
        sys.exit(2)
    secret_file = run_dir / "stream.key"
    new_secret(secret_file)  # reused when the directory has one (its campaign is resumed or refused)
    for sub in ("data", "val"):
        (run_dir / sub).mkdir(exist_ok=True)
    points = design("lhs", BOUNDS, args.sims + args.val_sims, seed=args.seed)
    crash = tuple(int(x) for x in args.crash_sim.split(":")) if args.crash_sim else None
    sims, val = [], []
    for i, params in enumerate(points):
        held_out = i >= args.sims
        out = run_dir / ("val" if held_out else "data") / f"sim_{i:05d}.h5"
        online = args.mode == "online" and not held_out
        argv = sim_argv(args, run_dir, None if online else out)
        if crash and crash[0] == i:
            argv += ["--crash-at-step", str(crash[1])]
        (val if held_out else sims).append(SimSpec(sim_id=i, params=params, argv=argv, ranks=args.sim_ranks))
    stream_env = {"HPCML_STREAM_ENDPOINTS_FILE": str(run_dir / "endpoints.json"),
                  "HPCML_STREAM_SECRET_FILE": str(secret_file),
                  "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    # the same argv every time (it defines the campaign); the Campaign passes the campaign id
    # (HPCML_CAMPAIGN_ID) and whether to resume (HPCML_RESUME, also on a relaunch)
    train_argv = [sys.executable, str(Path(__file__).resolve()), "--role", "train", *_forward(args, site)]
    ranks = args.train_ranks if args.train_ranks is not None or site.has_gpus else site.train_ranks(args.train_nodes)
    training = TrainingJob(argv=train_argv, ranks=ranks, nodes=args.train_nodes, env=stream_env,
                           max_restarts=args.trainer_restarts)
    site_options = {k: getattr(args, k) for k in ("nodes", "walltime", "account", "queue") if getattr(args, k)}
    campaign = Campaign(site=site, site_options=site_options, run_dir=run_dir, max_concurrent=args.max_concurrent,
                        retries=args.retries, env=stream_env, progress=not args.quiet)
    # read from the run directory only once the Campaign has found this campaign in it
    kept = (lambda: _kept(args, run_dir, sims, val)) if args.resume else None
    try:
        if args.mode == "online":  # the trainers learn the end of the campaign from sims_done.json
            result = campaign.run(sims + val, training=training, ready_file=run_dir / "endpoints.json",
                                  resume=args.resume, kept=kept)
        else:  # the simulations write files, then the training job alone reads them
            result = campaign.run(sims + val, resume=args.resume, kept=kept)
            if not result.interrupted:
                trained = campaign.train(training, resume=args.resume)
                result = dataclasses.replace(result, training_returncode=trained.training_returncode,
                                             interrupted=trained.interrupted)
    except ConfigError as e:  # refused before anything started (e.g. a directory of another campaign)
        print(f"heat_surrogate: error: {e}", file=sys.stderr)
        sys.exit(2)
    except LaunchError as e:  # the training job failed: the run says so and exits non-zero
        _failed(args, run_dir, [str(e)], t0)
    if result.interrupted:
        return _interrupted(args, run_dir, result, t0)
    train_file = run_dir / "train_summary.json"
    if not train_file.exists() or train_file.stat().st_mtime < started:  # not an earlier run's
        _failed(args, run_dir, [f"the training job exited {result.training_returncode} without writing {train_file} "
                                f"(see {run_dir / 'train.err'})"], t0)
    train = json.loads((run_dir / "train_summary.json").read_text())
    completed = [s for s in result.completed if s < args.sims]
    expected = len(completed) * (args.sim_steps // args.every)  # every output of every completed simulation
    train["samples_missing"] = max(0, expected - train["samples_ingested"])
    problems = []  # no silent success: a run that lost simulations or trained nothing says so and fails
    failed = sorted(set(result.failed) | set(result.cancelled))
    if failed:
        problems.append(f"{len(failed)} simulation(s) did not complete: {failed} (see {run_dir / 'provenance.jsonl'})")
    problems += [f"{p} (see {run_dir / 'train.err'})" for p in train.pop("trainer_problems", [])]
    if max(0, expected - train["samples_ingested"]):
        problems.append(f"{expected - train['samples_ingested']} of {expected} samples were never ingested")
    summary = {"status": "failed" if problems else "ok", "problems": problems, "mode": args.mode,
               "sims_completed": len(completed), "sims_resumed": len(result.skipped),
               "sims_failed": len([s for s in result.failed if s < args.sims]),
               "val_sims": args.val_sims, "sim_attempts": sum(result.attempts.values()),
               "sims_retried": len(result.retried), **train, "wall_s": time.perf_counter() - t0}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    keys = ("mode", "sims_completed", "samples_ingested", "duplicate_samples", "samples_missing", "intake_mb_s",
            "gradient_steps",
            "trainer_idle_fraction", "val_rel_l2", "wall_s")
    print("summary: " + ", ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                                  for k in keys))
    print(f"wrote {run_dir / 'summary.json'}" + ("" if args.no_report else f" and {run_dir / 'report.png'}"))
    if problems:
        print(f"heat_surrogate: failed: {'; '.join(problems)}", file=sys.stderr)
        sys.exit(1)
    return summary


def _kept(args, run_dir: Path, sims, val) -> set[int]:
    """Simulations whose results survive in this run directory: every output of a streamed
    one in the trainer's latest checkpoint, the file of one that writes files. A simulation
    that finished after the trainer's last save (a hard kill) is not among them: it runs again."""
    kept = {s.sim_id for s in sims + val if (run_dir / ("val" if s.sim_id >= args.sims else "data")
                                                / f"sim_{s.sim_id:05d}.h5").exists()}
    if args.mode == "online" and (run_dir / "checkpoints" / "latest").exists():
        from hpcml.train.online import simulations_in

        kept |= simulations_in(run_dir / "checkpoints", args.sim_steps // args.every)
    return kept


def _failed(args, run_dir: Path, problems: list[str], t0: float) -> None:
    """The campaign failed before a summary could be made: say why, in summary.json too, and exit 1."""
    summary = {"status": "failed", "problems": problems, "mode": args.mode, "wall_s": time.perf_counter() - t0}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"heat_surrogate: failed: {'; '.join(problems)}", file=sys.stderr)
    sys.exit(1)


def _interrupted(args, run_dir: Path, result, t0: float) -> dict:
    """The walltime warning stopped the campaign after the trainer saved: say so and exit 75."""
    summary = {"status": "interrupted", "mode": args.mode, "sims_completed": len(result.completed),
               "sims_cancelled": len(result.cancelled), "sims_resumed": len(result.skipped),
               "wall_s": time.perf_counter() - t0}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"interrupted (walltime warning): {len(result.completed)} of {result.total} simulations done, trainer "
          f"checkpoint saved; run again with --resume (exit {NOT_FINISHED})", file=sys.stderr)
    sys.exit(NOT_FINISHED)


def _forward(args, site) -> list[str]:
    """The driver's flags the training job needs too."""
    out = []
    for k in ("mode", "run_dir", "nx", "ny", "sim_steps", "every", "sims", "val_sims", "steps", "batch", "lr",
              "buffer", "capacity", "watermark", "ckpt_every", "host", "seed", "crash_trainer_at",
              "crash_trainer_times", "crash_trainer_rank"):
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(Path(v).resolve()) if k == "run_dir" else str(v)]
    if args.host is None and site.stream_interface:
        out += ["--stream-interface", site.stream_interface]
    return out + (["--no-report"] if args.no_report else []) + (["--quiet"] if args.quiet else [])


# ----------------------------------------------------------------------------- training job
def train(args) -> None:
    import numpy as np
    import torch

    from hpcml.grid import ProcessGrid, install_abort_handler
    from hpcml.grid.torch_dist import interface_address
    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.stream import Buffer, BufferConfig, read_endpoints, read_secret
    from hpcml.stream.files import FileSource, read_samples
    from hpcml.stream.server import ServerConfig, StreamServer
    from hpcml.train.field_report import write_report
    from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer
    from hpcml.train.online import OnlineConfig, train_online

    campaign = os.environ.get("HPCML_CAMPAIGN_ID")  # set by the Campaign, as HPCML_RESUME
    if not campaign:
        sys.exit("heat_surrogate --role train: HPCML_CAMPAIGN_ID is not set: the driver's Campaign starts the trainer")
    resume = os.environ.get("HPCML_RESUME") == "1"
    install_abort_handler()
    grid = ProcessGrid(dp=-1)
    grid.init_torch()  # one rank per GPU with the device's backend (NCCL/RCCL/XCCL); gloo on CPU
    torch.set_num_threads(1)  # after init_torch's share of the cores: the simulations need them
    host = args.host or (interface_address(args.stream_interface) if args.stream_interface else "127.0.0.1")
    rank, world = grid.rank, grid.layout.world_size
    run_dir = Path(args.run_dir)
    scales = FieldScales(param_lo=tuple(BOUNDS[n][0] for n in PARAMS), param_hi=tuple(BOUNDS[n][1] for n in PARAMS),
                         t_max=t_max(args), field_offset=0.5, field_scale=0.5)
    model = MLPSurrogate(MLPSurrogateConfig(n_params=len(PARAMS), nx=args.nx, ny=args.ny, hidden=256, depth=3))
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=args.steps, batch=args.batch, lr=args.lr,
                                                         seed=args.seed, run_dir=str(run_dir),
                                                         progress=not args.quiet, log_every=25), scales)
    buffer = Buffer(BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark,
                                 seed=args.seed + rank))
    if args.mode == "online":
        port = 0
        if resume and (run_dir / "endpoints.json").exists():  # come back on the same address: sims reconnect
            _, old = read_endpoints(run_dir / "endpoints.json")
            port = int(old[rank].rsplit(":", 1)[1]) if len(old) == world else 0
        source = StreamServer(campaign=campaign, secret=read_secret(run_dir / "stream.key"), rank=rank,
                              n_trainers=world, buffer=buffer,
                              config=ServerConfig(host=host, port=port, param_names=PARAMS, field_names=("T",),
                                                  end_grace_s=10.0, streamed=tuple(range(args.sims)),
                                                  done_file=os.environ.get("HPCML_SIMS_DONE_FILE")))
    else:
        source = FileSource(sorted((run_dir / "data").glob("sim_*.h5")), rank=rank, n_trainers=world, buffer=buffer,
                            field_names=("T",), param_names=PARAMS)

    marker = run_dir / ".trainer_crashed"  # how many training jobs crashed so far
    crashed = int(marker.read_text()) if marker.exists() else 0

    def crash_test(m: dict) -> None:  # --crash-trainer-at: the first --crash-trainer-times jobs die at that step
        if args.crash_trainer_at == m["step"] and rank == args.crash_trainer_rank and crashed < args.crash_trainer_times:
            marker.write_text(str(crashed + 1))
            print(f"[train] reliability test: killing trainer rank {rank} after step {m['step']} (crash "
                  f"{crashed + 1} of {args.crash_trainer_times})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    config = OnlineConfig(steps=args.steps, batch=args.batch, ckpt_dir=str(run_dir / "checkpoints"),
                          ckpt_every=args.ckpt_every, resume=resume, campaign=campaign,
                          endpoints_file=str(run_dir / "endpoints.json") if args.mode == "online" else None)
    result = train_online(trainer, source, grid=grid, config=config, on_step=crash_test)
    if rank == 0 and result.resumed_at is not None:
        print(f"[train] resumed at step {result.resumed_at} from {run_dir / 'checkpoints'}", flush=True)
    if result.status == "stopped":
        if rank == 0:
            print(f"[train] stopped by signal at step {result.steps} after saving", flush=True)
        sys.exit(NOT_FINISHED)
    if rank != 0:
        return
    vals = [s for f in sorted((run_dir / "val").glob("sim_*.h5")) for s in read_samples(f, ("T",), PARAMS)]
    val = trainer.rel_l2(np.stack([s.params for s in vals]), np.array([s.t for s in vals]),
                         np.stack([s.fields[0] for s in vals])) if vals else float("nan")
    out = {**result.summary, "val_rel_l2": val, "val_samples": len(vals), "trainer_problems": result.problems}
    out["buffer"].update(policy=args.buffer, capacity=args.capacity, watermark=args.watermark)
    (run_dir / "train_summary.json").write_text(json.dumps(out, indent=1))
    if not args.no_report and vals:
        write_report(run_dir, trainer, vals, out)


def main(argv=None) -> None:
    from hpcml import stop

    args = parse(argv)
    try:
        if args.role == "train":
            train(args)
        else:
            driver(args)
    finally:
        stop.finished()  # the outcome is decided: a late walltime warning must not turn it into a kill


if __name__ == "__main__":
    main()
