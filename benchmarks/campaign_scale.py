"""How the campaign driver grows with the number of simulations: CPU, memory and records per simulation.

    python benchmarks/campaign_scale.py --json --sims 1000
    python benchmarks/campaign_scale.py --json --sims 300,1000,3000      # growth between sizes

A local Campaign (Parsl threads, no scheduler) of ``--sims`` tiny members: each runs
``/bin/true`` through the attempt wrapper (no mpiexec: ``sim_launch=""``), so what is
measured is the driver and the per-simulation protocol (Parsl task, attempt files,
provenance, progress), not a simulation. Peer: the same number of bare Parsl ``bash_app``
tasks running ``/bin/true`` under the same executor (what Parsl alone costs per task). Per
size: ``wall_s``, ``driver_cpu_ms_per_sim`` (this process, every thread), ``driver_rss_mib``
(peak), ``files_per_sim`` and ``record_bytes_per_sim`` (everything the run directory holds),
``duplicates`` and ``missing`` (members with more than one, or no, successful attempt in the
provenance), and the bare Parsl figures beside them; the last line is the largest size.
Each size runs in a fresh interpreter, so peak memory is that size's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _usage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_maxrss / 1024


def member(sim_id: int, params: dict, attempt: int) -> dict:
    """A bundled member: as small as a member can be."""
    return {"x": params["x"], "attempt": attempt}


GRID = 16  # a streaming member's field: 16 float32 points

TRAINER = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
from hpcml.train import FieldScales, train_surrogate
n = int(sys.argv[1])
model = MLPSurrogate(MLPSurrogateConfig(n_params=1, shape=({GRID},), hidden=32, depth=2))
scales = FieldScales(param_lo=(0.0,), param_hi=(float(n),), t_max=1.0, field_offset=0.0, field_scale=1.0)
sys.exit(train_surrogate(model, params=("x",), fields=("u",), scales=scales, shape=({GRID},)))
"""


def stream_member(sim_id: int, params: dict, attempt: int) -> dict:
    """A bundled member that streams one sample into the campaign's trainer."""
    import numpy as np
    from mpi4py import MPI

    from hpcml.stream import Producer

    out = Producer.from_campaign(comm=MPI.COMM_SELF, params=params, global_shape=(GRID,), offset=(0,),
                                 local_shape=(GRID,), fields=("u",), sim_id=sim_id, attempt=attempt)
    out.send(0, 0.0, {"u": np.full(GRID, params["x"], np.float32)})
    out.close()
    return {"samples_sent": 1}


def _on_site(n: int, site: str, bundle: int, threads: int, run_dir: Path) -> dict:
    """Every member streams one sample into a 2-rank trainer, through the site's scheduler."""
    from hpcml.ensemble import Campaign, Members, TrainingJob

    sims = Members(entry="benchmarks.campaign_scale:stream_member", count=n, params=_x)
    training = TrainingJob(argv=[sys.executable, "-c", TRAINER, str(n)], ranks=2, steps=100, batch=8, stream=True,
                           env={"PYTHONPATH": str(ROOT)})
    c = Campaign(run_dir=run_dir, site=site, site_options={"nodes": 1, "walltime": "00:20:00"}, bundle=bundle,
                 max_concurrent=threads, retries=1, progress=False, env={"PYTHONPATH": str(ROOT)})
    cpu0, t0 = _usage()[0], time.perf_counter()
    res = c.run(sims, training=training, train_timeout_s=900)
    wall = time.perf_counter() - t0
    cpu, rss = _usage()
    ok = _ok_counts(run_dir)
    s = json.loads((run_dir / "train_summary.json").read_text())
    return {"sims": n, "site": site, "bundle": bundle, "status": res.status, "wall_s": wall,
            "driver_cpu_ms_per_sim": 1e3 * (cpu - cpu0) / n, "driver_rss_mib": rss,
            "duplicates": sum(v > 1 for v in ok.values()), "missing": n - len(ok),
            "samples_expected": s["samples_expected"], "samples_ingested": s["samples_ingested"],
            "samples_missing": s["samples_missing"], "duplicate_samples": s["duplicate_samples"],
            "gradient_steps": s["gradient_steps"], "training_returncode": res.training_returncode}


def _x(sim_id: int) -> dict:
    return {"x": float(sim_id)}


def _specs(n: int, bundle: int, listed: bool = False):
    """Bundled members described (``Members``: a few bytes a member in the driver), or -- ``listed``,
    or launched ones -- a list of ``SimSpec`` s (~1.5 KiB a member held by the caller)."""
    from hpcml.ensemble import Members, SimSpec

    if bundle and not listed:
        return Members(entry="benchmarks.campaign_scale:member", count=n, params=_x, stream=False)
    if bundle:
        return [SimSpec(sim_id=i, params={"x": float(i)}, entry="benchmarks.campaign_scale:member", stream=False)
                for i in range(n)]
    return [SimSpec(sim_id=i, params={"x": float(i)}, argv=["/bin/true"], stream=False) for i in range(n)]


def _make(run_dir: Path, threads: int, bundle: int):
    from hpcml.ensemble import Campaign

    return Campaign(run_dir=run_dir, site="local", max_concurrent=threads, retries=0, progress=False, sim_launch="",
                    bundle=max(1, bundle), env={"PYTHONPATH": str(ROOT)})


def _ok_counts(run_dir: Path) -> dict[int, int]:
    ok: dict[int, int] = {}
    with open(run_dir / "provenance.jsonl") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("status") == "ok":
                ok[rec["sim_id"]] = ok.get(rec["sim_id"], 0) + 1
    return ok


def _killed_run(n: int, threads: int, run_dir: Path, bundle: int, listed: bool = False) -> None:
    """Child process: the same campaign, killed from outside at half way."""
    _make(run_dir, threads, bundle).run(_specs(n, bundle, listed))


def _campaign(n: int, threads: int, run_dir: Path, bundle: int = 0, resume: bool = False,
              listed: bool = False) -> dict:
    sims = _specs(n, bundle, listed)
    cpu0, t0 = _usage()[0], time.perf_counter()
    res = _make(run_dir, threads, bundle).run(sims)
    wall = time.perf_counter() - t0
    cpu, rss = _usage()
    ok = _ok_counts(run_dir)
    files = sum(len(f) for _, _, f in os.walk(run_dir))
    size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
    out = {"sims": n, "status": res.status, "wall_s": wall, "driver_cpu_ms_per_sim": 1e3 * (cpu - cpu0) / n,
           "driver_rss_mib": rss, "files_per_sim": files / n, "record_bytes_per_sim": size / n,
           "provenance_bytes_per_sim": (run_dir / "provenance.jsonl").stat().st_size / n,
           "duplicates": sum(v > 1 for v in ok.values()), "missing": n - len(ok)}
    if resume:
        out.update(_kill_and_resume(n, threads, run_dir.with_name("killed"), bundle, sims, listed))
    return out


def _kill_and_resume(n: int, threads: int, run_dir: Path, bundle: int, sims, listed: bool) -> dict:
    """The campaign again in a child process, SIGKILLed once half its members have ended; then
    resumed here: how long the resume takes, and what ran twice or never."""
    import signal

    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.campaign_scale import _killed_run; "
            f"from pathlib import Path; _killed_run({n}, {threads}, Path({str(run_dir)!r}), {bundle}, {listed})")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             cwd=ROOT)
    prov = run_dir / "provenance.jsonl"
    while child.poll() is None:
        if prov.exists() and len(_ok_counts(run_dir)) >= n // 2:
            child.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    child.wait()
    at_kill = len(_ok_counts(run_dir)) if prov.exists() else 0
    time.sleep(3)  # the attempt wrappers see the driver gone within a second and end their tasks
    t0 = time.perf_counter()
    res = _make(run_dir, threads, bundle).run(sims, resume=True)
    resume_s = time.perf_counter() - t0
    ok = _ok_counts(run_dir)
    return {"resume_s": resume_s, "resume_status": res.status, "ok_at_kill": at_kill,
            "resume_skipped": len(res.skipped), "resume_duplicates": sum(v > 1 for v in ok.values()),
            "resume_missing": n - len(ok)}


def _bare_parsl(n: int, threads: int, run_dir: Path) -> dict:
    import parsl
    from parsl import bash_app
    from parsl.executors import ThreadPoolExecutor

    @bash_app
    def true_app() -> str:
        return "/bin/true"

    parsl.load(parsl.Config(executors=[ThreadPoolExecutor(max_threads=threads)], run_dir=str(run_dir),
                            usage_tracking=0, strategy="none"))
    try:
        cpu0, t0 = _usage()[0], time.perf_counter()
        futs = [true_app() for _ in range(n)]
        failed = sum(f.exception() is not None for f in futs)
        wall = time.perf_counter() - t0
        cpu, rss = _usage()
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
    return {"parsl_wall_s": wall, "parsl_cpu_ms_per_task": 1e3 * (cpu - cpu0) / n, "parsl_rss_mib": rss,
            "parsl_failed": failed}


def _one(kind: str, n: int, threads: int, bundle: int = 0, resume: bool = False, listed: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="hpcml-scale-") as d:
        if kind == "campaign":
            return _campaign(n, threads, Path(d) / "run", bundle, resume, listed)
        return _bare_parsl(n if not bundle else -(-n // bundle), threads, Path(d) / "run")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sims", default="1000", help="one size, or several separated by commas")
    p.add_argument("--threads", type=int, default=8, help="simulations at once (max_concurrent)")
    p.add_argument("--bundle", type=int, default=0, help="members a task, run in-process (SimSpec(entry=...)); "
                                                         "0: one /bin/true launched per simulation")
    p.add_argument("--listed", action="store_true", help="bundled members given as a list of SimSpecs (held by the "
                                                          "caller) instead of Members (described)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="skip the kill at half way and the resume (measured for the largest size by default)")
    p.add_argument("--site", help="a scheduler's site (slurm-local): bundled members stream one sample each into "
                                  "a 2-rank trainer, through its scheduler (one size, --bundle >= 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.site:
        n = int(args.sims.split(",")[-1])
        with tempfile.TemporaryDirectory(prefix="hpcml-scale-", dir=str(ROOT / "runs") if (ROOT / "runs").is_dir()
                                         else None) as d:
            row = _on_site(n, args.site, max(1, args.bundle), args.threads, Path(d) / "run")
        print(json.dumps(row) if args.json else json.dumps(row, indent=1))
        bad = row["duplicates"] or row["missing"] or row["samples_missing"] or row["duplicate_samples"] or \
            row["status"] != "ok" or row["samples_ingested"] != n
        sys.exit("campaign_scale: a member or a sample missing or twice" if bad else 0)
    rows = []
    sizes = [int(x) for x in args.sims.split(",")]
    for n in sizes:
        row = {}
        for kind in ("campaign", "parsl"):  # each in a fresh interpreter: its own peak memory, one parsl.load
            code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.campaign_scale import _one; "
                    f"print(json.dumps(_one({kind!r}, {n}, {args.threads}, {args.bundle}, "
                    f"{args.resume and n == sizes[-1] and kind == 'campaign'}, {args.listed})))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                sys.exit(f"campaign_scale: the {kind} run of {n} failed: {out.stderr[-2000:]}")
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        row["bundle"], row["members_given_as"] = args.bundle, ("list" if args.listed or not args.bundle else "Members")
        row["cpu_vs_parsl"] = row["driver_cpu_ms_per_sim"] / row["parsl_cpu_ms_per_task"]
        rows.append(row)
        print(json.dumps(row) if args.json else json.dumps(row, indent=1), flush=True)
    if len(rows) >= 3:
        a, b, c = rows[-3:]
        grow_bc = c["driver_rss_mib"] - b["driver_rss_mib"]
        grow_ab = max(1e-9, b["driver_rss_mib"] - a["driver_rss_mib"])
        per_sim = (grow_bc / (c["sims"] - b["sims"])) / (grow_ab / (b["sims"] - a["sims"]))
        print(json.dumps({"rss_growth_ratio": grow_bc / grow_ab,  # absolute: 10 for memory linear in members
                          "rss_growth_per_sim_ratio": per_sim, **rows[-1]}))
    bad = [r["sims"] for r in rows if r["duplicates"] or r["missing"] or r["status"] != "ok"
           or r.get("resume_duplicates") or r.get("resume_missing")]
    sys.exit(f"campaign_scale: duplicates or missing members at {bad}" if bad else 0)


if __name__ == "__main__":
    main()
