"""The heat surrogate's half of ``benchmarks/population.py --model heat`` (LTFB, independent
members, one trainer K times longer: the same total compute on the same simulations)."""

from __future__ import annotations

import time

import numpy as np

NX = NY = 16
BOUNDS = {"alpha": (0.5, 1.5), "t_left": (0.0, 1.0), "t_right": (0.0, 1.0), "t_bottom": (0.0, 1.0),
          "t_top": (0.0, 1.0)}
TRAIN_SIMS, VAL_SIMS, TEST_SIMS = 8, 2, 8  # per member, per member, in all


def simulate(n: int, seed: int) -> list[list]:
    """``n`` heat simulations (one process each, this rank alone), every output a Sample."""
    from mpi4py import MPI

    from hpcml.stream.buffer import Sample
    from kernels.grid import decompose
    from kernels.heat2d import HeatConfig, run
    from kernels.sinks import MemorySink

    rng = np.random.default_rng(seed)
    decomp = decompose(MPI.COMM_SELF, NX, NY, periodic=False)
    sims = []
    for sim in range(n):
        p = {k: float(rng.uniform(lo, hi)) for k, (lo, hi) in BOUNDS.items()}
        sink = MemorySink()
        run(MPI.COMM_SELF, HeatConfig(nx=NX, ny=NY, steps=400, every=40, **p), sink, decomp=decomp)
        vec = np.array([p[k] for k in BOUNDS], np.float32)
        sims.append([Sample(sim=sim, step=step, t=t, params=vec, fields=f["T"][None].astype(np.float32))
                     for step, t, f in sink.records])
    return sims


def _arrays(samples: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.stack([s.params for s in samples]), np.array([s.t for s in samples]),
            np.stack([s.fields[0] for s in samples]))


def _train(grid, pool: list, val: list, test: list, *, steps: int, lr: float, seed: int, every: int | None,
           t_max: float, pairing_seed: int = 0):
    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.train import FieldScales, FieldTrainConfig, FieldTrainer, Tournament, TournamentConfig

    import torch

    torch.manual_seed(seed)
    model = MLPSurrogate(MLPSurrogateConfig(n_params=len(BOUNDS), nx=NX, ny=NY, hidden=64, depth=3))
    scales = FieldScales(param_lo=tuple(lo for lo, _ in BOUNDS.values()),
                         param_hi=tuple(hi for _, hi in BOUNDS.values()), t_max=t_max)
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=steps, batch=8, lr=lr, progress=False,
                                                         seed=seed), scales)
    t = None
    if every:
        P, T, F = _arrays(val)
        t = Tournament(grid, trainer.model, lambda: trainer.rel_l2(P, T, F), optimizer=trainer.optimizer,
                       config=TournamentConfig(every=every, seed=pairing_seed))
        trainer.hooks.append(t)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    trainer.fit(lambda step: [pool[i] for i in rng.integers(len(pool), size=8)], steps)
    took = time.perf_counter() - t0
    score = trainer.rel_l2(*_arrays(test))
    trainer.close()
    return t, score, took


def main(args, emit) -> None:
    import torch
    from mpi4py import MPI

    from hpcml.grid import ProcessGrid

    world = MPI.COMM_WORLD
    k = world.Get_size()
    scales = [float(x) for x in args.lrs.split(",")][:k - 1]
    scales += [1.0] * (k - 1 - len(scales)) + [args.bad_lr]
    torch.set_num_threads(1)
    sims = simulate(k * (TRAIN_SIMS + VAL_SIMS) + TEST_SIMS, args.seed)  # the same on every rank
    t_max = max(s.t for sim in sims for s in sim)
    grid = ProcessGrid(pop=k)
    grid.init_torch()
    m = grid.member
    mine = [s for sim in sims[m:k * TRAIN_SIMS:k] for s in sim]  # member m's own simulations
    val = [s for sim in sims[k * TRAIN_SIMS + m:k * (TRAIN_SIMS + VAL_SIMS):k] for s in sim]
    test = [s for sim in sims[k * (TRAIN_SIMS + VAL_SIMS):] for s in sim]
    lr = args.lr * scales[m]
    results = {}
    for mode in ("ltfb", "independent"):
        t, score, took = _train(grid, mine, val, test, steps=args.steps, lr=lr, seed=args.seed + m, t_max=t_max,
                                every=args.every if mode == "ltfb" else None, pairing_seed=args.seed)
        results[mode] = {"tests": grid.pop_comm.allgather(score), "seconds": max(grid.pop_comm.allgather(took)),
                         "kept": grid.pop_comm.allgather([o.kept for o in t.history] if t else [])}
    single = None
    if m == 0:  # member 0's configuration, K times the steps on every member's simulations
        everyone = [s for sim in sims[:k * TRAIN_SIMS] for s in sim]
        _, score, took = _train(grid, everyone, [], test, steps=k * args.steps, lr=lr, seed=args.seed, t_max=t_max,
                                every=None)
        single = {"test": score, "seconds": took}
    single = world.bcast(single)
    if world.Get_rank() != 0:
        return
    bad = k - 1
    replaced = next((i + 1 for i, kept in enumerate(results["ltfb"]["kept"][bad]) if kept == "partner"), None)
    rows = [{"model": "heat", "mode": mode, "member": i, "lr": args.lr * scales[i], "test_rel_l2": v,
             **({"tournaments_kept": results[mode]["kept"][i]} if mode == "ltfb" else {})}
            for mode in results for i, v in enumerate(results[mode]["tests"])]
    rows.append({"model": "heat", "mode": "single", "member": 0, "lr": args.lr * scales[0], "steps": k * args.steps,
                 "test_rel_l2": single["test"]})
    lt, ind = results["ltfb"]["tests"], results["independent"]["tests"]
    last = {"model": "heat", "ltfb_best": min(lt), "independent_best": min(ind), "single_best": single["test"],
            "ltfb_spread": max(lt) - min(lt), "independent_spread": max(ind) - min(ind),
            "bad_member_replaced_at": replaced, "members": k, "steps_per_member": args.steps,
            "tournaments": args.steps // args.every, "metric": "test relative L2",
            "seconds": {mode: results[mode]["seconds"] for mode in results} | {"single": single["seconds"]}}
    emit(rows, last, args.json, lambda r: f"{r['mode']:12s} member {r['member']} lr {r['lr']:.1e}: test rel L2 "
                                          f"{r['test_rel_l2']:.4f}")
