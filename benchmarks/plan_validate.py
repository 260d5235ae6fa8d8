"""The planner against real runs on this machine, and its speed.

1. CPU runs of ``workflows/llm_pretrain.py`` (preset ``mini``) at 1, 2 and 4 ranks over 24
   layouts: measured step time (median of 11 steps after two; the fastest of three rounds,
   the second in reverse order) against the planner's
   prediction for this machine's CPU, measured first (``hpcml.plan.cpu``: one core's GEMM rate
   against rows, memory bandwidth, a block's cost beyond its matmuls; gloo's all-reduce bandwidth
   and latency and each parallelism's fixed cost per block at 1, 2 and 4 ranks, probed with the
   ranks in place on a model too small to compute). Reported: Spearman's rank correlation of predicted against
   measured step times (the issue's bar: >= 0.8), the ratio of each pair, and the same
   correlation between the rounds themselves (how much of the ranking the VM's noise leaves).
2. The published GPU tables (``hpcml.plan.published``): per table, the share of rows whose
   fit/OOM outcome agrees and the share predicted within 15% in tokens/s, and every error.
3. A search of >= 10,000 layouts (llama3-70b on 1024 Frontier GCDs), timed as a user runs it:
   ``hpcml plan`` in a fresh process, imports included; and the issue-42 case, llama3-405b on
   16,384 H100s at 8K tokens, for each framework's option set (bar: < 2 s wall), and two
   mixtures of experts (Mixtral-8x7B, GRIN-MoE) under torchtitan's options, the most layouts.

Reproduce: ``python benchmarks/plan_validate.py --json`` (~25 minutes; ``--quick``: 8 layouts;
``--search``: the searches alone, ~30 s; ``--calibrate``: ``hpcml plan calibrate`` on 5 measured
layouts, checked on 10 others, ~12 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SEQ, BATCH, STEPS, ROUNDS = 128, 16, 13, 3

#: (ranks, llm_pretrain.py layout arguments)
LAYOUTS = [
    (1, ["--micro-batch", "16"]), (1, ["--micro-batch", "4"]), (1, ["--micro-batch", "1"]),
    (1, ["--micro-batch", "4", "--activation-checkpointing"]),
    (2, ["--micro-batch", "8"]), (2, ["--micro-batch", "2"]), (2, ["--fsdp", "--micro-batch", "8"]),
    (2, ["--fsdp", "--zero2", "--micro-batch", "4"]), (2, ["--tp", "2", "--micro-batch", "8"]),
    (2, ["--tp", "2", "--sequence-parallel", "--micro-batch", "4"]), (2, ["--pp", "2", "--micro-batch", "2"]),
    (2, ["--pp", "2", "--schedule", "gpipe", "--micro-batch", "4"]), (2, ["--cp", "2", "--micro-batch", "8"]),
    (2, ["--micro-batch", "4", "--activation-checkpointing"]),
    (4, ["--micro-batch", "4"]), (4, ["--fsdp", "--micro-batch", "2"]), (4, ["--tp", "2", "--micro-batch", "4"]),
    (4, ["--tp", "4", "--micro-batch", "8"]), (4, ["--pp", "2", "--micro-batch", "2"]),
    (4, ["--pp", "4", "--micro-batch", "2"]), (4, ["--cp", "2", "--micro-batch", "4"]),
    (4, ["--tp", "2", "--pp", "2", "--micro-batch", "2"]), (4, ["--cp", "4", "--micro-batch", "4"]),
    (4, ["--pp", "2", "--schedule", "interleaved1f1b", "--micro-batch", "2"]),
]
QUICK = [0, 3, 4, 8, 10, 14, 17, 19]


PROBE = {"dp": ({}, {}), "tp": ({"tp": 2}, {}), "sp": ({"tp": 2}, {"sequence_parallel": True}),
         "cp": ({"cp": 2}, {}), "fsdp": ({}, {"fsdp": True})}


def probe() -> None:
    """Under mpiexec (or alone): the fixed costs of this machine's software per block, from the
    same trainer on a model too small to compute anything (dim 32, 16 tokens): a step's time
    with 5 blocks minus with 1, over 4 (the fastest of 12 steps; the 1-block model timed before
    and after, the faster kept: the VM's noise only ever adds time), for DDP, tp, tp with sequence
    parallelism, Ulysses and FSDP; and gloo's all-reduce of 4 MiB (bandwidth) and 4 bytes (latency)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcml.grid import ProcessGrid
    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    n = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid()
    grid.init_torch()
    out: dict = {"ranks": n}
    for name, (degrees, pkw) in PROBE.items() if n > 1 else [("dp", ({}, {}))]:
        times: dict[int, float] = {}
        for layers in (1, 5, 1):  # the 1-block model before and after: a slow start would make 5 - 1 negative
            cfg = TransformerConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                    max_seq_len=16)
            dp = n // math.prod(degrees.values()) if degrees else n
            tr = build_llm_trainer(cfg, TrainConfig(steps=16, global_batch=dp, micro_batch=1, seq_len=16,
                                                    progress=False), ParallelConfig(**pkw), **degrees)
            hist = tr.fit()
            times[layers] = min(times.get(layers, math.inf), min(h["step_s"] for h in hist[4:]))
            tr.close()
        out[name] = {"block_s": max(0.0, (times[5] - times[1]) / 4), "step_1block_s": times[1]}
    if n > 1:
        big, small = torch.ones(1 << 20), torch.ones(1)
        for t in (big, small):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(big)
        t_big = (time.perf_counter() - t0) / 5
        t0 = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(small)
        lat = (time.perf_counter() - t0) / 20
        out["busbw_gbps"] = 2 * (n - 1) / n * big.numel() * 4 / max(1e-9, t_big - lat) / 1e9
        out["latency_s"] = lat / (n - 1)
        dist.barrier()
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(out))


def _mpi(n: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ([PY] if n == 1 else ["mpiexec", "-n", str(n), PY]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _spearman(a: list[float], b: list[float]) -> float:
    from hpcml.plan.fit import spearman

    return spearman(a, b)


def _plan_layout(ranks: int, args: list[str]):
    from hpcml.plan.candidate import PlanLayout

    def val(flag, default):
        return int(args[args.index(flag) + 1]) if flag in args else default
    zero = (2 if "--zero2" in args else 3) if "--fsdp" in args else 0
    schedule = args[args.index("--schedule") + 1] if "--schedule" in args else "1f1b"
    return PlanLayout(model="mini", gpus=ranks, gpu=f"cpu-x{ranks}", seq_len=SEQ, global_batch=BATCH,
                      tp=val("--tp", 1), pp=val("--pp", 1), cp=val("--cp", 1), micro_batch=val("--micro-batch", 1),
                      zero=zero, sequence_parallel="--sequence-parallel" in args, schedule=schedule,
                      recompute="full" if "--activation-checkpointing" in args else "none", precision="fp32")


def measure_layouts(indices: list[int], rounds: int = ROUNDS, keep: Path | None = None) -> dict[int, list[float]]:
    """Step times of ``LAYOUTS[indices]`` (median of the steps after two), ``rounds`` times,
    every other round backwards (a slow spell of the VM hits both ends); with ``keep``, the run
    directory of each layout's fastest round is left there as ``keep/<index>``."""
    import shutil

    measured: dict[int, list[float]] = {i: [] for i in indices}
    for r in range(rounds):
        for i in (indices if r % 2 == 0 else indices[::-1]):
            ranks, args = LAYOUTS[i]
            with tempfile.TemporaryDirectory() as run_dir:
                out = _mpi(ranks, ["workflows/llm_pretrain.py", "--model", "mini", "--seq-len", str(SEQ),
                                   "--global-batch", str(BATCH), "--steps", str(STEPS), "--run-dir", run_dir,
                                   "--no-progress", *args])
                if out.returncode:
                    raise SystemExit(f"llm_pretrain {ranks} ranks {args} failed:\n{out.stderr[-3000:]}")
                steps = [json.loads(x)["step_s"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
                measured[i].append(statistics.median(steps[2:]))
                if keep is not None and measured[i][-1] == min(measured[i]):
                    shutil.rmtree(keep / str(i), ignore_errors=True)
                    shutil.copytree(run_dir, keep / str(i))
        print(f"round {r + 1} of {rounds} measured", file=sys.stderr)
    return measured


def cpu_runs(indices: list[int]) -> dict:
    from hpcml.plan.cpu import cpu_device, measure
    from hpcml.plan.predict import evaluate, load_model

    facts = measure()
    comm = {}
    for n in sorted({LAYOUTS[i][0] for i in indices}):
        out = _mpi(n, [str(Path(__file__)), "--probe"], timeout=600)
        if out.returncode:
            raise SystemExit(f"probe at {n} ranks failed:\n{out.stderr[-2000:]}")
        comm[n] = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = load_model("mini")
    measured = measure_layouts(indices)
    rows = []
    for i in indices:
        ranks, args = LAYOUTS[i]
        dev, c = cpu_device(facts, ranks, comm[ranks])
        pred = evaluate(cfg, dev, c, _plan_layout(ranks, args))
        best = min(measured[i])
        rows.append({"ranks": ranks, "args": " ".join(args), "measured_step_s": round(best, 4),
                     "measured_rounds_s": [round(x, 4) for x in measured[i]],
                     "predicted_step_s": round(pred.step_s, 4), "ratio": round(pred.step_s / best, 3),
                     "predicted_parts_s": {k: round(v, 4) for k, v in pred.parts_s.items()}})
        print(f"{ranks} ranks {' '.join(args):48s} measured {best:.3f} s {measured[i]} predicted {pred.step_s:.3f} s",
              file=sys.stderr)
    rho = _spearman([r["measured_step_s"] for r in rows], [r["predicted_step_s"] for r in rows])
    ratios = [r["ratio"] for r in rows]
    # the measurement against itself: one round's ranking against another's (what noise leaves to agree on)
    rounds = [[measured[i][k] for i in indices] for k in range(ROUNDS)]
    repeat = [round(_spearman(rounds[a], rounds[b]), 3) for a in range(ROUNDS) for b in range(a + 1, ROUNDS)]
    return {"cpu": facts.__dict__, "comm": comm, "layouts": rows, "spearman": round(rho, 3),
            "rounds_spearman": repeat,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


#: issue 42 item 4: five layouts to calibrate on, one per axis over 1, 2 and 4 ranks (many micro-
#: batches on one rank, tp, FSDP, cp, pp), and ten others to predict
CAL_FIT = [2, 8, 15, 20, 18]
CAL_CHECK = [0, 3, 4, 6, 7, 9, 10, 12, 16, 21]


def calibrate_runs(rounds: int = 2, runs_dir: str | None = None, reuse: bool = False) -> dict:
    """Measure the 15 layouts; ``hpcml plan calibrate`` on the run directories of ``CAL_FIT``
    (as a user runs it, this machine's CPU measured by it); ``hpcml plan --device-file`` on the
    others' layouts with their measured step times: median |error| and Spearman. ``runs_dir``:
    the fastest round's run directory of each layout is kept there (``measured.json`` their
    rounds); with ``reuse``, what an earlier run kept there is calibrated on again, nothing measured."""
    with tempfile.TemporaryDirectory() as tmp:
        keep = Path(runs_dir or tmp)
        keep.mkdir(parents=True, exist_ok=True)
        if reuse:
            measured = {int(k): v for k, v in json.loads((keep / "measured.json").read_text()).items()}
        else:
            measured = measure_layouts(CAL_FIT + CAL_CHECK, rounds, keep=keep)
            (keep / "measured.json").write_text(json.dumps(measured))
        dev = keep / "this-cpu.json"
        cal = subprocess.run([PY, "-m", "hpcml.cli", "plan", "calibrate", *(str(keep / str(i)) for i in CAL_FIT),
                              "--cpu", "--model", "mini", "--out", str(dev), "--json"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        if cal.returncode:
            raise SystemExit(f"hpcml plan calibrate failed:\n{cal.stderr[-3000:]}")
        lines = keep / "check.jsonl"
        lines.write_text("".join(json.dumps({**{k: v for k, v in _plan_layout(*LAYOUTS[i]).to_dict().items()
                                                if k != "gpu"},
                                             "step_s": min(measured[i])}) + "\n" for i in CAL_CHECK))
        pred = subprocess.run([PY, "-m", "hpcml.cli", "plan", "--device-file", str(dev), "--layouts", str(lines),
                               "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        if pred.returncode:
            raise SystemExit(f"hpcml plan --device-file failed:\n{pred.stdout[-2000:]}{pred.stderr[-2000:]}")
        got = [json.loads(x) for x in pred.stdout.splitlines()]
        device_file = json.loads(dev.read_text())
    report = json.loads(cal.stdout)
    rows = [{"ranks": LAYOUTS[i][0], "args": " ".join(LAYOUTS[i][1]), "measured_step_s": r["measured_step_s"],
             "measured_rounds_s": [round(x, 4) for x in measured[i]], "predicted_step_s": r["step_s"],
             "error": r["step_error"]} for i, r in zip(CAL_CHECK, got)]
    errs = [abs(r["error"]) for r in rows]
    return {"fitted_on": [" ".join(map(str, (LAYOUTS[i][0], "ranks", *LAYOUTS[i][1]))) for i in CAL_FIT],
            "calibration": report, "device_file": device_file, "checked": rows,
            "median_abs_error": round(statistics.median(errs), 4),
            "p90_abs_error": round(sorted(errs)[int(0.9 * (len(errs) - 1))], 4),
            "spearman": round(_spearman([r["measured_step_s"] for r in rows],
                                        [r["predicted_step_s"] for r in rows]), 3)}


def published_tables(as_framework: str | None = None) -> dict:
    """Every table scored as its file plans it; ``as_framework``: each row re-priced as that
    framework runs it (a row it refuses drops out), the rest of its layout as published."""
    from dataclasses import replace

    from hpcml.errors import ConfigError
    from hpcml.plan.published import CALIBRATION, DEVICE_CALIBRATION, STAGED_CALIBRATION, TABLES
    from hpcml.plan.scoring import score_table

    def recast(cases):
        if as_framework is None:
            return cases
        out = []
        for case in cases:
            try:
                out.append(replace(case, layout=replace(case.layout, framework=as_framework)))
            except ConfigError:
                continue
        return out

    fitted = {t: "family constants" for ts in CALIBRATION.values() for t in ts}
    fitted |= {t: "the staged constants (attn_eff_fused, compiled_passes)" for ts in STAGED_CALIBRATION.values()
               for t in ts}
    fitted |= {t: f"{d}'s sustained share of its peak" for d, ts in DEVICE_CALIBRATION.items() for t in ts}
    out = {}
    for name, make in TABLES.items():
        cases = recast(make())
        if not cases:
            continue
        sc = score_table(cases)
        rows = [{"row": case.label, "published_fits": case.fits, "predicted_fits": p.fits,
                 "tokens_per_gpu_published": case.tokens_per_gpu and round(case.tokens_per_gpu, 1),
                 "tokens_per_gpu_predicted": round(p.tokens_per_s / case.layout.gpus, 1),
                 "error": None if err is None else round(err, 3),
                 "mfu_predicted": round(p.mfu, 4), "memory_gib_published": case.memory_gib,
                 "memory_gib_predicted": round(p.memory_gib.get("total", 0.0), 1)}
                for case, p, err in zip(sc.cases, sc.predictions, sc.errors)]
        out[name] = {"fitted_on": fitted.get(name), "fit_agrees": round(sc.fit_agrees, 3),
                     "within_15pct": round(sc.within_15pct, 3),
                     "median_abs_error": None if sc.median is None else round(sc.median, 4),
                     "p90_abs_error": None if sc.p90 is None else round(sc.p90, 4),
                     "spearman_mfu": None if sc.spearman_mfu is None else round(sc.spearman_mfu, 3), "rows": rows}
    return out


SEARCHES = {"llama3-70b x 1024 frontier": ["--model", "llama3-70b", "--gpus", "1024", "--site", "frontier",
                                             "--seq-len", "8192", "--global-batch", "1024"],
            **{f"llama3-405b x 16384 h100, {fw}, batch {gb}": [
                "--model", "llama3-405b", "--gpus", "16384", "--gpu", "h100-80gb", "--seq-len", "8192",
                "--global-batch", str(gb), "--framework", fw]
               for fw in ("hpcml", "megatron", "torchtitan", "deepspeed") for gb in (2048, 16384)},
            **{f"{m} x 16384 h100, torchtitan, batch {gb}": [  # MoE: ep multiplies the layouts (to 416,220)
                "--model", m, "--gpus", "16384", "--gpu", "h100-80gb", "--seq-len", "8192", "--global-batch", str(gb),
                "--framework", "torchtitan"] for m in ("mixtral-8x7b", "grin-moe") for gb in (2048, 16384)}}


def search_speed(args: list[str] | None = None) -> dict:
    cmd = [PY, "-m", "hpcml.cli", "plan", *(args or SEARCHES["llama3-70b x 1024 frontier"]), "--json"]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        times.append(time.perf_counter() - t0)
        if out.returncode:
            raise SystemExit(out.stderr)
    r = json.loads(out.stdout)
    best = r["best"][0]
    return {"candidates": r["candidates"], "fitting": r["fitting"], "refused": r["refused"],
            "wall_s_median": round(statistics.median(times), 3), "wall_s": [round(t, 3) for t in times],
            "best": {k: best["layout"][k] for k in ("tp", "pp", "cp", "zero", "micro_batch", "recompute")},
            "best_mfu": best["mfu"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--search", action="store_true", help="the timed searches alone")
    ap.add_argument("--tables", action="store_true", help="every published table alone, fitted and held out "
                    "(the planner's figures: seconds, nothing measured here)")
    ap.add_argument("--as-framework", choices=("hpcml", "megatron", "torchtitan", "deepspeed"),
                    help="--tables: every row re-priced as this framework runs it")
    ap.add_argument("--calibrate", action="store_true", help="hpcml plan calibrate on 5 measured layouts, checked "
                    "on 10 others (~4.5 minutes a round)")
    ap.add_argument("--rounds", type=int, default=2, help="--calibrate: rounds of the 15 layouts (the fastest kept)")
    ap.add_argument("--runs-dir", help="--calibrate: keep the measured run directories here")
    ap.add_argument("--reuse", action="store_true", help="--calibrate: calibrate again on --runs-dir's runs, "
                    "measuring nothing")
    args = ap.parse_args()
    if args.reuse and not args.runs_dir:
        ap.error("--reuse needs --runs-dir")
    if args.calibrate:
        r = calibrate_runs(args.rounds, args.runs_dir, args.reuse)
        print(json.dumps(r, indent=1) if args.json else
              f"calibrated on {len(CAL_FIT)} layouts, checked on {len(CAL_CHECK)}: median |error| "
              f"{r['median_abs_error']:.1%}, p90 {r['p90_abs_error']:.1%}, Spearman {r['spearman']}")
        return 0 if r["median_abs_error"] <= 0.15 and r["spearman"] >= 0.8 else 1
    if args.probe:
        probe()
        return 0
    if args.tables:
        result = published_tables(args.as_framework)
        print(json.dumps(result, indent=1) if args.json else "\n".join(
            f"{n}: fit agrees {t['fit_agrees']}, median |error| {t['median_abs_error']}, p90 {t['p90_abs_error']}, "
            f"Spearman {t['spearman_mfu']} ({'fitted: ' + t['fitted_on'] if t['fitted_on'] else 'held out'})"
            for n, t in result.items()))
        return 0
    if args.search:
        result = {name: search_speed(a) for name, a in SEARCHES.items()}
        print(json.dumps(result, indent=1) if args.json else
              "\n".join(f"{n}: {r['candidates']} layouts ({r['refused']} refused, {r['fitting']} fit), "
                        f"{r['wall_s_median']} s wall" for n, r in result.items()))
        return 0 if all(r["wall_s_median"] < 2.0 for r in result.values()) else 1
    result = {"search": search_speed(), "published": published_tables(),
              "cpu_validation": cpu_runs(QUICK if args.quick else list(range(len(LAYOUTS))))}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        v = result["cpu_validation"]
        print(f"search: {result['search']}\nspearman {v['spearman']} over {len(v['layouts'])} layouts "
              f"(round against round: {v['rounds_spearman']}), "
              f"predicted/measured {v['ratio_min']}..{v['ratio_max']} (median {v['ratio_median']})")
        for name, t in result["published"].items():
            print(f"{name}: fit agrees {t['fit_agrees']}, within 15% {t['within_15pct']} "
                  f"({'fitted: ' + t['fitted_on'] if t['fitted_on'] else 'held out'})")
    return 0 if result["cpu_validation"]["spearman"] >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
