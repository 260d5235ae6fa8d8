"""The field surrogates' trainer on the shared loop (hpcml.train.FieldTrainer: one flat
gradient all-reduce + one 3-element all-reduce per step, or FSDP2) against the peer, a
plain PyTorch loop with torch's DistributedDataParallel, and the compute alone (the same
forward/backward/step on one rank with no communication), on 1 and 2 ranks.

    python benchmarks/field_trainer.py --json
    python benchmarks/field_trainer.py --steps 40 --hidden 512 --json

The driver starts its workers with mpiexec and never imports MPI itself; each rank runs
one torch thread, so 2 ranks on 2 cores do not oversubscribe them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args) -> None:
    import numpy as np
    import torch
    from torch import nn

    torch.set_num_threads(1)
    from hpcml.grid import ProcessGrid
    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.stream.buffer import Sample
    from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer

    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    rng = np.random.default_rng(grid.rank)
    nx = ny = args.nx
    batch = [Sample(sim=i, step=i, t=float(rng.random()), params=rng.random(4).astype(np.float32),
                    fields=rng.random((1, nx, ny)).astype(np.float32)) for i in range(args.batch)]
    scales = FieldScales(param_lo=(0.0,) * 4, param_hi=(1.0,) * 4, t_max=1.0)
    cfg = MLPSurrogateConfig(n_params=4, nx=nx, ny=ny, hidden=args.hidden, depth=3)
    rows = {}

    def timed(step) -> float:
        for _ in range(3):  # warm-up
            step()
        grid.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        grid.comm.Barrier()
        return (time.perf_counter() - t0) / args.steps

    for name, fsdp in (("hpcml", False), ("hpcml_fsdp", True)):
        torch.manual_seed(0)
        trainer = FieldTrainer(MLPSurrogate(cfg), grid, FieldTrainConfig(steps=10**6, batch=args.batch,
                                                                          progress=False),
                               scales, parallel=ParallelConfig(fsdp=fsdp))
        rows[name] = timed(lambda: trainer.train_step(batch))

    torch.manual_seed(0)
    module = MLPSurrogate(cfg)
    ddp = nn.parallel.DistributedDataParallel(module) if grid.layout.world_size > 1 else module
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)
    (p, t), y = trainer.inputs(batch)

    def plain():
        loss = nn.functional.mse_loss(ddp(p, t), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().reshape(1)
        if grid.layout.world_size > 1:
            torch.distributed.all_reduce(mean)  # the loss for the log, as a trainer reports it
    rows["torch_ddp"] = timed(plain)

    def compute():
        loss = nn.functional.mse_loss(module(p, t), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows["compute_only"] = timed(compute)
    if grid.rank == 0:
        print(json.dumps({"ranks": grid.layout.world_size, "params": sum(x.numel() for x in module.parameters()),
                          **{f"{k}_step_s": v for k, v in rows.items()}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--nx", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.dirname(HERE)}
    out = []
    for n in (1, 2):
        cmd = ["mpiexec", "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--steps",
               str(args.steps), "--batch", str(args.batch), "--hidden", str(args.hidden), "--nx", str(args.nx)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if res.returncode:
            sys.exit(f"worker on {n} rank(s) failed: {res.stderr[-2000:]}")
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row["hpcml_over_torch_ddp"] = row["hpcml_step_s"] / row["torch_ddp_step_s"]
        row["hpcml_over_compute"] = row["hpcml_step_s"] / row["compute_only_step_s"]
        out.append(row)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in out:
            print(f"{r['ranks']} rank(s), {r['params']} params: hpcml {r['hpcml_step_s'] * 1e3:.2f} ms/step "
                  f"(fsdp {r['hpcml_fsdp_step_s'] * 1e3:.2f}), torch DDP {r['torch_ddp_step_s'] * 1e3:.2f}, "
                  f"compute only {r['compute_only_step_s'] * 1e3:.2f}: hpcml/DDP {r['hpcml_over_torch_ddp']:.2f}x, "
                  f"hpcml/compute {r['hpcml_over_compute']:.2f}x")


if __name__ == "__main__":
    main()
