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
training job it starts under the site's MPI launcher.
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
import shutil
import signal
import sys
import time
import uuid
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
                                            "completed simulations are not run again, the trainer resumes")
    a("--nodes", type=int, default=None, help="batch sites: nodes of the simulations' Parsl block")
    a("--walltime", default=None, help="batch sites: walltime of the block, e.g. 02:00:00")
    a("--account", default=None, help="batch sites: project/account to charge")
    a("--queue", default=None, help="batch sites: queue or partition")
    a("--seed", type=int, default=0)
    a("--crash-sim", default=None, help="reliability test: SIM:STEP kills simulation SIM at STEP on attempt 0")
    a("--crash-trainer-at", type=int, default=None,
      help="reliability test: the first training job kills itself (SIGKILL) after this gradient step")
    a("--no-report", action="store_true", help="skip report.png")
    a("--quiet", action="store_true", help="no progress display")
    # the training job's own flags (set by the driver)
    a("--role", choices=("driver", "train"), default="driver", help=argparse.SUPPRESS)
    a("--campaign", default=None, help=argparse.SUPPRESS)
    a("--stream-interface", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("sims", "val_sims", "nx", "ny", "sim_steps", "every", "sim_ranks", "train_ranks", "train_nodes",
                 "max_concurrent", "steps", "batch", "capacity"):
        if getattr(args, name) is not None and getattr(args, name) < (0 if name == "val_sims" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sim_steps < args.every:
        p.error(f"--sim-steps {args.sim_steps} < --every {args.every}: the simulations would output nothing")
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
    from hpcml.stream import new_secret

    t0 = time.perf_counter()
    site = load_site(args.site)
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    secret_file, id_file = run_dir / "stream.key", run_dir / "campaign_id"
    resume = args.resume and id_file.exists() and secret_file.exists()
    if resume:  # the same campaign: its id, key, checkpoints, metrics and provenance carry on
        campaign_id = id_file.read_text().strip()
        (run_dir / "summary.json").unlink(missing_ok=True)
    else:
        for stale in ("endpoints.json", "summary.json", "train_summary.json", ".trainer_crashed", "metrics.jsonl",
                      "provenance.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)  # a new run in an old directory starts afresh
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        new_secret(secret_file)
        campaign_id = f"heat-{uuid.uuid4().hex[:8]}"
        id_file.write_text(campaign_id + "\n")
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
    train_argv = [sys.executable, str(Path(__file__).resolve()), "--role", "train", "--campaign", campaign_id,
                  *_forward(args, site)]
    ranks = args.train_ranks if args.train_ranks is not None or site.has_gpus else site.train_ranks(args.train_nodes)
    training = TrainingJob(argv=train_argv + (["--resume"] if resume else []), ranks=ranks, nodes=args.train_nodes,
                           env=stream_env, max_restarts=1, restart_argv=train_argv + ["--resume"])
    site_options = {k: getattr(args, k) for k in ("nodes", "walltime", "account", "queue") if getattr(args, k)}
    campaign = Campaign(site=site, site_options=site_options, run_dir=run_dir, max_concurrent=args.max_concurrent,
                        retries=args.retries, env=stream_env, progress=not args.quiet)
    kept = _kept(args, run_dir, sims, val) if resume else None
    if args.mode == "online":  # the trainers learn the end of the campaign from sims_done.json
        result = campaign.run(sims + val, training=training, ready_file=run_dir / "endpoints.json", resume=resume,
                              kept=kept)
    else:
        result = campaign.run(sims + val, resume=resume, kept=kept)
        if not result.interrupted:
            trained = campaign.run([], training=training, resume=resume)
            result = dataclasses.replace(result, training_returncode=trained.training_returncode,
                                         interrupted=trained.interrupted)
    if result.interrupted:
        return _interrupted(args, run_dir, result, t0)
    train = json.loads((run_dir / "train_summary.json").read_text())
    completed = [s for s in result.completed if s < args.sims]
    expected = len(completed) * (args.sim_steps // args.every)  # every output of every completed simulation
    train["samples_missing"] = max(0, expected - train["samples_ingested"])
    problems = []  # no silent success: a run that lost simulations or trained nothing says so and fails
    failed = sorted(set(result.failed) | set(result.cancelled))
    if failed:
        problems.append(f"{len(failed)} simulation(s) did not complete: {failed} (see {run_dir / 'provenance.jsonl'})")
    if not train.get("gradient_steps"):
        problems.append(f"the trainer took 0 gradient steps (see {run_dir / 'train.err'})")
    if max(0, expected - train["samples_ingested"]):
        problems.append(f"{expected - train['samples_ingested']} of {expected} samples were never ingested")
    summary = {"status": "failed" if problems else "ok", "problems": problems, "mode": args.mode, "sims_completed": len(completed), "sims_resumed": len(result.skipped),
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
        from hpcml.stream.state import simulations_in

        kept |= simulations_in(run_dir / "checkpoints", args.sim_steps // args.every)
    return kept


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
              "buffer", "capacity", "watermark", "ckpt_every", "host", "seed", "crash_trainer_at"):
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
    from mpi4py import MPI

    from hpcml import ckpt, stop
    from hpcml.grid import ProcessGrid, install_abort_handler
    from hpcml.grid.torch_dist import interface_address
    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.stream import Buffer, BufferConfig, StreamLoader, read_endpoints, read_secret, write_endpoints
    from hpcml.stream.files import FileSource, read_samples
    from hpcml.stream.server import ServerConfig, StreamServer
    from hpcml.stream.state import load_stream_states, stream_tensors
    from hpcml.train.field_report import write_report
    from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer

    install_abort_handler()
    grid = ProcessGrid(dp=-1)
    grid.init_torch()  # one rank per GPU with the device's backend (NCCL/RCCL/XCCL); gloo on CPU
    torch.set_num_threads(1)  # after init_torch's share of the cores: the simulations need them
    host = args.host or (interface_address(args.stream_interface) if args.stream_interface else "127.0.0.1")
    comm, rank, world = grid.comm, grid.rank, grid.layout.world_size
    run_dir = Path(args.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    scales = FieldScales(param_lo=tuple(BOUNDS[n][0] for n in PARAMS), param_hi=tuple(BOUNDS[n][1] for n in PARAMS),
                         t_max=t_max(args), field_offset=0.5, field_scale=0.5)
    model = MLPSurrogate(MLPSurrogateConfig(n_params=len(PARAMS), nx=args.nx, ny=args.ny, hidden=256, depth=3))
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=args.steps, batch=args.batch, lr=args.lr,
                                                         seed=args.seed, run_dir=str(run_dir),
                                                         progress=not args.quiet, log_every=25), scales)
    buffer = Buffer(BufferConfig(policy=args.buffer, capacity=args.capacity, watermark=args.watermark,
                                 seed=args.seed + rank))
    resume_from = ckpt_dir if args.resume and (ckpt_dir / "latest").exists() else None
    if args.mode == "online":
        port = 0
        if resume_from and (run_dir / "endpoints.json").exists():  # come back on the same address: sims reconnect
            _, old = read_endpoints(run_dir / "endpoints.json")
            port = int(old[rank].rsplit(":", 1)[1]) if len(old) == world else 0
        source = StreamServer(campaign=args.campaign, secret=read_secret(run_dir / "stream.key"), rank=rank,
                              n_trainers=world, buffer=buffer,
                              config=ServerConfig(host=host, port=port, param_names=PARAMS, field_names=("T",),
                                                  end_grace_s=10.0, streamed=tuple(range(args.sims)),
                                                  done_file=os.environ.get("HPCML_SIMS_DONE_FILE")))
    else:
        source = FileSource(sorted((run_dir / "data").glob("sim_*.h5")), rank=rank, n_trainers=world, buffer=buffer,
                            field_names=("T",), param_names=PARAMS)
    if resume_from:
        report = ckpt.load(resume_from, trainer.tensors(create=True), comm=comm)
        trainer.restore(report.extra)
        if args.mode == "online":
            source.load_state(load_stream_states(report.path))
        if rank == 0:
            print(f"[train] resumed at step {trainer.step} from {report.path} (saved on {report.layout}); "
                  f"buffer {len(buffer)} samples, {len(getattr(source, 'seen', ()))} seen", flush=True)
    source.start()
    endpoints = comm.gather(getattr(source, "endpoint", None))
    if rank == 0 and args.mode == "online":
        write_endpoints(run_dir / "endpoints.json", args.campaign, endpoints)

    def save() -> None:
        tensors = trainer.tensors()
        if args.mode == "online":
            tensors.update(stream_tensors(source, rank))
        ckpt.save(ckpt_dir, trainer.step, tensors, comm=comm, extra=trainer.extra(), layout=grid.layout.degrees,
                  keep=2)

    stopping = lambda: stop.requested() is not None  # noqa: E731  (the driver's SIGUSR1: save, then stop)
    loader = StreamLoader(source, comm, args.batch, should_stop=stopping)

    def stop_now() -> None:  # every rank, together: keep what arrived, save, exit "not finished"
        if isinstance(source, StreamServer):
            source.quiesce()
        save()
        stop.finished()
        source.stop()
        if rank == 0:
            print(f"[train] stopped by signal at step {trainer.step} after saving", flush=True)
        sys.exit(NOT_FINISHED)

    t_train = time.perf_counter()
    while trainer.step < args.steps:
        batch = loader.next_batch()
        if batch is None:
            break
        m = trainer.train_step(batch, extra={"buffer_len": len(buffer)})
        if args.ckpt_every and trainer.step % args.ckpt_every == 0:
            save()
        if args.crash_trainer_at == trainer.step and rank == 0 and not (run_dir / ".trainer_crashed").exists():
            (run_dir / ".trainer_crashed").write_text(str(trainer.step))
            print(f"[train] reliability test: killing the training job after step {trainer.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if loader.stopped:
        stop_now()
    train_s = time.perf_counter() - t_train
    # keep the stream flowing until every simulation is done, so none blocks on a gone trainer;
    # the ranks agree every round (all ended, or a stop on any), so they leave together
    drained = 0
    flags = np.zeros(2, np.int32)
    while True:
        flags[:] = (int(buffer.ended), int(not stopping()))
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MIN)  # [all ended, none asked to stop]
        if not flags[1]:
            stop_now()
        if flags[0]:
            break
        if args.buffer == "reservoir":  # never blocks the stream: just wait for its end
            time.sleep(0.05)
        else:
            drained += len(buffer.get(1, timeout=0.05) or [])
    save()
    stats = comm.gather({**source.stats(), "unused": loader.unused() + drained,
                         "starved_s": loader.starved_s, "agree_s": loader.agree_s,
                         "since_first_batch_s": time.perf_counter() - loader.t_first_batch if loader.t_first_batch
                         else 0.0, "train_s": train_s})
    source.stop()
    if rank != 0:
        return
    val_files = sorted((run_dir / "val").glob("sim_*.h5"))
    vals = [s for f in val_files for s in read_samples(f, ("T",), PARAMS)]
    val = trainer.rel_l2(np.stack([s.params for s in vals]), np.array([s.t for s in vals]),
                         np.stack([s.fields[0] for s in vals])) if vals else float("nan")
    busy = sum(s["since_first_batch_s"] for s in stats)
    out = {"samples_ingested": sum(s["samples"] for s in stats),
           "duplicate_samples": sum(s.get("duplicates", 0) for s in stats),
           "dropped_messages": {k: sum(s["dropped"].get(k, 0) for s in stats) for s in stats for k in s["dropped"]},
           "intake_mb_s": sum(s["intake_mb_s"] for s in stats),
           "bytes_ingested": sum(s["bytes"] for s in stats),
           "samples_unused": sum(s["unused"] for s in stats),
           "samples_trained": trainer.step * args.batch * world, "gradient_steps": trainer.step, "final_loss": trainer.history[-1]["loss"] if trainer.history else None,
           "trainer_idle_fraction": sum(s["starved_s"] for s in stats) / busy if busy else 0.0,
           "agreement_fraction": sum(s["agree_s"] for s in stats) / busy if busy else 0.0,
           "train_s": max(s["train_s"] for s in stats), "val_rel_l2": val, "val_samples": len(vals),
           "buffer": {"policy": args.buffer, "capacity": args.capacity, "watermark": args.watermark,
                      "per_rank": [s["buffer"] for s in stats]},
           "train_ranks": world}
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
