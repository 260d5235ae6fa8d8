"""The campaign's pieces as Parsl apps in a user's own workflow: their config, their
@python_app steps in between, a simulation hpcml has never seen. Real Parsl, real mpiexec."""

from __future__ import annotations

import json
import sys
import textwrap

import parsl
from parsl import python_app
from parsl.executors import ThreadPoolExecutor

from hpcml.ensemble import SimSpec, TrainingJob, apps

SIM = textwrap.dedent("""
    # a user's own MPI program: a 1-D random walk, 3 outputs, nothing of hpcml inside
    import argparse, json, os, signal
    from mpi4py import MPI
    p = argparse.ArgumentParser()
    p.add_argument("--crash-first-attempt", action="store_true")
    p.add_argument("--sim-id", type=int, required=True)
    p.add_argument("--params-json", required=True)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    params = json.loads(a.params_json)
    if a.crash_first_attempt and os.environ["HPCML_ATTEMPT"] == "0" and comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    total = comm.allreduce(params["alpha"] * (comm.rank + 1))
    if comm.rank == 0:
        print("HPCML_SIM_RESULT " + json.dumps({"samples_sent": 3, "total": total, "size": comm.size,
              "attempt": os.environ["HPCML_ATTEMPT"], "sim": os.environ["HPCML_SIM_ID"],
              "mine": os.environ.get("MY_SETTING")}), flush=True)
""")

TRAINER = textwrap.dedent("""
    import json, os, sys
    run = os.environ["HPCML_RUN_DIR"]
    done = json.load(open(os.path.join(run, "sims_done.json")))
    json.dump({"done": done, "tag": os.environ.get("TAG")}, open(os.path.join(run, "trainer_saw.json"), "w"))
""")


@python_app(executors=["mine"])
def choose(points: list[dict], n: int) -> list[dict]:
    """The user's own step: keep the n points of smallest alpha."""
    return sorted(points, key=lambda p: p["alpha"])[:n]


@python_app(executors=["mine"])
def totals(run_dir: str, inputs=()) -> dict[int, float]:
    """The user's own step after the simulations: read what they reported."""
    from hpcml.ensemble import apps as a

    return {r["sim_id"]: r["result"]["total"] for r in a.provenance(run_dir) if r["status"] == "ok"}


def test_apps_in_a_plain_parsl_script_with_user_steps(tmp_path):
    (tmp_path / "walk.py").write_text(SIM)
    run = tmp_path / "run"
    parsl.load(parsl.Config(executors=[ThreadPoolExecutor(label="mine", max_threads=3)], retries=1,
                            run_dir=str(tmp_path / "parsl")))
    try:
        points = apps.design("lhs", {"alpha": (0.5, 1.5), "beta": (0.0, 1.0)}, 6, seed=1).result(timeout=60)
        chosen = choose(points, 3).result(timeout=60)
        specs = [SimSpec(sim_id=i, params=p, ranks=2,
                         argv=[sys.executable, str(tmp_path / "walk.py")]
                         + (["--crash-first-attempt"] if i == 1 else []))
                 for i, p in enumerate(chosen)]
        futs = [apps.simulation(s, run_dir=run, launch="mpiexec -n {ranks}", env={"MY_SETTING": "it's mine"})
                for s in specs]
        got = totals(str(run), inputs=futs).result(timeout=120)
        done = apps.mark_done(run, futs)
        trained = apps.training(TrainingJob(argv=[sys.executable, "-c", TRAINER], ranks=1, env={"TAG": "t 1"}),
                                run_dir=run)
        assert trained.result(timeout=120) == 0
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
    assert len(points) == 6 and [p["alpha"] for p in chosen] == sorted(p["alpha"] for p in points)[:3]
    assert got == {i: 3 * p["alpha"] for i, p in enumerate(chosen)}  # alpha * (1 + 2) over 2 ranks
    assert done == {"completed": [0, 1, 2], "failed": []}
    recs = apps.provenance(run)
    assert sorted((r["sim_id"], r["attempt"], r["status"]) for r in recs) == [
        (0, 0, "ok"), (1, 0, "killed"), (1, 1, "ok"), (2, 0, "ok")]  # the retry claimed attempt 1 on the worker
    for r in recs:
        if r["status"] == "ok":
            assert r["result"]["mine"] == "it's mine" and r["result"]["sim"] == str(r["sim_id"])
            assert r["result"]["attempt"] == str(r["attempt"]) and r["result"]["size"] == 2
            assert r["argv"][-4:] == ["--sim-id", str(r["sim_id"]), "--params-json", json.dumps(r["params"])]
    saw = json.loads((run / "trainer_saw.json").read_text())  # the done record: its run, what each streamed
    assert saw["tag"] == "t 1" and {k: saw["done"][k] for k in ("completed", "failed", "streamed", "silent")} == {
        **done, "streamed": {}, "silent": [0, 1, 2]}  # the walks close no Producer: a streaming trainer would say so
    assert saw["done"]["run"] == json.loads((run / "campaign_id.json").read_text())["runs"][-1]["run"]


def test_a_resumed_apps_workflow_runs_only_what_did_not_finish(tmp_path):
    """Issue 39: ``claim(resume=True)`` skips the simulations an earlier run completed, as the
    Campaign does (before, resuming 6 finished simulations ran all 6 again: 12 attempts)."""
    (tmp_path / "walk.py").write_text(SIM)
    run = tmp_path / "run"

    # simulation 3's first attempt dies (retries=0: it fails); the resumed run's attempt 1 of it finishes
    specs = [SimSpec(sim_id=i, params={"alpha": 1.0 + i}, ranks=2, stream=False,
                     argv=[sys.executable, str(tmp_path / "walk.py")] + (["--crash-first-attempt"] if i == 3 else []))
             for i in range(4)]
    parsl.load(parsl.Config(executors=[ThreadPoolExecutor(label="mine", max_threads=4)], retries=0,
                            run_dir=str(tmp_path / "parsl")))
    try:
        apps.claim(run, stream=False)
        first = apps.mark_done(run, [apps.simulation(s, run_dir=run, launch="mpiexec -n {ranks}")
                                     for s in specs])
        apps.claim(run, resume=True, stream=False)
        futs = [apps.simulation(s, run_dir=run, launch="mpiexec -n {ranks}") for s in specs]
        second = apps.mark_done(run, futs)
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
    assert first == {"completed": [0, 1, 2], "failed": [3]} and second == {"completed": [0, 1, 2, 3], "failed": []}
    assert [f.skipped for f in futs] == [True, True, True, False]
    assert sorted((r["sim_id"], r["attempt"], r["status"]) for r in apps.provenance(run)) == [
        (0, 0, "ok"), (1, 0, "ok"), (2, 0, "ok"), (3, 0, "killed"), (3, 1, "ok")]  # 5 attempts, not 8
