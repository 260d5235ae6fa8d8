"""Long context on the cp axis: plain Ulysses against FPDT (issue 27), side by side in one run.

    python benchmarks/long_context.py --json          # cp 2 (~7 min on the 2-core VM)
    python benchmarks/long_context.py --quick --json  # a check (~1 min)

Per sequence length and mode, one training micro-batch (forward + backward) of a model with a
vocabulary 32x its width (Llama 3's ratio is 31): the bytes saved for backward per layer and
in all (:mod:`hpcml.train.memory`), and the peak RSS the step added (VmHWM after it against
VmRSS before it, rank 0): each point a fresh ``mpiexec`` of its own, so no allocator cache
of another point hides its peak. Then, at one length: tokens/s of Ulysses and of FPDT at the
chunk and at twice it (their steps alternating in one process, the median of the paired
ratios; the headline is the chunk's), and the all-to-all bytes of
a forward + backward from torch's profiler against theory (:func:`hpcml.parallel.ulysses.bytes_per_layer`, twice for
the backward, times the layers). The last JSON line carries ``saved_bytes_growth_16x``
(FPDT's saved bytes per layer at the longest length over the shortest, 16x apart, at a fixed
chunk), ``max_seq_ratio`` (the longest sequence whose saved bytes fit a budget, FPDT over
Ulysses, linear between the measured points around the budget, past the last two where all
are under it; the budget: Ulysses' saved bytes at the second length), the same from peak
RSS (``max_seq_ratio_rss``), ``tokens_per_s_ratio`` and ``a2a_bytes_over_theory``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comm_volume import measure, sent_bytes  # noqa: E402  (the same profiler count as issue 3's figures)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _longest(points: list[tuple[int, float]], budget: float) -> tuple[float | None, str]:
    """The sequence length at which the measured bytes reach ``budget``: linear between the two
    points around it, or past the last two when every point is under it ("extrapolated");
    None where the bytes do not grow there."""
    points = sorted(points)
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 >= budget or (s1, v1) == points[-1]:
            if v1 <= v0:
                return None, "not growing"
            return s0 + (budget - v0) * (s1 - s0) / (v1 - v0), "interpolated" if v1 >= budget else "extrapolated"
    return None, "one point"


def _ratio(fpdt: tuple[float | None, str], ulysses: tuple[float | None, str]) -> float | None:
    return fpdt[0] / ulysses[0] if fpdt[0] and ulysses[0] else None


def _build(mode: str, seq: int, chunk: int, model_kw: dict):
    from mpi4py import MPI

    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    mc = TransformerConfig.preset("tiny", max_seq_len=seq, **model_kw)
    tc = TrainConfig(steps=1, global_batch=1, micro_batch=1, seq_len=seq, progress=False)
    pcfg = ParallelConfig(fpdt_chunk=chunk if mode == "fpdt" else 0)
    trainer = build_llm_trainer(mc, tc, pcfg, cp=MPI.COMM_WORLD.Get_size())
    return trainer, mc


def _step(trainer, x, y) -> float:
    t0 = time.perf_counter()
    trainer.model.forward_backward(x, y, 1)
    torch.distributed.barrier()
    for p in trainer.model.parameters():
        p.grad = None
    return time.perf_counter() - t0


def run_timing(seq: int, chunk: int, model_kw: dict, rounds: int) -> dict:
    """Ulysses and FPDT at ``chunk`` and at twice it, in one process, their steps alternating
    (the order rotating each round), so the VM's drift hits all alike: tokens/s of each (medians)
    and the median of each FPDT's paired ratios to the Ulysses step of its round."""
    from mpi4py import MPI

    local = seq // MPI.COMM_WORLD.Get_size()
    modes = {"ulysses": 0, "fpdt": chunk, f"fpdt{2 * chunk}": 2 * chunk}
    modes = {m: c for m, c in modes.items() if not c or local % c == 0}
    trainers = {m: _build("fpdt" if c else "ulysses", seq, c, model_kw)[0] for m, c in modes.items()}
    batches = {m: t.local_batch(0) for m, t in trainers.items()}
    times: dict[str, list[float]] = {m: [] for m in trainers}
    order = list(trainers)
    for r in range(rounds + 1):
        for m in order[r % len(order):] + order[:r % len(order)]:
            dt = _step(trainers[m], *batches[m])
            if r:  # the first round warms up
                times[m].append(dt)
    ratios = {m: [u / f for u, f in zip(times["ulysses"], times[m])] for m in times if m != "ulysses"}
    for t in trainers.values():
        t.close()
    return {"seq": seq, "rounds": rounds, "chunks": modes,
            "tokens_per_s": {m: seq / statistics.median(ts) for m, ts in times.items()},
            "tokens_per_s_ratio": {m: statistics.median(r) for m, r in ratios.items()},
            "ratio_range": {m: [min(r), max(r)] for m, r in ratios.items()},
            "step_s": times}


def run_point(mode: str, seq: int, chunk: int, model_kw: dict, a2a: bool = False) -> dict:
    from mpi4py import MPI

    from hpcml.parallel.ulysses import bytes_per_layer
    from hpcml.train import memory

    world = MPI.COMM_WORLD.Get_size()
    trainer, mc = _build(mode, seq, chunk, model_kw)
    model = trainer.model
    x, y = trainer.local_batch(0)
    account = memory.account_of(model)
    try:  # VmHWM := VmRSS now: the peak read after the step is the step's, not the build's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    rss0 = _status_kib("VmRSS")
    with account:
        model.forward_backward(x, y, 1)
    peak = _status_kib("VmHWM") - rss0
    counts = account.take()[0]
    for p in model.parameters():
        p.grad = None
    out = {"mode": mode, "seq": seq, "chunk": chunk if mode == "fpdt" else None, "cp": world,
           "saved_bytes_per_layer": max(v for k, v in counts.items() if k != memory.OUTSIDE),
           "saved_bytes": sum(counts.values()), "saved_bytes_outside_layers": counts.get(memory.OUTSIDE, 0),
           "peak_rss_added_bytes": peak * 1024}
    if a2a and world > 1:
        calls = measure(lambda: model.forward_backward(x, y, 1))
        sent = sum(sent_bytes("all_to_all", n, world) for n in calls["all_to_all"])
        theory = 2 * mc.n_layers * bytes_per_layer(1, seq, mc.n_heads, mc.kv_heads, mc.head_dim, world)
        out.update({"a2a_calls": len(calls["all_to_all"]), "a2a_bytes": sent, "a2a_theory_bytes": theory,
                    "a2a_bytes_over_theory": sent / theory})
    trainer.close()
    return out


def point_main(mode: str, seq: int, chunk: int, timed: int, a2a: bool) -> None:
    from mpi4py import MPI

    row = run_timing(seq, chunk, MODEL, timed) if mode == "timing" else run_point(mode, seq, chunk, MODEL, a2a=a2a)
    if MPI.COMM_WORLD.rank == 0:
        print("POINT " + json.dumps(row), flush=True)


MODEL = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "vocab_size": 8192}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1k-4k positions, fewer timed steps")
    p.add_argument("--cp", type=int, default=2, help="ranks (mpiexec -n)")
    p.add_argument("--chunk", type=int, default=256, help="FPDT positions per chunk per rank")
    p.add_argument("--timed", type=int, default=9, help="timed rounds (a step of each mode) for tokens/s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--point", nargs=2, metavar=("MODE", "SEQ"), help=argparse.SUPPRESS)
    p.add_argument("--a2a", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.point:
        point_main(args.point[0], int(args.point[1]), args.chunk, args.timed, args.a2a)
        return
    seqs = [1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384]
    timed_at = 2048 if args.quick else 4096
    timed = 3 if args.quick else args.timed
    if seqs[0] // args.cp < 2 * args.chunk:
        sys.exit(f"long_context: --chunk {args.chunk} leaves fewer than 2 chunks per rank at {seqs[0]} positions")
    rows = []
    points = [(mode, seq) for mode in ("ulysses", "fpdt") for seq in seqs] + [("timing", timed_at)]
    for mode, seq in points:
        cmd = ["mpiexec", "-n", str(args.cp), sys.executable, os.path.abspath(__file__), "--point", mode, str(seq),
               "--chunk", str(args.chunk), "--timed", str(timed)]
        a2a = ["--a2a"] if seq == timed_at and mode != "timing" else []
        run = subprocess.run(cmd + a2a, capture_output=True, text=True, timeout=1800)
        lines = [ln[6:] for ln in run.stdout.splitlines() if ln.startswith("POINT ")]
        if run.returncode or not lines:
            sys.exit(f"long_context: {' '.join(cmd)} failed ({run.returncode}): {run.stderr[-2000:]}")
        rows.append(json.loads(lines[-1]))
        print(json.dumps(rows[-1]) if args.json else rows[-1], flush=True)
    timing = rows.pop()
    by = {m: [r for r in rows if r["mode"] == m] for m in ("ulysses", "fpdt")}
    budget = by["ulysses"][1]["saved_bytes"]
    rss_budget = by["ulysses"][1]["peak_rss_added_bytes"]
    t = {m: next((r for r in by[m] if "a2a_bytes" in r), {}) for m in by}  # (none on cp 1)
    longest = {m: _longest([(r["seq"], r["saved_bytes"]) for r in by[m]], budget) for m in by}
    longest_rss = {m: _longest([(r["seq"], r["peak_rss_added_bytes"]) for r in by[m]], rss_budget) for m in by}
    sixteen = seqs[-1] == 16 * seqs[0]
    summary = {
        "benchmark": "long_context", "cp": args.cp, "chunk": args.chunk, "model": MODEL, "seqs": seqs,
        "saved_bytes_growth_16x": (by["fpdt"][-1]["saved_bytes_per_layer"] / by["fpdt"][0]["saved_bytes_per_layer"]
                                   if sixteen else None),
        "ulysses_saved_bytes_growth_16x": (by["ulysses"][-1]["saved_bytes_per_layer"]
                                           / by["ulysses"][0]["saved_bytes_per_layer"] if sixteen else None),
        "saved_bytes_per_layer_ratio": {r["seq"]: r["saved_bytes_per_layer"] / u["saved_bytes_per_layer"]
                                        for r, u in zip(by["fpdt"], by["ulysses"])},
        "saved_bytes_ratio": {r["seq"]: r["saved_bytes"] / u["saved_bytes"] for r, u in zip(by["fpdt"], by["ulysses"])},
        "budget_bytes": budget,
        "max_seq_ratio": _ratio(longest["fpdt"], longest["ulysses"]),
        "max_seq": {m: {"seq": v[0], "how": v[1]} for m, v in longest.items()},
        "max_seq_ratio_rss": _ratio(longest_rss["fpdt"], longest_rss["ulysses"]),
        "max_seq_rss": {m: {"seq": v[0], "how": v[1]} for m, v in longest_rss.items()},
        "tokens_per_s_seq": timing["seq"],
        "tokens_per_s": timing["tokens_per_s"],
        "tokens_per_s_ratio": timing["tokens_per_s_ratio"]["fpdt"],
        "tokens_per_s_ratio_range": timing["ratio_range"]["fpdt"],
        "tokens_per_s_ratio_by_chunk": {timing["chunks"][m]: r for m, r in timing["tokens_per_s_ratio"].items()},
        "a2a_bytes_over_theory": t["fpdt"].get("a2a_bytes_over_theory"),
        "a2a_bytes_over_theory_ulysses": t["ulysses"].get("a2a_bytes_over_theory"),
        "a2a_calls": {m: t[m].get("a2a_calls") for m in t},
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
