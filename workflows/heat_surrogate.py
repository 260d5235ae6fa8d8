"""Online training of a heat-equation surrogate from an ensemble of MPI simulations.

    python workflows/heat_surrogate.py --site local --sims 16 --mode online --run-dir runs/demo
    python workflows/heat_surrogate.py --site local --sims 16 --mode offline --run-dir runs/offline
    python workflows/heat_surrogate.py --site local --sims 16 --adaptive --wave 4 --run-dir runs/adaptive

Online: a Parsl campaign runs ``--sims`` heat simulations (``kernels.heat2d``, MPI) whose output
streams into a data-parallel training job of an MLP surrogate (parameters, t) -> temperature
field. Offline: the simulations write HDF5, then the same trainer reads it for as many steps.
``--adaptive``: the training simulations come in waves of ``--wave`` from a Breed sampler fed by
the trainer's per-simulation losses (docs/active-learning.md). All validate on held-out
simulations and write ``summary.json`` and ``report.png`` into the run directory, which holds
one campaign (again: ``--resume``, the same design). ``--role train``: the training job itself.
"""

from __future__ import annotations

from hpcml import stop

if __name__ == "__main__":  # first thing: a walltime warning from now on is a stop request, not a kill
    stop.install()

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ("alpha", "t_left", "t_right", "t_bottom", "t_top")
BOUNDS = {"alpha": (0.5, 1.5), "t_left": (0.0, 1.0), "t_right": (0.0, 1.0), "t_bottom": (0.0, 1.0), "t_top": (0.0, 1.0)}
POSITIVE = ("sims", "nx", "ny", "sim_steps", "every", "sim_ranks", "train_ranks", "train_nodes", "max_concurrent",
            "steps", "batch", "capacity", "wave", "crash_trainer_at")
NATURAL = ("val_sims", "ckpt_every", "trainer_restarts", "crash_trainer_times", "crash_trainer_rank", "retries")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    for flag, kind, default, text in (
            ("site", str, "local", "site config (site_configs/<name>.py)"), ("sims", int, 16, "training simulations"),
            ("val-sims", int, 2, "held-out simulations (never trained on)"), ("run-dir", str, "runs/demo", ""),
            ("nx", int, 32, ""), ("ny", int, 32, ""), ("sim-steps", int, 800, "time steps per simulation"),
            ("every", int, 40, "output every K time steps"), ("sim-ranks", int, 2, "MPI ranks per simulation"),
            ("train-ranks", int, None, "trainer ranks (default: one per device of --train-nodes; 2 locally)"),
            ("train-nodes", int, 1, "nodes of the training job"), ("max-concurrent", int, 4, "simulations at once"),
            ("retries", int, 2, "Parsl retries per simulation"), ("steps", int, 1500, "gradient steps"),
            ("batch", int, 8, "samples per step per trainer rank"), ("lr", float, 2e-3, ""),
            ("capacity", int, 256, "buffer capacity per trainer rank"), ("watermark", int, 16, "samples to start"),
            ("ckpt-every", int, 50, "checkpoint every N steps (0: at the end)"), ("seed", int, 0, "design seed"),
            ("host", str, None, "address the trainers' stream servers bind (default: the site's interface)"),
            ("nodes", int, None, "batch sites: nodes of the simulations' block"), ("walltime", str, None, "02:00:00"),
            ("account", str, None, "batch sites: project to charge"), ("queue", str, None, "batch sites: queue"),
            ("crash-sim", str, None, "reliability test: SIM:STEP kills simulation SIM at STEP on attempt 0"),
            ("crash-trainer-at", int, None, "reliability test: the first trainer kills itself after this step"),
            ("crash-trainer-times", int, 1, "that many training jobs in a row crash"),
            ("crash-trainer-rank", int, 0, "the trainer rank that kills itself"),
            ("trainer-restarts", int, 1, "relaunches of a failed training job (it resumes from its checkpoint)"),
            ("wave", int, 4, "--adaptive: simulations proposed at a time"),
            ("target", float, None, "--adaptive: propose no more once the held-out relative L2 is at most this")):
        a(f"--{flag}", type=kind, default=default, help=text or None)
    a("--mode", choices=("online", "offline"), default="online")
    a("--buffer", choices=("fifo", "firo", "reservoir"), default="reservoir")
    a("--adaptive", action="store_true", help="online: propose the training simulations in waves (active learning)")
    for flag in ("resume", "no-report", "quiet"):  # continue the campaign in --run-dir; no report.png; no progress
        a(f"--{flag}", action="store_true")
    a("--role", choices=("driver", "train"), default="driver", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in POSITIVE + NATURAL:
        if getattr(args, name) is not None and getattr(args, name) < (name in POSITIVE):
            p.error(f"--{name.replace('_', '-')} must be >= {int(name in POSITIVE)}, got {getattr(args, name)}")
    if args.sim_steps < args.every:
        p.error(f"--sim-steps {args.sim_steps} < --every {args.every}: the simulations would output nothing")
    if args.adaptive and args.mode != "online":
        p.error("--adaptive needs --mode online: the waves follow the trainer's feedback while it trains")
    if args.target is not None and not (args.adaptive and 0 < args.target < float("inf") and args.val_sims):
        p.error(f"--target {args.target}: expected a relative L2 > 0, with --adaptive and --val-sims >= 1 (the "
                f"held-out simulations it is measured on)")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr {args.lr}: expected a finite learning rate > 0")
    from hpcml.stream import BufferConfig

    try:  # the trainer's own checks, here in the driver: one line now, not an MPI_Abort later
        BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark)
    except ValueError as e:
        p.error(f"--capacity {args.capacity} --watermark {args.watermark}: {e}")
    return args


def dt_for(args) -> float:
    """One time step for every simulation: stable for the largest diffusivity in the design."""
    return 0.2 * (1.0 / (max(args.nx, args.ny) + 1)) ** 2 / BOUNDS["alpha"][1]


def driver(args, argv: list[str]) -> None:
    from hpcml.ensemble import Breed, Campaign, SimSpec, TrainingJob, design, load_site, workflow_summary
    from hpcml.errors import ConfigError, LaunchError

    t0, run_dir = time.perf_counter(), Path(args.run_dir).resolve()
    try:
        site = load_site(args.site)
        run_dir.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as e:  # usage errors: one line, exit 2 as argparse's
        die(f"error: {e}" if isinstance(e, ConfigError) else f"error: --run-dir {run_dir}: {e.strerror}; expected a "
            f"directory (or a path to create one) under a directory", 2)
    online, sims = args.mode == "online", []
    crash = tuple(int(x) for x in args.crash_sim.split(":")) if args.crash_sim else (-1, 0)

    def simulation(i: int, params: dict[str, float]) -> SimSpec:
        held_out = i >= args.sims
        out = run_dir / ("val" if held_out else "data") / f"sim_{i:05d}.h5"
        out.parent.mkdir(exist_ok=True)
        argv_i = [sys.executable, "-m", "kernels.heat2d", "--nx", str(args.nx), "--ny", str(args.ny), "--steps",
                  str(args.sim_steps), "--every", str(args.every), "--dt", repr(dt_for(args)), "--t-init", "0",
                  *(["--stream"] if online and not held_out else ["--out", str(out)]),
                  *(["--crash-at-step", str(crash[1])] if crash[0] == i else [])]
        return SimSpec(sim_id=i, params=params, argv=argv_i, ranks=args.sim_ranks, stream=online and not held_out)

    for i, params in enumerate(design("lhs", BOUNDS, args.sims + args.val_sims, seed=args.seed)):
        if not args.adaptive or i >= args.sims:  # adaptive: the sampler proposes the training ones
            sims.append(simulation(i, params))
    ranks = args.train_ranks if args.train_ranks is not None or site.has_gpus else site.train_ranks(args.train_nodes)
    path = {"PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}  # kernels
    training = TrainingJob(argv=[sys.executable, str(Path(__file__).resolve()), *argv, "--role", "train"], ranks=ranks,
                           nodes=args.train_nodes, max_restarts=args.trainer_restarts, stream=online, steps=args.steps,
                           batch=args.batch, env=path)
    campaign = Campaign(site=site, site_options={k: getattr(args, k) for k in ("nodes", "walltime", "account", "queue")
                                                 if getattr(args, k)}, run_dir=run_dir, stream_host=args.host,
                        max_concurrent=args.max_concurrent, retries=args.retries, progress=not args.quiet,
                        env=training.env)
    problems = []
    try:
        if args.adaptive:
            result = campaign.run_adaptive(
                simulation, Breed(bounds=BOUNDS, seed=args.seed), budget=args.sims, wave=args.wave, training=training,
                sims=sims, target=None if args.target is None else ("val_rel_l2", args.target), resume=args.resume)
        elif online:
            result = campaign.run(sims, training=training, resume=args.resume)
        else:  # the simulations write files, then the trainer alone reads them
            result = campaign.run_offline(sims, training, resume=args.resume)
    except ConfigError as e:  # refused before anything started (e.g. a directory of another campaign)
        die(f"error: {e}", 2)
    except LaunchError as e:  # the training job failed, or lost samples: the run says so and exits non-zero
        result, problems = e.result, [str(e)]
    summary = workflow_summary(result, run_dir, problems, counted=lambda i: i < args.sims, mode=args.mode,
                               val_sims=args.val_sims, wall_s=time.perf_counter() - t0)  # writes summary.json
    if summary["status"] == "interrupted":  # resume it: exit 75 ("not finished"), as the trainer
        die(f"interrupted (walltime warning): {len(result.completed)} of {result.total} simulations done, trainer "
            f"checkpoint saved; run again with --resume (exit 75)", 75)
    keys = ("mode", "sims_completed", "samples_ingested", "duplicate_samples", "samples_missing", "intake_mb_s",
            "gradient_steps", "trainer_idle_fraction", "val_rel_l2", "wall_s")
    print("summary: " + ", ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                                  for k in keys if k in summary))
    print(f"wrote {run_dir / 'summary.json'}" + ("" if args.no_report else f" and {run_dir / 'report.png'}"))
    if problems:
        die(f"failed: {'; '.join(problems)}", 1)


def die(message: str, code: int) -> None:
    print(f"heat_surrogate: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def train(args) -> int:
    from hpcml.contract import Contract
    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.stream import BufferConfig
    from hpcml.train import FieldScales, FieldTrainConfig, OnlineConfig, train_surrogate
    from hpcml.train.fault import KillAtStep

    run_dir = Path(Contract.from_env().run_dir)
    crash = KillAtStep(step=args.crash_trainer_at, rank=args.crash_trainer_rank, times=args.crash_trainer_times,
                       marker=run_dir / ".trainer_crashed") if args.crash_trainer_at else None  # reliability tests
    return train_surrogate(
        MLPSurrogate(MLPSurrogateConfig(n_params=len(PARAMS), shape=(args.nx, args.ny), hidden=256, depth=3)),
        params=PARAMS, fields=("T",), scales=FieldScales(
            param_lo=tuple(BOUNDS[n][0] for n in PARAMS), param_hi=tuple(BOUNDS[n][1] for n in PARAMS),
            t_max=args.sim_steps * dt_for(args), field_offset=0.5, field_scale=0.5),
        config=FieldTrainConfig(lr=args.lr, seed=args.seed, progress=not args.quiet, log_every=25),
        buffer=BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark, seed=args.seed),
        # adaptive: the held-out error every 50 steps, published with the feedback (for --target)
        online=OnlineConfig.from_campaign(ckpt_every=args.ckpt_every, val_every=50 if args.adaptive else 0),
        server={"end_grace_s": 10.0},
        shape=(args.nx, args.ny),  # bounds what one simulation's connection may make the trainer hold
        files=None if args.mode == "online" else sorted((run_dir / "data").glob("sim_*.h5")),
        val_files=lambda: sorted((run_dir / "val").glob("sim_*.h5")), report=not args.no_report, on_step=crash,
        torch_threads=1)  # the simulations need the cores


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    try:
        sys.exit(train(args)) if args.role == "train" else driver(args, argv)
    finally:  # the outcome is decided: a late walltime warning must not turn it into a kill
        stop.finished()


if __name__ == "__main__":
    main()
