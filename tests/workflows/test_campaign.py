"""The Campaign end to end: real Parsl, real `mpiexec -n 2` simulations, a real training subprocess.

The simulation is a tiny mpi4py script written into tmp_path (the Campaign is generic), so
these tests pin the Campaign's contract, not a kernel's. What a run directory holds across
campaigns, and the heat workflow's exits: test_campaign_run_dir.py.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

parsl = pytest.importorskip("parsl")
from parsl.executors import ThreadPoolExecutor  # noqa: E402

from hpcml.ensemble.campaign import Campaign, SimSpec, TrainingJob  # noqa: E402
from hpcml.ensemble.progress import ProgressLine, last_json_line  # noqa: E402
from hpcml.errors import ConfigError, LaunchError  # noqa: E402

SIM = textwrap.dedent("""
    import argparse, json, os, signal, sys, time
    from mpi4py import MPI
    p = argparse.ArgumentParser()
    p.add_argument("--sleep", type=float, default=0.3)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--fail-always", action="store_true")
    p.add_argument("--pid-dir")
    p.add_argument("--sim-id", type=int, required=True)
    p.add_argument("--params-json", required=True)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    attempt = os.environ.get("HPCML_ATTEMPT")
    if a.pid_dir:
        open(os.path.join(a.pid_dir, f"{a.sim_id}_{comm.rank}.pid"), "w").write(str(os.getpid()))
    steps = 3
    for step in range(steps):
        time.sleep(a.sleep / steps)
        if step == a.crash_at_step and comm.rank == 0 and attempt in (None, "0"):
            os.kill(os.getpid(), signal.SIGKILL)
    comm.Barrier()
    if a.fail_always:
        print("deliberate failure", file=sys.stderr)
        sys.exit(3)
    if comm.rank == 0:
        print("HPCML_SIM_RESULT " + json.dumps({
            "samples_sent": steps * comm.size, "size": comm.size, "attempt": attempt,
            "env_sim_id": os.environ.get("HPCML_SIM_ID"), "extra": os.environ.get("HPCML_TEST_EXTRA"),
            "campaign": os.environ.get("HPCML_CAMPAIGN_ID"),
            "params": json.loads(a.params_json)}), flush=True)
""")

TRAINER = textwrap.dedent("""
    import json, os, sys, time
    run_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "die-early":
        print("trainer could not bind its port", file=sys.stderr)
        sys.exit(2)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 7, "loss": 1.0}) + "\\n")
    tmp = os.path.join(run_dir, "ready.tmp")
    open(tmp, "w").write("tcp://127.0.0.1:0")
    os.replace(tmp, os.path.join(run_dir, "ready"))
    if mode == "save-on-usr1":  # the walltime warning: save, exit 75 ("not finished")
        import signal
        signal.signal(signal.SIGUSR1, lambda *a: (open(os.path.join(run_dir, "saved"), "w").write("yes"),
                                                  sys.exit(75)))
        while True:
            time.sleep(0.1)
    if mode == "fail":
        time.sleep(2.0)
        print("loss is nan at step 7", file=sys.stderr)
        sys.exit(3)
    done = os.environ["HPCML_SIMS_DONE_FILE"]
    while not os.path.exists(done):
        time.sleep(0.05)
    if mode == "fail-at-end":
        print("could not save the last checkpoint", file=sys.stderr)
        sys.exit(3)
    saw = {"n_sims": os.environ["HPCML_N_SIMS"], "done": json.load(open(done)), "extra": os.environ.get("TRAIN_EXTRA")}
    json.dump(saw, open(os.path.join(run_dir, "trainer_saw.json"), "w"))
""")


def _config(tmp_path: Path, retries: int, threads: int = 4) -> parsl.Config:
    # More threads than max_concurrent: the Campaign itself must enforce the limit.
    return parsl.Config(executors=[ThreadPoolExecutor(label="sims", max_threads=threads)], retries=retries)


def _sim(tmp_path: Path, sim_id: int, *extra: str) -> SimSpec:
    script = tmp_path / "sim.py"
    if not script.exists():
        script.write_text(SIM)
    return SimSpec(sim_id=sim_id, params={"alpha": 0.5 + sim_id, "beta": 1e-3 * (sim_id + 1)},
                   argv=[sys.executable, str(script), *extra], ranks=2)


def _provenance(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "provenance.jsonl").read_text().splitlines()]


def _processes_running(needle: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and needle.encode() in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            pass
    return found


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def test_four_sims_at_most_two_at_once(tmp_path):
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, config=_config(tmp_path, retries=1), sim_launch="mpiexec -n {ranks}",
                 max_concurrent=2, env={"HPCML_TEST_EXTRA": "it's here"}, progress=False)
    sims = [_sim(tmp_path, i, "--sleep", "0.6") for i in range(4)]
    res = c.run(sims)

    assert (res.completed, res.failed, res.cancelled, res.retried) == ([0, 1, 2, 3], [], [], [])
    assert res.attempts == {0: 1, 1: 1, 2: 1, 3: 1} and res.samples_sent == 4 * 6 and res.ok
    recs = sorted(_provenance(run_dir), key=lambda r: r["sim_id"])
    assert [(r["sim_id"], r["attempt"], r["status"], r["returncode"], r["signal"], r["samples_sent"])
            for r in recs] == [(i, 0, "ok", 0, None, 6) for i in range(4)]
    for i, r in enumerate(recs):
        assert r["params"] == {"alpha": 0.5 + i, "beta": 1e-3 * (i + 1)}
        assert r["result"]["params"] == r["params"]  # --params-json reached the program intact
        assert r["result"]["size"] == 2 and r["result"]["attempt"] == "0" and r["result"]["env_sim_id"] == str(i)
        assert r["result"]["extra"] == "it's here"
        assert r["argv"][-4:] == ["--sim-id", str(i), "--params-json", json.dumps(r["params"])]
        assert r["stdout"] == f"sims/sim_{i:05d}/attempt_0.out" and r["launch"] == "mpiexec -n 2"
        assert (run_dir / r["stdout"]).read_text().startswith("HPCML_SIM_RESULT ")
        assert r["end"] > r["start"] and r["duration_s"] >= 0.6
    assert _max_overlap([(r["start"], r["end"]) for r in recs]) == 2
    summary = json.loads((run_dir / "campaign.json").read_text())
    assert summary["completed"] == [0, 1, 2, 3] and summary["max_concurrent"] == 2 and summary["retries"] == 1
    assert summary["attempts"] == {"0": 1, "1": 1, "2": 1, "3": 1} and summary["ok"] is True
    assert (run_dir / "parsl" / "000" / "parsl.log").is_file()  # Parsl's own files stay in the run directory


def test_crash_retried_failure_exhausts_retries_trainer_alongside(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "trainer.py").write_text(TRAINER)
    c = Campaign(run_dir=run_dir, config=lambda: _config(tmp_path, retries=1), max_concurrent=3, progress=True,
                 progress_every_s=0.1)
    sims = [_sim(tmp_path, 0), _sim(tmp_path, 1, "--crash-at-step", "1"), _sim(tmp_path, 2, "--fail-always")]
    job = TrainingJob(argv=[sys.executable, str(tmp_path / "trainer.py"), str(run_dir), "ok"], ranks=1,
                      env={"TRAIN_EXTRA": "x"}, stream=False)  # a ready file, but no stream: its sims write none
    res = c.run(sims, training=job, ready_file=run_dir / "ready", train_timeout_s=30)

    assert (res.completed, res.failed, res.retried) == ([0, 1], [2], [1, 2])
    assert res.attempts == {0: 1, 1: 2, 2: 2} and res.training_returncode == 0 and not res.ok
    recs = {(r["sim_id"], r["attempt"]): r for r in _provenance(run_dir)}
    assert sorted(recs) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
    crashed, retried = recs[1, 0], recs[1, 1]
    assert (crashed["status"], crashed["signal"], crashed["samples_sent"]) == ("killed", 9, None)
    assert crashed["returncode"] in (9, 137, -9)  # MPICH hydra returns the signal number
    assert (retried["status"], retried["returncode"], retried["samples_sent"]) == ("ok", 0, 6)
    assert retried["result"]["attempt"] == "1" and retried["start"] >= crashed["end"]
    for k in (0, 1):
        assert (recs[2, k]["status"], recs[2, k]["returncode"], recs[2, k]["signal"]) == ("failed", 3, None)
        assert "deliberate failure" in (run_dir / recs[2, k]["stderr"]).read_text()
    assert res.samples_sent == 12
    saw = json.loads((run_dir / "trainer_saw.json").read_text())  # the trainer was told which sims ended how
    assert saw["done"]["run"] == res.run_id and saw["done"]["campaign"] == res.campaign_id
    assert {**saw, "done": {k: saw["done"][k] for k in ("completed", "failed", "streamed")}} == {
        "n_sims": "3", "done": {"completed": [0, 1], "failed": [2], "streamed": {}}, "extra": "x"}
    assert json.loads((run_dir / "campaign.json").read_text())["training"]["returncode"] == 0
    lines = capsys.readouterr().err.splitlines()  # not a terminal: plain progress lines
    assert any(line.endswith("| train step 7") for line in lines)
    assert [line for line in lines if line.startswith("campaign ")][-1].split(" | ", 1)[1] == (
        "sims 2/3 done, 0 running, 1 failed, 2 retried | train step 7 (exited 0)")


WAIT_FOR_DONE = "import os, time\nwhile not os.path.exists(os.environ['HPCML_SIMS_DONE_FILE']): time.sleep(0.05)"


def test_local_site_supplies_config_and_launch_lines(tmp_path):
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, site="local", max_concurrent=2, retries=0, progress=False)
    job = TrainingJob(argv=[sys.executable, "-c", WAIT_FOR_DONE], nodes=1)  # ranks: the site's 2 per node
    res = c.run([_sim(tmp_path, 0), _sim(tmp_path, 1)], training=job)
    assert (res.completed, res.training_returncode, res.status) == ([0, 1], 0, "ok")
    assert [r["command"].split()[:3] for r in _provenance(run_dir)] == [["mpiexec", "-n", "2"]] * 2
    summary = json.loads((run_dir / "campaign.json").read_text())
    assert summary["training"]["launch"] == f"mpiexec -n 2 {sys.executable} -c {shlex.quote(WAIT_FOR_DONE)}"
    assert summary["retries"] == 0 and (run_dir / "parsl" / "000").is_dir() and summary["status"] == "ok"


def test_trainer_exiting_early_cancels_the_rest_and_is_reported(tmp_path):
    """A trainer that exits 0 while simulations remain trained on part of the data: the
    campaign cancels the rest and fails loudly instead of running them for nobody."""
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, site="local", max_concurrent=1, retries=0, progress=False, cancel_grace_s=1)
    job = TrainingJob(argv=[sys.executable, "-c", "import time; time.sleep(1.5)"], ranks=1)
    sims = [_sim(tmp_path, i, "--sleep", "3") for i in range(3)]
    with pytest.raises(LaunchError, match=r"exited with code 0 before the simulations were done"):
        c.run(sims, training=job)
    summary = json.loads((run_dir / "campaign.json").read_text())
    assert (summary["status"], summary["completed"], summary["cancelled"]) == ("failed", [], [0, 1, 2])
    assert [(r["sim_id"], r["status"]) for r in _provenance(run_dir)] == [(0, "cancelled")]
    assert _processes_running(str(tmp_path / "sim.py")) == []


def test_site_path_mpi_executor_with_parsl_mpi_prefix(tmp_path, monkeypatch):
    # The site path: Parsl's MPIExecutor composes $PARSL_MPI_PREFIX from the resource spec.
    # Only the scheduler's node file is faked (PBS_NODEFILE, in the worker's environment).
    from parsl.executors import MPIExecutor
    from parsl.launchers import SimpleLauncher
    from parsl.providers import LocalProvider

    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # interchange.py
    (tmp_path / "nodes").write_text("localhost\n")
    run_dir = tmp_path / "run"

    def config() -> parsl.Config:
        provider = LocalProvider(launcher=SimpleLauncher(), init_blocks=1, max_blocks=1,
                                 worker_init=f"export PBS_NODEFILE={tmp_path / 'nodes'}")
        return parsl.Config(executors=[MPIExecutor(label="sims", max_workers_per_block=2, provider=provider)],
                            retries=1)

    c = Campaign(run_dir=run_dir, config=config, sim_launch="$PARSL_MPI_PREFIX", max_concurrent=2, progress=False,
                 sim_resource_spec=lambda r: {"num_nodes": 1, "num_ranks": r, "ranks_per_node": r})
    res = c.run([_sim(tmp_path, 1, "--crash-at-step", "0")])  # one simulation: the worker pool's start dominates
    assert (res.completed, res.attempts) == ([1], {1: 2})
    recs = _provenance(run_dir)
    assert [(r["attempt"], r["status"], r["signal"], r["samples_sent"]) for r in recs] == [
        (0, "killed", 9, None), (1, "ok", None, 6)]
    assert recs[1]["result"]["attempt"] == "1"
    for r in recs:
        assert r["launch"] == "$PARSL_MPI_PREFIX"
        assert r["command"].startswith(f"mpiexec -n 2 -ppn 2 -hosts localhost {sys.executable} ")


def test_training_failure_cancels_sims_and_raises(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "trainer.py").write_text(TRAINER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    c = Campaign(run_dir=run_dir, config=_config(tmp_path, retries=2), max_concurrent=2, progress=False,
                 cancel_grace_s=2)
    sims = [_sim(tmp_path, i, "--sleep", "60", "--pid-dir", str(pid_dir)) for i in range(3)]
    job = TrainingJob(argv=[sys.executable, str(tmp_path / "trainer.py"), str(run_dir), "fail"], ranks=1, stream=False)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"training job exited with code 3 after .* loss is nan at step 7"):
        c.run(sims, training=job, ready_file=run_dir / "ready")
    assert time.monotonic() - t0 < 20
    recs = _provenance(run_dir)
    assert sorted((r["sim_id"], r["attempt"], r["status"]) for r in recs) == [(0, 0, "cancelled"), (1, 0, "cancelled")]
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert 1 <= len(pids) <= 4
    for pid in pids:  # every rank of every cancelled simulation is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _processes_running(str(tmp_path / "sim.py")) == []
    summary = json.loads((run_dir / "campaign.json").read_text())
    assert (summary["completed"], summary["cancelled"], summary["training_returncode"]) == ([], [0, 1, 2], 3)
    assert "exited with code 3" in summary["error"]


def test_walltime_near_and_no_warning_the_campaign_stops_itself(tmp_path):
    """A job script that asked for no warning: 60 s before the walltime the campaign cancels
    its simulations and asks the trainer to save and stop; it has until just before the end."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "trainer.py").write_text(TRAINER)
    c = Campaign(run_dir=run_dir, config=_config(tmp_path, retries=0), max_concurrent=1, progress=False,
                 cancel_grace_s=1, deadline=time.time() + 64)  # 4 s of campaign, then the margin
    sims = [_sim(tmp_path, i, "--sleep", "30") for i in range(3)]
    job = TrainingJob(argv=[sys.executable, str(tmp_path / "trainer.py"), str(run_dir), "save-on-usr1"],
                      ranks=1, stream=False)
    t0 = time.monotonic()
    res = c.run(sims, training=job, ready_file=run_dir / "ready")
    assert time.monotonic() - t0 < 30
    assert (res.status, res.interrupted, res.error) == ("interrupted", True, None)
    assert res.training_returncode in (75, 0)  # MPICH's mpiexec of 1 rank reports 0 after forwarding a signal
    assert (run_dir / "saved").read_text() == "yes" and not (run_dir / "sims_done.json").exists()
    summary = json.loads((run_dir / "campaign.json").read_text())
    assert summary["stop_reason"] == "walltime: 60 s left and no warning came" and summary["cancelled"] == [0, 1, 2]
    assert [(r["sim_id"], r["status"]) for r in _provenance(run_dir)] == [(0, "cancelled")]


def test_timeout_stops_an_attempt_and_a_rerun_continues_attempt_numbers(tmp_path, caplog):
    run_dir = tmp_path / "run"
    caplog.set_level(logging.WARNING, logger="hpcml.ensemble.simpool")
    for expected_attempt in (0, 1):
        c = Campaign(run_dir=run_dir, config=_config(tmp_path, retries=0), sim_timeout_s=1, cancel_grace_s=1,
                     progress=False)
        res = c.run([_sim(tmp_path, 5, "--sleep", "30")], resume=expected_attempt > 0)  # the same campaign again
        assert (res.failed, res.attempts) == ([5], {5: 1})
        last = _provenance(run_dir)[-1]
        assert (last["attempt"], last["status"], last["samples_sent"]) == (expected_attempt, "timeout", None)
        assert 1 <= last["duration_s"] < 10
        # the warning says it timed out, not only the exit code the wrapper's stop left (a newcomer saw
        # "exit code 15 (see .../attempt_2.err)", an empty file)
        said = [r.getMessage() for r in caplog.records if "simulation 5 failed" in r.getMessage()]
        assert re.search(rf"attempt {expected_attempt} timed out: stopped by the campaign after \d+ s \(its "
                         r"sim_timeout_s\)", said[-1]), said
    assert [r["attempt"] for r in _provenance(run_dir)] == [0, 1]


def test_trainer_dying_before_ready_is_a_clear_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "trainer.py").write_text(TRAINER)
    c = Campaign(run_dir=run_dir, config=_config(tmp_path, retries=0), progress=False)
    job = TrainingJob(argv=[sys.executable, str(tmp_path / "trainer.py"), str(run_dir), "die-early"],
                      ranks=1, stream=False)
    with pytest.raises(LaunchError,
                       match=r"exited with code 2 before writing ready file .*ready.*could not bind its port"):
        c.run([_sim(tmp_path, 0)], training=job, ready_file=run_dir / "ready")
    assert not (run_dir / "provenance.jsonl").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_concurrent=0), "max_concurrent must be an int >= 1, got 0"),
    (dict(retries=-1), "retries must be an int >= 0, got -1"),
    (dict(sim_timeout_s=0), "sim_timeout_s must be > 0 or None, got 0"),
    (dict(env={"BAD-NAME": "x"}), "env names must be shell identifiers with str values, got ['BAD-NAME']"),
])
def test_campaign_rejects_bad_settings(tmp_path, kwargs, message):
    with pytest.raises(ConfigError) as e:
        Campaign(run_dir=tmp_path, config=object(), **kwargs)
    assert str(e.value) == message


def test_spec_validation_and_duplicate_ids(tmp_path):
    with pytest.raises(ConfigError, match=r"^Campaign needs site= .* or config="):
        Campaign(run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^sim 3: ranks must be an int >= 1, got 0$"):
        SimSpec(sim_id=3, params={}, argv=["x"], ranks=0)
    with pytest.raises(ConfigError, match=r"^sim 1: argv must be a non-empty list of strings, got 'prog'$"):
        SimSpec(sim_id=1, params={}, argv="prog")
    with pytest.raises(ConfigError, match=r"^sim 2: params must be finite JSON values"):
        SimSpec(sim_id=2, params={"a": float("nan")}, argv=["x"])
    with pytest.raises(ConfigError, match=r"^training ranks must be an int >= 1, got 0$"):
        TrainingJob(argv=["t"], ranks=0)
    c = Campaign(run_dir=tmp_path, config=object(), progress=False)
    with pytest.raises(ConfigError, match=r"^sim_id values must be unique, repeated: \[1\]$"):
        c.run([SimSpec(sim_id=1, params={}, argv=["x"]), SimSpec(sim_id=1, params={}, argv=["y"])])
    assert SimSpec(sim_id=4, params={"a": 1.5}, argv=["p", "-v"]).command() == [
        "p", "-v", "--sim-id", "4", "--params-json", '{"a": 1.5}']


def test_progress_line_and_metrics_tail(tmp_path):
    out = io.StringIO()
    p = ProgressLine(5, stream=out, every_s=0.0, tty=False)
    p.update(done=2, running=2, failed=1, retried=1, train="train step 40")
    assert out.getvalue().split(" | ", 1)[1] == "sims 2/5 done, 2 running, 1 failed, 1 retried | train step 40\n"
    tty = io.StringIO()
    p = ProgressLine(5, stream=tty, tty=True)
    p.update(done=0, running=1, failed=0, retried=0)
    p.update(force=True, done=1, running=0, failed=0, retried=0)
    p.close()
    assert tty.getvalue().count("\r\x1b[K") == 2
    assert tty.getvalue().endswith("sims 1/5 done, 0 running, 0 failed, 0 retried\n")
    off = io.StringIO()
    ProgressLine(5, stream=off, enabled=False).update(done=1, running=0, failed=0, retried=0)
    assert off.getvalue() == ""
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')  # a line being written
    assert last_json_line(m) == {"step": 2, "loss": 0.5}
    assert last_json_line(tmp_path / "absent.jsonl") is None
