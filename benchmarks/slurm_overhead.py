"""What the scheduler path costs on the real two-node Slurm cluster (scripts/slurm_cluster.sh),
against plain Parsl on the same block and against the launch floor, in one run.

    python benchmarks/slurm_overhead.py --json                 # tasks and launches, then the node loss
    python benchmarks/slurm_overhead.py --json --no-node-loss

One Parsl block (slurm-local's SlurmProvider, MPIExecutor with srun) runs, one at a time so
each is a latency:

- ``plain``: a plain Parsl ``bash_app`` running ``$PARSL_MPI_PREFIX true`` (an srun step of
  2 ranks) -- the peer;
- ``hpcml``: the same through :func:`hpcml.ensemble.apps.simulation` (attempt claimed on the
  worker, wrapper in its own process group, provenance record) -- what hpcml adds;
- ``parsl_only``: a plain bash_app running ``true`` with no srun -- Parsl's own task cost.

Floors: ``fork``/``exec`` of ``true`` here, ``mpiexec -n 2 true`` here, and ``srun -n2 true``
inside a job (a step). Node loss: tests/slurm/scenarios.py's scenario -- a 2-node training
job loses n2 (SIGKILL of its ranks, node DOWN), Slurm requeues it on n1, it resumes on the
layout that fits: steps lost, seconds from the failure to the first step after it, and the
losses after resuming against an uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.slurm import scenarios  # noqa: E402  (the cluster helpers the tests use)


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_s": round(statistics.median(xs), 4), "min_s": round(xs[0], 4), "max_s": round(xs[-1], 4),
            "n": len(xs)}


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def floors(n: int) -> dict:
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    job = scenarios.sh("salloc", "-N1", "--no-shell", "--exclusive", "--job-name", "bench-floor", check=True)
    job_id = job.stderr.split("Granted job allocation ")[1].split()[0]
    try:
        steps = _timed(lambda: scenarios.sh("srun", "--jobid", job_id, "-n2", "true", check=True), n)
    finally:
        scenarios.sh("scancel", job_id)
    env = {k: v for k, v in scenarios.ENV.items() if k != "SLURM_CONF"}
    return {"exec_true": _stats(_timed(lambda: run("true"), n)),
            "mpiexec_2_true": _stats(_timed(lambda: subprocess.run(["mpiexec", "-n", "2", "true"], check=True,
                                                                  capture_output=True, env=env), n)),
            "srun_step_2_true": _stats(steps)}


def parsl_tasks(n: int, workdir: Path) -> dict:
    import parsl
    from parsl import bash_app

    from hpcml.ensemble import SimSpec, apps, load_site

    site = load_site("slurm-local")
    t0 = time.perf_counter()
    parsl.load(site.parsl_config(run_dir=str(workdir / "run"), nodes=1, walltime="00:20:00", max_concurrent_sims=1,
                                 retries=0))
    try:
        @bash_app(executors=["sims"])
        def mpi_true(parsl_resource_specification: dict) -> str:
            return "$PARSL_MPI_PREFIX true"

        @bash_app(executors=["sims"])
        def plain_true(parsl_resource_specification: dict) -> str:
            return "true"

        spec = site.sim_resource_spec(2)
        mpi_true(parsl_resource_specification=spec).result(timeout=300)  # the block is up and its worker ready
        first_s = time.perf_counter() - t0
        plain = _timed(lambda: mpi_true(parsl_resource_specification=spec).result(timeout=120), n)
        parsl_only = _timed(lambda: plain_true(parsl_resource_specification=spec).result(timeout=120), n)
        ids = iter(range(n))
        hpcml = _timed(lambda: apps.simulation(SimSpec(sim_id=next(ids), params={"a": 1.0}, argv=["true"]),
                                               run_dir=workdir / "run", site=site).result(timeout=120), n)
        records = apps.provenance(workdir / "run")
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
    p, h = _stats(plain), _stats(hpcml)
    return {"first_task_after_load_s": round(first_s, 3), "plain_parsl_srun_task": p, "hpcml_sim_task": h,
            "parsl_task_no_launch": _stats(parsl_only),
            "hpcml_over_plain": round(h["median_s"] / p["median_s"], 3),
            "hpcml_added_s": round(h["median_s"] - p["median_s"], 4),
            "hpcml_records_ok": sum(r["status"] == "ok" for r in records)}


def node_loss(workdir: Path) -> dict:
    expected = scenarios.reference_losses(4, "--tp", "2", "--steps", "16", "--seed", "0")
    r = scenarios.node_loss(workdir, steps=16, every=4, fail_after=6)
    got = [r["losses"][s] for s in range(1, 17)]
    resumed = range(r["resumed_at"] - 1, 16)
    rel = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in resumed)
    cred = next((line for line in (scenarios.STATE / "slurm.conf").read_text().splitlines()
                 if "cred_expire" in line), "")
    return {"steps_lost": r["steps_lost"], "checkpoint_every": r["checkpoint_every"],
            "recovery_s": round(r["recovery_s"], 1), "max_rel_loss_diff_after_resume": rel,
            "layout_after": r["layouts"][-1], "nodes_after": r["nodes_after"], "state": r["state"],
            "requeue_delay_setting": cred.split("cred_expire=")[-1] + " s (cred_expire; Slurm's default is 120 s)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=10, help="tasks (and launches) per measurement")
    p.add_argument("--no-node-loss", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not scenarios.cluster_up():
        subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "start"], check=True)
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-slurm-", dir="/tmp") as tmp:
        out = {"floors": floors(args.tasks), "tasks": parsl_tasks(args.tasks, Path(tmp) / "tasks")}
        if not args.no_node_loss:
            out["node_loss"] = node_loss(Path(tmp) / "loss")
    scenarios.sh("scancel", "--user", "root")
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for section, values in out.items():
            print(section, json.dumps(values))


if __name__ == "__main__":
    main()
