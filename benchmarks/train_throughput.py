"""Training throughput of the tiny and small transformers on 1 and 2 ranks, with the peer
(the same model in a plain PyTorch eager loop) and the physical limit (this machine's
measured fp32 GEMM rate) side by side, and the data-parallel weak-scaling efficiency.

    python benchmarks/train_throughput.py --json                 # drives everything below
    python benchmarks/train_throughput.py --models tiny --steps 5 --json

The driver starts its workers with mpiexec (1 and 2 ranks) and never imports MPI itself.
Every rank runs ``--threads`` torch threads (default 1), so 2 ranks on 2 cores do not
oversubscribe them and the scaling figure measures the parallelism, not the contention.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def gemm_flops(n: int = 1024, repeat: int = 5) -> float:
    """Best fp32 matmul FLOP/s on this process's threads: the compute ceiling here."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def shapes(model: str) -> dict:
    # per-rank batch fixed (weak scaling); small uses a shorter sequence to keep CPU steps to seconds
    return {"tiny": {"seq_len": 64, "per_rank_batch": 8, "micro_batch": 4},
            "small": {"seq_len": 128, "per_rank_batch": 2, "micro_batch": 2}}[model]


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from mpi4py import MPI

    from hpcml.models.transformer import Transformer, TransformerConfig, cross_entropy
    from hpcml.parallel import ParallelConfig
    from hpcml.train import SyntheticTokens, TrainConfig
    from hpcml.train.loop import make_optimizer
    from hpcml.train.recipe import build_llm_trainer

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    results = []
    for name in args.models:
        sh = shapes(name)
        mc = TransformerConfig.preset(name, max_seq_len=max(sh["seq_len"], 64))
        tc = TrainConfig(steps=args.steps + 1, global_batch=sh["per_rank_batch"] * world, micro_batch=sh["micro_batch"],
                         seq_len=sh["seq_len"], progress=False, warmup_steps=1)
        trainer = build_llm_trainer(mc, tc, ParallelConfig(fsdp=args.fsdp), dp=world)
        trainer.fit(1)  # warm-up step, not timed
        comm.Barrier()
        t0 = time.perf_counter()
        trainer.fit(args.steps + 1)
        comm.Barrier()
        dt = (time.perf_counter() - t0) / args.steps
        tokens = tc.global_batch * tc.seq_len
        row = {"model": name, "ranks": world, "params": mc.num_params(), "tokens_per_step": tokens,
               "hpcml_step_s": dt, "hpcml_tokens_per_s": tokens / dt,
               "model_flops_per_s": mc.flops_per_token(tc.seq_len) * tokens / dt}
        import torch.distributed as dist

        dist.destroy_process_group()
        if world == 1:  # the peer: plain eager PyTorch, same model, batch and optimizer
            torch.manual_seed(0)
            model = Transformer(mc)
            opt, _ = make_optimizer(model.parameters(), tc)
            data = SyntheticTokens(vocab_size=mc.vocab_size, seq_len=tc.seq_len)
            n_micro = tc.global_batch // tc.micro_batch

            def eager_step(step):
                tok = data.global_batch(step, tc.global_batch)
                for x, y in zip(tok[:, :-1].chunk(n_micro), tok[:, 1:].chunk(n_micro)):
                    (cross_entropy(model(x), y) / n_micro).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            eager_step(0)
            t0 = time.perf_counter()
            for s in range(args.steps):
                eager_step(s + 1)
            row["eager_step_s"] = (time.perf_counter() - t0) / args.steps
            row["hpcml_vs_eager"] = row["eager_step_s"] / dt
        results.append(row)
    if comm.rank == 0:
        print(json.dumps({"rows": results, "gemm_flops_per_rank": gemm_flops()}))


def drive(args) -> None:
    rows, gemm = [], {}
    for n in (1, 2):
        cmd = ["mpiexec", "-n", str(n), sys.executable, __file__, "--worker", "--steps", str(args.steps),
               "--threads", str(args.threads), "--models", *args.models] + (["--fsdp"] if args.fsdp else [])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode:
            sys.exit(f"worker failed ({' '.join(cmd[:3])}): {out.stderr[-2000:]}")
        data = json.loads(out.stdout.strip().splitlines()[-1])
        rows += data["rows"]
        gemm[n] = data["gemm_flops_per_rank"]
    summary = []
    for name in args.models:
        one = next(r for r in rows if r["model"] == name and r["ranks"] == 1)
        two = next(r for r in rows if r["model"] == name and r["ranks"] == 2)
        summary.append({
            "model": name, "params": one["params"],
            "tokens_per_s_1rank": one["hpcml_tokens_per_s"], "tokens_per_s_2ranks": two["hpcml_tokens_per_s"],
            "eager_tokens_per_s_1rank": one["tokens_per_step"] / one["eager_step_s"],
            "hpcml_vs_eager_1rank": one["hpcml_vs_eager"],
            "dp_weak_scaling_efficiency": two["hpcml_tokens_per_s"] / (2 * one["hpcml_tokens_per_s"]),
            "model_gflops_per_rank_1rank": one["model_flops_per_s"] / 1e9,
            "fraction_of_measured_gemm_1rank": one["model_flops_per_s"] / gemm[1],
            "model_gflops_per_rank_2ranks": two["model_flops_per_s"] / 2 / 1e9,
            "fraction_of_measured_gemm_2ranks": two["model_flops_per_s"] / 2 / gemm[2],
        })
    result = {"benchmark": "train_throughput", "threads_per_rank": args.threads, "steps": args.steps,
              "dp": "fsdp" if args.fsdp else "ddp", "gemm_gflops_per_rank": {k: v / 1e9 for k, v in gemm.items()},
              "summary": summary, "rows": rows}
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over dp instead of DDP")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
