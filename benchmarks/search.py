"""A hyperparameter search of the reference transformer (issue 45, item 4): ASHA against the
full grid it samples, each trial a 2-rank ``llm_pretrain.py`` job through Parsl on a Site,
scored by its held-out loss; the ASHA driver SIGKILLed part-way and resumed.

    python benchmarks/search.py --json                                # local site
    bash scripts/slurm_cluster.sh start && eval "$(bash scripts/slurm_cluster.sh env)"
    python benchmarks/search.py --json --site slurm-local             # the two Slurm nodes

The grid: learning rate x warmup (4 x 4 = 16 trials) on a corpus packed from 120 modules of
Python's standard library (bytes), validation on 30 others. ASHA: rungs of ``--min-steps`` x eta^k up to
``--max-steps``. The grid trains every trial to ``--max-steps``. The last JSON line carries
``same_best`` (ASHA's best configuration is the grid's), ``asha_best_grid_rank`` (0: the
grid's best), ``best_loss_ratio`` (the grid's loss of ASHA's pick over the grid's best),
``saved_fraction`` (1 - ASHA's trial-steps / the grid's), ``resumed_jobs`` and
``duplicates`` (a (trial, rung) recorded twice: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LRS, WARMUPS = [3e-4, 1e-3, 3e-3, 1e-2], [1, 4, 16, 64]


def drive(args) -> None:
    """One search, in this process (the benchmark runs it as a child it can kill)."""
    from hpcml.ensemble import Search, SearchConfig

    work = Path(args.work)
    cfg = SearchConfig(method=args.drive, space={"lr": LRS, "warmup": WARMUPS}, min_steps=args.min_steps,
                       max_steps=args.max_steps, eta=args.eta, metric="val_loss", seed=0)
    argv = [sys.executable, str(ROOT / "workflows" / "llm_pretrain.py"), "--lr", "{lr}", "--warmup", "{warmup}",
            "--steps", "{steps}", "--data", str(work / "train.h5"), "--val-data", str(work / "val.h5"),
            "--val-every", "100000", "--seed", "0", "--run-dir", "{trial_dir}", "--ckpt-dir", "{trial_dir}/ckpt",
            "--ckpt-every", str(args.min_steps), "--auto-resume", "--keep", "1", "--no-progress"]
    options = {} if args.site == "local" else {"nodes": args.nodes, "walltime": "00:30:00"}
    search = Search(config=cfg, argv=argv, run_dir=work / f"{args.drive}_run", site=args.site, ranks=2,
                    max_concurrent=args.concurrent, site_options=options)
    result = search.run(resume=args.resume)
    print("RESULT " + json.dumps(result.__dict__), flush=True)


def child(args, method: str, *, resume: bool = False) -> subprocess.Popen:
    """The driver as a child; its output in files (a killed driver's orphans -- Parsl's
    interchange -- would hold pipes open)."""
    cmd = [sys.executable, __file__, "--drive", method, "--work", args.work, "--site", args.site, "--nodes",
           str(args.nodes), "--concurrent", str(args.concurrent), "--min-steps", str(args.min_steps),
           "--max-steps", str(args.max_steps), "--eta", str(args.eta), *(["--resume"] if resume else [])]
    name = Path(args.work) / f"{method}{'-resumed' if resume else ''}"
    proc = subprocess.Popen(cmd, stdout=open(f"{name}.out", "w"), stderr=open(f"{name}.err", "w"), cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.log = name
    return proc


def finish(proc: subprocess.Popen, what: str) -> dict:
    proc.wait(timeout=3600)
    out, err = Path(f"{proc.log}.out").read_text(), Path(f"{proc.log}.err").read_text()
    if proc.returncode != 0:
        sys.exit(f"search.py: the {what} search failed (exit {proc.returncode}): {err[-3000:]}")
    return json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])


def leftovers(site: str) -> dict:
    """What a SIGKILLed driver leaves: Parsl's interchange (orphaned to init) and, in pilot
    mode, its block's batch job -- both ended here, before the rerun, and counted."""
    pids = [int(x) for x in subprocess.run(["pgrep", "-f", "parsl: HTEX interchange"], capture_output=True,
                                           text=True).stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    jobs = []
    if site != "local":
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], check=False)
    return {"interchanges": len(pids), "batch_jobs": len(jobs)}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "search.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--site", default="local")
    p.add_argument("--nodes", type=int, default=1, help="pilot mode: nodes of the trials' Parsl block")
    p.add_argument("--concurrent", type=int, default=2, help="trials at once")
    p.add_argument("--min-steps", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=72)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=8, help="SIGKILL the ASHA driver after this many records "
                                                              "(0: never), then resume it")
    p.add_argument("--work", default=None, help="working directory (default: a new one under /tmp)")
    p.add_argument("--drive", choices=["asha", "grid"], help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.drive:
        return drive(args)
    import tempfile

    args.work = args.work or tempfile.mkdtemp(prefix="hpcml-search-")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(x) for x in Path(os.__file__).parent.glob("*.py"))  # the same text at every commit
    for name, files in (("train", sources[:120]), ("val", sources[120:150])):
        subprocess.run([str(Path(sys.executable).parent / "hpcml"), "data", "pack", str(work / f"{name}.h5"), *files,
                        "--tokenizer", "bytes"], check=True, capture_output=True)

    t0 = time.monotonic()
    proc = child(args, "asha")
    run = work / "asha_run"
    killed_after, left = None, None
    if args.kill_after:
        while len(records(run)) < args.kill_after and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_after = len(records(run))
            time.sleep(5)  # the trials' attempts end with their driver (their lifeline)
            left = leftovers(args.site)
            proc = child(args, "asha", resume=True)
    asha = finish(proc, "ASHA")
    asha_wall = time.monotonic() - t0
    t0 = time.monotonic()
    grid = finish(child(args, "grid"), "grid")
    grid_wall = time.monotonic() - t0

    recs = records(run)
    final = {tuple(t["params"].values()): t["scores"].get(str(args.max_steps)) for t in grid["trials"]}
    ranked = sorted(final, key=lambda k: final[k])
    pick = tuple(asha["best_params"].values())
    rows = [{"search": name, "best_params": r["best_params"], "best_val_loss": r["best_score"],
             "trial_steps": r["trial_steps"], "grid_steps": r["grid_steps"], "saved_fraction": r["saved_fraction"],
             "wall_s": round(wall, 1)} for name, r, wall in (("asha", asha, asha_wall), ("grid", grid, grid_wall))]
    last = {"site": args.site, "trials": len(final),
            "rungs": sorted({int(s) for t in asha["trials"] for s in t["scores"]}),
            "asha_best_params": asha["best_params"], "grid_best_params": grid["best_params"],
            "same_best": pick == ranked[0], "asha_best_grid_rank": ranked.index(pick),
            "best_loss_ratio": round(final[pick] / final[ranked[0]], 4), "trial_steps": asha["trial_steps"],
            "grid_steps": grid["trial_steps"], "saved_fraction": asha["saved_fraction"],
            "killed_after_records": killed_after, "resumed_jobs": asha["resumed_jobs"], "restarted": asha["restarted"],
            "left_by_the_killed_driver": left,
            "duplicates": len(recs) - len({(r["trial"], r["rung"]) for r in recs}),
            "asha_wall_s": round(asha_wall, 1), "grid_wall_s": round(grid_wall, 1)}
    for r in rows:
        print(json.dumps(r) if args.json else r)
    print(json.dumps(last) if args.json else last)


if __name__ == "__main__":
    main()
