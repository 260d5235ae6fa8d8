"""Tournament training (issue 45): LTFB with K members against K independent trainers and
against one trainer K times longer -- the same total compute, on the same data.

    mpiexec -n 4 python benchmarks/population.py --json            # 4 members of 1 rank
    mpiexec -n 4 python benchmarks/population.py --json --model heat

``--model heat``: the heat surrogate (``FieldTrainer`` with the shipped MLP) on samples of
``kernels.heat2d`` (alpha and the four wall temperatures drawn per simulation; 16 x 16, 10
outputs each): member m trains on its own simulations, scores tournaments on its own held-out
simulations, and every model is scored (relative L2) on test simulations no member saw.

The reference transformer (``tiny``) learns one Markov chain (``SyntheticTokens``, one seed):
member m trains on its own shard of the samples (steps m, m+K, m+2K, ... of the source) and
scores tournaments on its own held-out shard; every model is finally scored on one test set
no member saw. The members' learning rates differ (``--lrs``); one member is deliberately
bad (the last, ``--bad-lr`` times the base rate). LTFB: a tournament every ``--every``
steps (weights and optimizer state swapped, each member keeping what wins on its own
held-out data). PBT: the same members under population-based training (``PBTConfig``
defaults: the worst quarter copies the best quarter and perturbs its learning rate and weight
decay) every ``--every`` steps. Independent: the same members, no tournaments. Single: member 0's
configuration trained ``K x --steps`` steps on the same total samples, on rank 0 alone.

The last JSON line carries ``ltfb_best``, ``independent_best``, ``single_best`` (test loss
of the best model of each), their spreads, and ``bad_member_replaced_at`` (the first
tournament after which the bad member held another member's model; null: never).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Shard:
    """Every ``k``-th global batch of ``source`` from ``first`` (a member's share of the samples)."""

    source: object
    k: int
    first: int

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def global_batch(self, step: int, n: int):
        return self.source.global_batch(self.first + step * self.k, n)


HELD_OUT, TEST = 1_000_000, 2_000_000  # step offsets of the validation shards and the test set


def _train(grid, cfg, train_cfg, source, k: int, member: int, every: int | None, seed: int, how: str = "ltfb",
           history=None):
    from hpcml.parallel import ParallelConfig
    from hpcml.train import Tournament, TournamentConfig
    from hpcml.train.pbt import PBTConfig, PopulationBasedTraining
    from hpcml.train.recipe import build_llm_trainer

    trainer = build_llm_trainer(cfg, train_cfg, ParallelConfig(), grid=grid, data=Shard(source, k, member))
    t = None
    if every:
        val = Shard(source, k, HELD_OUT + member)
        if how == "ltfb":
            t = Tournament(grid, trainer.model, lambda: trainer.evaluate(val, 2), optimizer=trainer.optimizer,
                           config=TournamentConfig(every=every, seed=seed))
        else:
            t = PopulationBasedTraining(grid, trainer, lambda: trainer.evaluate(val, 2),
                                        config=PBTConfig(every=every, seed=seed, history=history))
        trainer.hooks.append(t)
    t0 = time.perf_counter()
    trainer.fit()
    took = time.perf_counter() - t0
    test = trainer.evaluate(Shard(source, 1, TEST), 4)
    return trainer, t, test, took


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="steps of each member")
    ap.add_argument("--every", type=int, default=25, help="steps between tournaments")
    ap.add_argument("--lr", type=float, default=3e-3, help="base learning rate")
    ap.add_argument("--lrs", default="1,0.5,2", help="learning rates of the members but the last, x the base")
    ap.add_argument("--bad-lr", type=float, default=10.0, help="the last member's learning rate, x the base")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pbt-history", help="write the PBT run's history here (then: python -m "
                    "hpcml.train.population_report HISTORY OUT.png)")
    ap.add_argument("--model", choices=("tiny", "heat"), default="tiny")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.model == "heat":
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the kernels and this directory
        from benchmarks.population_heat import main as heat

        return heat(args, emit)

    import torch
    from mpi4py import MPI

    from hpcml.grid import ProcessGrid
    from hpcml.models.transformer import TransformerConfig
    from hpcml.train import SyntheticTokens, TrainConfig

    world = MPI.COMM_WORLD
    k = world.Get_size()
    scales = [float(x) for x in args.lrs.split(",")][:k - 1]
    scales += [1.0] * (k - 1 - len(scales)) + [args.bad_lr]
    cfg = TransformerConfig.preset("tiny")
    source = SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=32, seed=args.seed)
    base = TrainConfig(steps=args.steps, global_batch=8, micro_batch=8, seq_len=32, lr=args.lr, warmup_steps=10,
                       progress=False, seed=args.seed)
    torch.set_num_threads(1)
    grid = ProcessGrid(pop=k)
    grid.init_torch()
    m = grid.member
    mine = replace(base, lr=args.lr * scales[m], seed=args.seed + m)
    rows, results = [], {}
    history = None
    if args.pbt_history:
        history = Path(args.pbt_history)
        if world.Get_rank() == 0:
            history.unlink(missing_ok=True)
    for mode in ("ltfb", "pbt", "independent"):
        trainer, t, test, took = _train(grid, cfg, mine, source, k, m, None if mode == "independent" else args.every,
                                        args.seed, mode, history)
        tests = grid.pop_comm.allgather(test)
        kept = grid.pop_comm.allgather([o.kept if mode == "ltfb" else o.source for o in t.history] if t else [])
        results[mode] = {"tests": tests, "seconds": max(grid.pop_comm.allgather(took)), "kept": kept}
        trainer.close()
    # one trainer, member 0's configuration, K times the steps on the same samples: member 0
    # alone (its collectives are its own), the other members wait
    single = None
    if m == 0:
        trainer, _, single_test, single_s = _train(grid, cfg, replace(mine, steps=k * args.steps), source, 1, 0,
                                                   None, args.seed)
        single = {"test": single_test, "seconds": single_s}
        trainer.close()
    single = world.bcast(single)
    if world.Get_rank() != 0:
        return
    bad = k - 1
    replaced = next((i + 1 for i, kept in enumerate(results["ltfb"]["kept"][bad]) if kept == "partner"), None)
    for mode in ("ltfb", "pbt", "independent"):
        what = "copied_from" if mode == "pbt" else "tournaments_kept"
        for member, test in enumerate(results[mode]["tests"]):
            rows.append({"mode": mode, "member": member, "lr": args.lr * scales[member], "test_loss": test,
                         what: results[mode]["kept"][member] or None})
    rows.append({"mode": "single", "member": 0, "lr": args.lr * scales[0], "steps": k * args.steps,
                 "test_loss": single["test"]})
    lt, ind, pbt = results["ltfb"]["tests"], results["independent"]["tests"], results["pbt"]["tests"]
    last = {"ltfb_best": min(lt), "independent_best": min(ind), "single_best": single["test"], "pbt_best": min(pbt),
            "ltfb_spread": max(lt) - min(lt), "independent_spread": max(ind) - min(ind),
            "pbt_spread": max(pbt) - min(pbt),
            "bad_member_replaced_at": replaced, "members": k, "steps_per_member": args.steps,
            "tournaments": args.steps // args.every,
            "seconds": {mode: results[mode]["seconds"] for mode in results} | {"single": single["seconds"]}}
    emit(rows, last, args.json, lambda r: f"{r['mode']:12s} member {r['member']} lr {r['lr']:.1e}: test loss "
                                          f"{r['test_loss']:.4f}")


def emit(rows: list[dict], last: dict, as_json: bool, line) -> None:
    """Every row and then the summary: JSON lines, or a line a row (``line(row)``) and the summary."""
    for r in rows:
        print(json.dumps(r) if as_json else line(r))
    print(json.dumps(last) if as_json else last)


if __name__ == "__main__":
    main()
