"""Adaptive sampling (Breed) against Halton at equal simulation budget (issue 25).

The default kernel is heat2d (``kernels/heat2d.py``) with a Gaussian heat source of fixed
total power, over its centre ``source_x`` and width ``source_width``: a wide source makes a
smooth bump that a surrogate learns from a few simulations, a narrow one a sharp peak that
moves with its centre, which the surrogate only fits where simulations lie close in
``source_x``. The difficulty is concentrated in one band of the space and the error there
falls with the number of simulations in it (Halton's narrowest quarter: 0.14 at 64
simulations, 0.07 at 128; the widest: 0.024 and 0.020), which is what adaptive sampling
should exploit. ``--kernel gray_scott`` is the other project kernel over Pearson's (F, k)
map, whose pattern regions are partly chaotic: more simulations there help little.

Each of ``--seeds`` seeds runs the same loop twice, once per sampler: waves of ``--wave``
simulations up to ``--budget``, the real kernel run in-process for each (one rank,
``MemorySink``), hpcml's FieldTrainer and MLPSurrogate trained ``--steps-per-wave`` steps on
every sample so far after each wave (one cosine schedule over all waves), the
per-simulation loss of those samples as the feedback (what ``hpcml.train.feedback``
publishes), and the next wave asked of the sampler. After every wave the surrogate is
scored on a fixed held-out set drawn uniformly from the whole space: relative L2 per
held-out simulation, mean and p95. The campaign machinery (Parsl, the stream, the wave
record) is tested in tests/workflows; this measures the sampler.

    python benchmarks/active_learning.py --json          # ~5 min on 2 cores
    python benchmarks/active_learning.py --quick --json  # a smoke run

The last JSON line carries ``p95_ratio`` and ``mean_ratio`` (adaptive / Halton at the full
budget, the mean over seeds), ``sims_ratio`` (simulations adaptive needed to reach Halton's
final p95, over the budget, the mean over seeds; null if a seed never did; an earlier wave's
surrogate is scored before the schedule has decayed, so this is conservative), ``seeds``,
per-seed figures and the cost (driver CPU seconds in the sampler, feedback bytes per wave).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = {
    # Pearson's map: dead (uniform u) to spots, stripes and waves; the pattern regions are chaotic
    "gray_scott": {"bounds": {"F": (0.01, 0.07), "k": (0.045, 0.07)}, "field": "u", "offset": 0.6, "scale": 0.3,
                   "band": "F"},
    # a Gaussian source of fixed total heat along y = 1/2: narrow ones make sharp peaks that move with x
    "heat2d": {"bounds": {"source_x": (0.1, 0.9), "source_width": (0.02, 0.2)}, "field": "T", "offset": 0.0,
               "scale": 0.5, "band": "source_width"},
}


def simulate(params: dict, args, cache: dict) -> list[tuple[float, np.ndarray]]:
    """(t, field) of each output of one run of ``args.kernel`` at ``params`` (cached)."""
    key = tuple(params.values())
    if key not in cache:
        from mpi4py import MPI

        from kernels.common import MemorySink

        if args.kernel == "gray_scott":
            from kernels.gray_scott import GrayScottConfig as Config, run

            cfg = Config(nx=args.nx, ny=args.nx, steps=args.gs_steps, every=args.every, seed=1, **params)
        else:
            from kernels.heat2d import HeatConfig as Config, run

            cfg = Config(nx=args.nx, ny=args.nx, steps=args.heat_steps, every=args.heat_steps // 8, alpha=0.01,
                         t_init=0.0, source_power=0.05, source_y=0.5, **params)
        sink = MemorySink()
        run(MPI.COMM_SELF, cfg, sink)
        name = KERNELS[args.kernel]["field"]
        cache[key] = [(t, f[name].astype(np.float32)) for _, t, f in sink.records]
    return cache[key]


def rel_l2(trainer, samples) -> float:
    """The relative L2 error of the surrogate over one simulation's samples."""
    pred = trainer.predict(np.stack([s.params for s in samples]), np.array([s.t for s in samples], np.float32))
    true = np.stack([s.fields[0] for s in samples])
    return float(np.linalg.norm(pred - true) / max(float(np.linalg.norm(true)), 1e-12))


def bands(errors: list[float], held_out: list[dict], axis: str) -> list[float]:
    """Mean held-out error per quarter of ``axis`` (by the held-out set's quartiles): where it is."""
    v, e = np.array([h[axis] for h in held_out]), np.array(errors)
    edges = np.quantile(v, [0, 0.25, 0.5, 0.75, 1])
    return [float(e[(v >= lo) & (v <= hi)].mean()) for lo, hi in zip(edges, edges[1:])]


def one_run(kind: str, seed: int, held_out: list[dict], args, cache: dict) -> dict:
    import torch

    from hpcml.ensemble.breed import Breed
    from hpcml.ensemble.sampling import Halton, SimStats
    from hpcml.grid import ProcessGrid
    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.stream.buffer import Sample
    from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    kern = KERNELS[args.kernel]
    bounds, names = kern["bounds"], list(kern["bounds"])
    sampler = Halton(bounds, seed=seed) if kind == "halton" else Breed(
        bounds=bounds, seed=seed, r_end=args.r_end, ramp_waves=args.ramp, sigma=args.sigma, parents=args.parents,
        score="surprise" if args.feedback == "surprise" else "loss", spread=args.spread)
    from mpi4py import MPI

    from hpcml.train.feedback import SimFeedback

    fb = SimFeedback(path=None, every=10, comm=MPI.COMM_SELF, param_names=names)  # what the trainer publishes
    grid = ProcessGrid(dp=-1)
    t_max = simulate(held_out[0], args, cache)[-1][0]
    scales = FieldScales(param_lo=tuple(b[0] for b in bounds.values()), param_hi=tuple(b[1] for b in bounds.values()),
                         t_max=t_max, field_offset=kern["offset"], field_scale=kern["scale"])
    n_waves = -(-args.budget // args.wave)
    trainer = FieldTrainer(MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=args.nx, ny=args.nx, hidden=args.hidden,
                                                           depth=3)),
                           grid, FieldTrainConfig(steps=n_waves * args.steps_per_wave, batch=args.batch, lr=2e-3,
                                                  progress=False, log_every=10**9), scales)
    samples: list[Sample] = []
    by_sim: dict[int, list[Sample]] = {}
    feedback: dict[str, SimStats] = {}
    curve, sampler_s, feedback_bytes = [], 0.0, []
    val = [[Sample(-1, i, tt, np.array([p[n] for n in names], np.float32), u[None])
            for i, (tt, u) in enumerate(simulate(p, args, cache))] for p in held_out]
    while len(by_sim) < args.budget:
        t = time.process_time()
        wave = sampler.propose(min(args.wave, args.budget - len(by_sim)), feedback)
        sampler_s += time.process_time() - t
        for p in wave:
            sim = len(by_sim)
            out = [Sample(sim, i, tt, np.array([p[n] for n in names], np.float32), u[None])
                   for i, (tt, u) in enumerate(simulate(p, args, cache))]
            by_sim[sim] = out
            samples += out
        for _ in range(args.steps_per_wave):  # as hpcml.train.online steps: fresh losses first, then the step
            batch = [samples[i] for i in rng.integers(0, len(samples), args.batch)]
            if fb.novel(batch):
                fb.fresh(trainer, batch)
            fb.metrics["loss"] = float(trainer.train_step(batch)["loss"])
            fb.step(trainer, batch, trainer.step)
        feedback = {}
        for sim, ss in by_sim.items():
            if args.feedback == "surprise":  # hpcml.train.feedback's out-of-sample measure (its loss beside it)
                rec = fb.sims.get(sim)
                if rec is None:  # not drawn into a batch yet
                    continue
                feedback[str(sim)] = SimStats(params=dict(zip(names, rec["params"])), loss=rec["loss"] or 0.0,
                                              samples=rec["samples"], fresh=rec["fresh"], surprise=rec["surprise"])
                continue
            if args.feedback == "rel_l2":  # the score's own measure, per simulation
                loss = rel_l2(trainer, ss)
            else:  # what hpcml.train.feedback publishes: the training loss of its samples
                loss = float(np.mean(trainer.sample_losses(ss)))
            feedback[str(sim)] = SimStats(params=dict(zip(names, map(float, ss[0].params))),
                                          loss=loss, samples=len(ss))
        feedback_bytes.append(len(json.dumps({str(k): {"params": list(v.params.values()), "loss": v.loss,
                                                        "samples": v.samples, "age": 0}
                                               for k, v in feedback.items()})))
        errs = [rel_l2(trainer, ss) for ss in val]
        curve.append({"sims": len(by_sim), "mean": float(np.mean(errs)), "p95": float(np.percentile(errs, 95))})
    score = [v.surprise if args.feedback == "surprise" else v.loss for v in feedback.values()]
    return {"curve": curve, "held_out_errors": errs, "sampler_cpu_s": sampler_s,
            "feedback_bytes_per_wave": int(np.mean(feedback_bytes)),
            "points": [list(v.params.values()) for v in feedback.values()], "scores": score}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--wave", type=int, default=8)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--nx", type=int, default=32)
    p.add_argument("--gs-steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=375)
    p.add_argument("--heat-steps", type=int, default=64, help="heat2d: time steps (8 outputs)")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="heat2d")
    p.add_argument("--held-out", type=int, default=128)
    p.add_argument("--steps-per-wave", type=int, default=1200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--r-end", type=float, default=0.5)
    p.add_argument("--ramp", type=int, default=3)
    p.add_argument("--sigma", type=float, default=0.06)
    p.add_argument("--parents", type=float, default=0.2)
    p.add_argument("--spread", type=int, default=16, help="Breed: candidates per bred point, the farthest from the "
                   "design kept (1: Melissa's plain draw)")
    p.add_argument("--feedback", choices=("mse", "rel_l2", "surprise"), default="mse",
                   help="what Breed reads per simulation: the training loss of its samples (mse), their relative "
                        "L2 (rel_l2), or hpcml.train.feedback's surprise (its loss before it was trained on, over "
                        "the training loss then)")
    p.add_argument("--quick", action="store_true", help="a smoke run: budget 16, waves of 4, 1 seed, small grid")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.budget, args.wave, args.seeds, args.nx, args.gs_steps, args.every = 16, 4, 1, 16, 600, 150
        args.held_out, args.steps_per_wave = 8, 30
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    rng = np.random.default_rng(12345)  # the held-out set: uniform over the whole space, the same for every run
    held_out = [{k: float(rng.uniform(*b)) for k, b in KERNELS[args.kernel]["bounds"].items()}
                for _ in range(args.held_out)]
    cache: dict = {}
    t0 = time.perf_counter()
    per_seed = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        runs = {kind: one_run(kind, seed, held_out, args, cache) for kind in ("halton", "breed")}
        h, b = runs["halton"]["curve"], runs["breed"]["curve"]
        reach = next((c["sims"] for c in b if c["p95"] <= h[-1]["p95"]), None)
        row = {"seed": seed, "halton": h[-1], "breed": b[-1], "p95_ratio": b[-1]["p95"] / h[-1]["p95"],
               "mean_ratio": b[-1]["mean"] / h[-1]["mean"],
               "sims_ratio": None if reach is None else reach / args.budget,
               "curves": {"halton": h, "breed": b},
               "cost": {k: {"sampler_cpu_s": runs[k]["sampler_cpu_s"],
                            "feedback_bytes_per_wave": runs[k]["feedback_bytes_per_wave"]} for k in runs},
               "points": {k: runs[k]["points"] for k in runs},
               "bands": {k: bands(runs[k]["held_out_errors"], held_out, KERNELS[args.kernel]["band"]) for k in runs},
               "held_out_errors": {k: [round(e, 5) for e in runs[k]["held_out_errors"]] for k in runs}}
        per_seed.append(row)
        if not args.json:
            print(f"seed {seed}: p95 Halton {h[-1]['p95']:.4f} Breed {b[-1]['p95']:.4f} "
                  f"(ratio {row['p95_ratio']:.3f}); mean {h[-1]['mean']:.4f} / {b[-1]['mean']:.4f}; "
                  f"Halton's final p95 reached by Breed at {reach} of {args.budget} simulations", flush=True)
    reached = [r["sims_ratio"] for r in per_seed]
    out = {"benchmark": "active_learning", "kernel": args.kernel, "bounds": KERNELS[args.kernel]["bounds"],
           "budget": args.budget,
           "wave": args.wave, "held_out": args.held_out, "nx": args.nx, "gs_steps": args.gs_steps,
           "steps_per_wave": args.steps_per_wave, "feedback": args.feedback,
           "breed": {"r_end": args.r_end, "ramp_waves": args.ramp, "sigma": args.sigma, "parents": args.parents},
           "seconds": time.perf_counter() - t0, "seeds": args.seeds, "first_seed": args.first_seed,
           "held_out_params": [list(h.values()) for h in held_out],
           "p95_ratio": float(np.mean([r["p95_ratio"] for r in per_seed])),
           "mean_ratio": float(np.mean([r["mean_ratio"] for r in per_seed])),
           "sims_ratio": None if None in reached else float(np.mean(reached)),
           "per_seed": per_seed}
    print(json.dumps(out) if args.json else f"p95_ratio {out['p95_ratio']:.3f} mean_ratio {out['mean_ratio']:.3f} "
          f"sims_ratio {out['sims_ratio']}")


if __name__ == "__main__":
    main()
