"""Bytes across nodes for FSDP, HSDP, hpZ, hpZ + qwZ + qgZ (ZeRO++) and FSDP reducing gradients
in bf16, measured from the collectives and against the planner's count, and what the
quantization and the bf16 reduction do to the loss (issues 46, 42).

    mpiexec -n 4 python benchmarks/zeropp.py --json                  # 2 "nodes" x 2 by the node map
    srun -N 2 --ntasks-per-node 2 python benchmarks/zeropp.py --json --ranks-per-node 0   # real nodes

Each kind trains the same model (``--model``, fp32, synthetic tokens, seed 0) on dp 4. Its
per-step bytes inside and across nodes are counted by the FSDP collectives themselves
(``metrics.jsonl``'s ``dp_bytes_*``) and compared with ``hpcml.plan``'s count for the layout;
FSDP (torch's FSDP2 over every rank: the peer) and ZeRO++ train ``--steps`` steps for the loss
curve. On one host the "network" is loopback, so step times show the cost of the quantization's
arithmetic, not the bytes saved. Last JSON line: ``internode_bytes_fsdp``,
``internode_bytes_zeropp``, ``ratio``, ``loss_rel_diff_200_steps`` (|ZeRO++ - FSDP| / FSDP at
the last step), ``loss_rel_diff_bf16_reduce`` (the same for ``reduce_dtype="bf16"``),
``bf16_reduce_bytes_over_fsdp``, ``hsdp_internode_over_fsdp`` (with ``--micro-batches N``: HSDP
all-reduces across nodes once a step, FSDP reduce-scatters across them each micro-batch),
``planner_max_rel_error`` and per kind ``kinds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = {"fsdp": {}, "hsdp": {"dp_replicate": "node"}, "hpz": {"hpz": True},
         "zeropp": {"hpz": True, "qwz": True, "qgz": True}, "bf16_reduce": {"reduce_dtype": "bf16"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches a step on each rank (gradient accumulation; HSDP then crosses once a step)")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="the node map of a local run (0: the real nodes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    from mpi4py import MPI

    from hpcml.grid import ProcessGrid
    from hpcml.grid.layout import Layout
    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.plan.candidate import PlanLayout
    from hpcml.plan.traffic import dp_bytes
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    node = f"node{rank // args.ranks_per_node}" if args.ranks_per_node else None
    model = TransformerConfig.preset(args.model, max_seq_len=args.seq_len)
    out: dict = {"model": args.model, "ranks": world, "steps": args.steps, "kinds": {}}
    curves = {}
    for name, pkw in KINDS.items():
        steps = args.steps if name in ("fsdp", "zeropp", "bf16_reduce") else 5
        train = TrainConfig(steps=steps, global_batch=args.global_batch,
                            micro_batch=args.global_batch // (world * args.micro_batches), seq_len=args.seq_len,
                            progress=False)
        grid = ProcessGrid(Layout.from_degrees(world, {"dp": world}), node_name=node)
        per_node = len(grid.local_ranks())
        trainer = build_llm_trainer(model, train, ParallelConfig(fsdp=True, **pkw), grid=grid)
        history = trainer.fit()
        trainer.close()
        lay = PlanLayout(model=model, gpus=world, gpu="a100-80gb", seq_len=args.seq_len, global_batch=args.global_batch,
                         micro_batch=train.micro_batch, zero=3, precision="fp32", gpus_per_node=per_node,
                         **{k: (world // per_node if v == "node" else v) for k, v in pkw.items()})
        want = dp_bytes(model, lay, per_node)
        got = {k: history[-1][k] for k in want}
        out["kinds"][name] = {**got, "planned": {k: int(v) for k, v in want.items()},
                              "step_s_median": statistics.median(m["step_s"] for m in history[1:])}
        curves[name] = [m["loss"] for m in history]
    f, z = out["kinds"]["fsdp"], out["kinds"]["zeropp"]

    def sent(kind: dict) -> int:  # a step's bytes to every other rank, inside and across nodes
        return kind["dp_bytes_intra_node"] + kind["dp_bytes_inter_node"]

    errors = [abs(k[b] - k["planned"][b]) / max(1, k["planned"][b]) for k in out["kinds"].values()
              for b in k["planned"]]
    out.update({"loss_curve_every_20": {n: [round(c[i], 4) for i in range(0, len(c), 20)] + [round(c[-1], 4)]
                                        for n, c in curves.items()},
                "micro_batches": args.micro_batches,
                "hsdp_internode_over_fsdp": round(out["kinds"]["hsdp"]["dp_bytes_inter_node"]
                                                  / f["dp_bytes_inter_node"], 4),
                "internode_bytes_fsdp": f["dp_bytes_inter_node"], "internode_bytes_zeropp": z["dp_bytes_inter_node"],
                "ratio": round(z["dp_bytes_inter_node"] / f["dp_bytes_inter_node"], 4),
                "loss_rel_diff_200_steps": abs(curves["zeropp"][-1] - curves["fsdp"][-1]) / curves["fsdp"][-1],
                "loss_rel_diff_bf16_reduce": abs(curves["bf16_reduce"][-1] - curves["fsdp"][-1]) / curves["fsdp"][-1],
                "bf16_reduce_bytes_over_fsdp": round(sent(out["kinds"]["bf16_reduce"]) / sent(f), 4),
                "planner_max_rel_error": max(errors)})
    if rank == 0:
        print(json.dumps(out) if args.json else json.dumps(out, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
