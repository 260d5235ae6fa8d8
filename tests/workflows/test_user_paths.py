"""The paths outside the project's own workflows, as a new user takes them: a simulation the
project does not ship (1-D viscous Burgers on 2 MPI ranks, ``own_sim/burgers1d.py``), its
trainer (``own_sim/train_burgers.py``: a model of its own and ``train_surrogate``), and the
user's own drivers -- a Parsl workflow of their own on ``hpcml.ensemble.apps``, a Campaign
script of their own. Each test is a finding of issue 22 that failed before: a run
directory used twice (a silent 6-minute hang), samples lost to a trainer restart (reported
``ok``), ``executors="label"`` (a typeguard error), simulations that do not stream (91 s to
a vague failure), a watchdog killed by SIGKILL (an orphaned trainer holding the port).
Real Parsl, real mpiexec, real ZeroMQ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("parsl")

from hpcml.ensemble.apps import provenance as apps_provenance  # noqa: E402

HERE = Path(__file__).resolve().parent / "own_sim"
ROOT = HERE.parents[2]
SIM, TRAIN = str(HERE / "burgers1d.py"), str(HERE / "train_burgers.py")
NX, NU_MAX = 32, 0.05
BOUNDS = {"nu": (0.01, 0.05), "amp": (0.5, 1.0)}


def t_max(steps: int) -> float:
    return steps * 0.2 * (1.0 / NX) ** 2 / NU_MAX  # burgers1d.py's dt


HEAD = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
PY, SIM, TRAIN = {sys.executable!r}, {SIM!r}, {TRAIN!r}
BOUNDS = {BOUNDS!r}
"""

APPS_WORKFLOW = HEAD + textwrap.dedent("""
    # a user's own Parsl workflow: their config, the campaign's pieces as apps, one executor label as a string
    import parsl
    from parsl.executors import ThreadPoolExecutor
    from hpcml.ensemble import SimSpec, TrainingJob, apps
    run_dir, resume, stream = sys.argv[1], "--resume" in sys.argv, "--no-stream" not in sys.argv
    parsl.load(parsl.Config(executors=[ThreadPoolExecutor(label="mine", max_threads=4)], retries=1,
                            run_dir=run_dir + ".parsl"))
    t0 = time.monotonic()
    try:
        run = apps.claim(run_dir, resume=resume)
        print("CLAIMED", round(time.monotonic() - t0, 3), flush=True)
        points = apps.design("lhs", BOUNDS, 2, seed=3, executors="mine").result()
        train = apps.training(TrainingJob(argv=[PY, TRAIN, "--nx", "32", "--t-max", sys.argv[2], "--ckpt-every", "10",
                                                "--watermark", "2"], ranks=1, steps=20, batch=2),
                              run_dir=run.run_dir, executors="mine")
        futs = [apps.simulation(SimSpec(sim_id=i, params=p, ranks=2,
                                        argv=[PY, SIM, "--nx", "32", "--steps", "200", "--every", "40"]
                                        + (["--stream"] if stream else [])),
                                run_dir=run.run_dir, launch="mpiexec -n {ranks}", executors="mine")
                for i, p in enumerate(points)]
        done = apps.mark_done(run.run_dir, futs)
        t_done = time.monotonic()
        rc = train.exception() and getattr(train.exception(), "exitcode", "?") or train.result()
        print("RESULT", json.dumps({"done": done, "trainer": rc, "after_done_s": time.monotonic() - t_done}),
              flush=True)
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
""")

DRIVER = HEAD + textwrap.dedent("""
    # a user's own Campaign driver
    from hpcml.ensemble import Campaign, SimSpec, TrainingJob, design
    from hpcml.errors import LaunchError
    run_dir, flags = sys.argv[1], json.loads(sys.argv[2])
    sims = [SimSpec(sim_id=i, params=p, ranks=2, argv=[PY, SIM, "--nx", "32", *flags["sim"]])
            for i, p in enumerate(design("lhs", BOUNDS, 4, seed=7))]
    training = TrainingJob(argv=[PY, TRAIN, "--nx", "32", *flags["train"]], ranks=2, stream=True, steps=flags["steps"],
                           batch=2, max_restarts=1)
    campaign = Campaign(run_dir=run_dir, site="local", max_concurrent=4, retries=1, progress=False)
    try:
        result = campaign.run(sims, training=training, resume=flags.get("resume", False))
    except LaunchError as e:
        print("FAILED", e, flush=True)
        sys.exit(1)
    print("RESULT", json.dumps({"status": result.status, "samples": result.samples}), flush=True)
    sys.exit(0 if result.ok else 1)
""")


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _held_out(tmp_path: Path) -> Path:
    """Two held-out simulations, written offline (a population's tournaments score on them): their directory."""
    val = tmp_path / "val"
    val.mkdir()
    for i, (nu, amp) in enumerate([(0.02, 0.7), (0.04, 0.9)]):
        subprocess.run(["mpiexec", "-n", "1", sys.executable, SIM, "--sim-id", str(100 + i), "--nx", "32",
                        "--steps", "400", "--every", "100", "--params-json", json.dumps({"nu": nu, "amp": amp}),
                        "--out", str(val / f"sim_{i}.h5")], check=True, capture_output=True, timeout=60)
    return val


def _line(out: str, head: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith(head + " ")]
    assert lines, out[-3000:]
    return lines[-1][len(head) + 1:]


def _why(run_dir: Path) -> str:
    return "\n".join(f"--- {n}\n" + (run_dir / n).read_text()[-2500:] for n in ("train.out", "train.err")
                     if (run_dir / n).exists())


@pytest.mark.timeout(300)
def test_a_parsl_workflow_run_twice_in_one_directory_is_refused_in_seconds_then_resumed(tmp_path):
    wf = _script(tmp_path, "my_workflow.py", APPS_WORKFLOW)
    run = tmp_path / "run"
    cmd = [sys.executable, str(wf), str(run), repr(t_max(200))]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:] + _why(run)
    res = json.loads(_line(first.stdout, "RESULT"))
    assert res["done"] == {"completed": [0, 1], "failed": []} and res["trainer"] == 0, _why(run)
    s = json.loads((run / "train_summary.json").read_text())
    assert (s["status"], s["samples_expected"], s["samples_ingested"], s["samples_missing"]) == ("ok", 10, 10, 0)
    assert (s["gradient_steps"], s["campaign"]) \
        == (20, json.loads((run / "campaign_id.json").read_text())["campaign_id"])

    t0 = time.monotonic()  # the same workflow again, same directory: before, a silent hang of 6 min 40 s
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert again.returncode != 0 and took < 10, (took, again.stderr[-2000:])
    assert f"ConfigError: run directory {run} holds campaign {s['campaign']} (started " in again.stderr
    assert "resume it (resume=True) or use a new directory" in again.stderr.strip().splitlines()[-1]
    assert "CLAIMED" not in again.stdout and (run / "sims_done.json").exists()  # refused before it touched anything

    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:] + _why(run)
    assert json.loads(_line(resumed.stdout, "RESULT"))["trainer"] == 0, _why(run)
    s2 = json.loads((run / "train_summary.json").read_text())
    assert (s2["status"], s2["resumed_at"], s2["samples_ingested"], s2["samples_missing"]) == ("ok", 20, 10, 0)
    # issue 39: the finished simulations are not run again (before, they were, and their 10 copies were dropped)
    assert s2["duplicate_samples"] == 0 and s2["run"] != s["run"]
    # resumed at its last step, it took none: the first job's final loss stays (it was null)
    assert isinstance(s["final_loss"], float) and s2["final_loss"] == s["final_loss"]
    assert sorted((r["sim_id"], r["attempt"]) for r in apps_provenance(run)) == [(0, 0), (1, 0)]


@pytest.mark.timeout(200)
def test_simulations_that_do_not_stream_end_the_trainer_in_seconds_with_the_cause(tmp_path):
    wf = _script(tmp_path, "my_workflow.py", APPS_WORKFLOW)  # apps: the trainer learns it from the done record
    run = tmp_path / "apps"
    out = subprocess.run([sys.executable, str(wf), str(run), repr(t_max(200)), "--no-stream"], capture_output=True,
                         text=True, timeout=150)
    res = json.loads(_line(out.stdout, "RESULT"))
    # in seconds, not after the stream's 30 s end grace (nor never): the bound leaves room for a loaded
    # 2-core machine, where the trainer's teardown under mpiexec alone takes several seconds
    # exit 78: no step, from simulations that completed -- a relaunch would repeat it (session 21; it was 1)
    assert res["trainer"] == 78 and res["after_done_s"] < 20, (res, _why(run))
    # launched once: the workflow's Parsl retry (retries=1) launched it again before, to fail alike
    assert (run / "train.out").read_text().count("[train] summary:") == 1, _why(run)
    assert ("simulation(s) [0, 1] completed without streaming (no hpcml.stream.Producer of theirs was closed: run "
            "without their stream option?)" in (run / "train.err").read_text())
    driver = _script(tmp_path, "my_campaign.py", DRIVER)  # a Campaign: it fails at the first one that completes
    run = tmp_path / "campaign"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(driver), str(run), json.dumps(
        {"sim": ["--steps", "200", "--every", "40"], "train": ["--t-max", repr(t_max(200))], "steps": 20})],
        capture_output=True, text=True, timeout=150)
    assert out.returncode == 1 and time.monotonic() - t0 < 60, out.stdout[-2000:]
    assert _line(out.stdout, "FAILED").startswith("simulation ") and "completed without streaming" in out.stdout
    record = json.loads((run / "campaign.json").read_text())
    assert record["status"] == "failed" and "completed without streaming" in record["error"]


@pytest.mark.timeout(300)
def test_a_trainer_killed_without_a_checkpoint_fails_the_run_naming_what_is_missing_and_a_resume_fills_it(tmp_path):
    driver = _script(tmp_path, "my_campaign.py", DRIVER)
    run = tmp_path / "run"
    flags = {"sim": ["--steps", "1000", "--every", "100", "--stream"], "steps": 40,
             "train": ["--t-max", repr(t_max(1000)), "--ckpt-every", "1000", "--watermark", "2", "--crash-at", "3"]}
    out = subprocess.run([sys.executable, str(driver), str(run), json.dumps(flags)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 1, out.stdout[-2000:] + _why(run)
    failed = _line(out.stdout, "FAILED")  # before: campaign.json "ok", exit 0, 158 of 160 ingested
    record = json.loads((run / "campaign.json").read_text())
    assert record.get("samples"), f"failed for another reason: {failed}; {record.get('error')}" + _why(run)
    missing = record["samples"]["missing"]
    assert missing >= 2 and failed.startswith(f"{missing} of 40 samples of completed simulations never reached "
                                              f"training (simulation "), failed
    assert failed.endswith("resume the campaign (resume=True) to run those simulations again")
    assert (record["status"], record["training"]["restarts"], record["training"]["returncode"]) == ("failed", 1, 65)
    assert "killing the training job after step 3" in (run / "train.out").read_text()
    lacking = {int(k) for k in record["samples"]["missing_by_sim"]}

    out = subprocess.run([sys.executable, str(driver), str(run), json.dumps({**flags, "resume": True})],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + _why(run)
    res = json.loads(_line(out.stdout, "RESULT"))
    assert res["status"] == "ok" and (res["samples"]["expected"], res["samples"]["ingested"],
                                      res["samples"]["missing"]) == (40, 40, 0)
    record = json.loads((run / "campaign.json").read_text())
    assert set(record["completed"]) - set(record["skipped"]) == lacking  # only what the checkpoint lacked ran again
    assert record["cumulative"]["sims_completed"] == [0, 1, 2, 3] and record["cumulative"]["samples"]["missing"] == 0


@pytest.mark.timeout(300)
def test_an_online_campaign_feeds_a_population_each_member_its_own_simulations_once(tmp_path):
    """Issue 45: a training job of 2 members (TrainingJob(ranks=2), train_surrogate(population=...)):
    the simulations stream to the member their id routes them to (sim % 2), every sample once;
    tournaments leave both members with one model; the summary speaks for the best member."""
    import numpy as np

    from hpcml import ckpt
    from hpcml.train.online import load_source_states

    val = _held_out(tmp_path)
    driver = _script(tmp_path, "my_campaign.py", DRIVER)
    run = tmp_path / "run"
    flags = {"sim": ["--steps", "400", "--every", "100", "--stream"], "steps": 20,
             "train": ["--t-max", repr(t_max(400)), "--ckpt-every", "10", "--watermark", "2", "--pop", "2",
                       "--every", "5", "--val", str(val)]}
    out = subprocess.run([sys.executable, str(driver), str(run), json.dumps(flags)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + _why(run)
    res = json.loads(_line(out.stdout, "RESULT"))
    assert res["status"] == "ok" and (res["samples"]["expected"], res["samples"]["ingested"],
                                      res["samples"]["missing"]) == (16, 16, 0)
    s = json.loads((run / "train_summary.json").read_text())
    assert (s["gradient_steps"], s["duplicate_samples"], s["train_ranks"]) == (20, 0, 2)
    assert len(s["val_rel_l2_members"]) == 2 and s["val_rel_l2"] == min(s["val_rel_l2_members"])
    members = [run / "checkpoints" / f"member_{m}" for m in (0, 1)]
    keys, kept = [], []
    for m, c in enumerate(members):
        seen = np.concatenate([st["seen"] for st in load_source_states(c)])
        assert {int(k[0]) % 2 for k in seen.tolist()} == {m}  # a member's own simulations only
        keys += [tuple(k) for k in seen.tolist()]
        rounds = [json.loads(x) for x in (run / f"member_{m}" / "tournaments.jsonl").read_text().splitlines()]
        assert [(r["step"], r["round"], r["partner"]) for r in rounds] == [(5 * i, i, 1 - m) for i in (1, 2, 3, 4)]
        assert all(r["kept"] == ("partner" if r["partner_score"] < r["own_score"] else "own") for r in rounds)
        kept.append(rounds[-1]["kept"])
    assert len(keys) == len(set(keys)) == 16
    a, b = ckpt.read_tensors(members[0], "model/"), ckpt.read_tensors(members[1], "model/")
    same = a and all(np.array_equal(a[n].numpy(), b[n].numpy()) for n in a)
    assert same == (sorted(kept) == ["own", "partner"]), kept  # one model after the last round iff they agreed
    best = int(s["val_best_member"])  # and the run's own checkpoints/ is the best member's model
    assert json.loads((run / "checkpoints" / "best.json").read_text())["member"] == best
    ours = ckpt.read_tensors(run / "checkpoints", "model/")
    assert ours.keys() == (a, b)[best].keys() and all(np.array_equal(ours[n].numpy(), (a, b)[best][n].numpy())
                                                     for n in ours)


@pytest.mark.timeout(300)
def test_a_population_whose_every_member_diverged_ends_the_campaign_once_with_the_cause(tmp_path):
    """Both members of a streaming population diverge (``--lr 1e36``) after the last tournament:
    the trainer ends 78 (a relaunch would diverge again), nothing is relaunched, and the driver's
    error names the cause -- not exit 0 with the 'best' of two models that took one step each,
    nor an abort; the trainer's summary (an infinite loss in it) is still read, not ignored."""
    val = _held_out(tmp_path)
    driver = _script(tmp_path, "my_campaign.py", DRIVER)
    run = tmp_path / "run"
    flags = {"sim": ["--steps", "400", "--every", "100", "--stream"], "steps": 20,
             "train": ["--t-max", repr(t_max(400)), "--ckpt-every", "10", "--watermark", "2", "--pop", "2",
                       "--every", "100", "--lr", "1e36", "--val", str(val)]}
    out = subprocess.run([sys.executable, str(driver), str(run), json.dumps(flags)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 1, out.stdout[-2000:] + _why(run)
    failed = _line(out.stdout, "FAILED")
    assert failed.startswith("training job exited with code 78") and "none made: a relaunch would repeat it" in failed
    assert "every member of the population diverged: each ended its training with 10 or more steps in a row " \
           "skipped" in failed, failed
    err = (run / "train.err").read_text()
    assert err.count("train_surrogate: error:") == 1 and "ignoring the training job's summary" not in out.stderr
    assert json.loads((run / "train_summary.json").read_text())["final_loss"] is None


@pytest.mark.timeout(300)
def test_a_watchdog_killed_by_sigkill_is_relaunched_and_nothing_of_the_first_job_outlives_it(tmp_path):
    driver = _script(tmp_path, "my_campaign.py", DRIVER)
    run = tmp_path / "run"
    release = tmp_path / "release"
    flags = {"sim": ["--steps", "400", "--every", "40", "--stream", "--hold-file", str(release), "--hold-at", "5"],
             "steps": 400, "train": ["--t-max", repr(t_max(400)), "--ckpt-every", "5", "--watermark", "2",
                                    "--hold-at", "5", "--release", str(release), "--keep", "50"]}
    proc = subprocess.Popen([sys.executable, str(driver), str(run), json.dumps(flags)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while "every sample sent before the hold is checkpointed" not in _text(run / "train.out"):
            assert time.monotonic() < deadline and proc.poll() is None, _why(run)
            time.sleep(0.1)
        first = (run / "trainer.lease").read_text().strip()
        (watchdog,) = [p for p in _pids_with(f"HPCML_TRAINER_LAUNCH={first}") if b"hpcml.ensemble.watchdog" in
                       Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(_pids_with(f"HPCML_TRAINER_LAUNCH={first}")) >= 4  # watchdog, bash, mpiexec, its proxy, ranks
        os.kill(watchdog, signal.SIGKILL)  # as an OOM killer does
        t_kill, gone_after = time.monotonic(), None
        while time.monotonic() - t_kill < 10:
            if not _pids_with(f"HPCML_TRAINER_LAUNCH={first}"):
                gone_after = time.monotonic() - t_kill
                break
            time.sleep(0.1)
        assert gone_after is not None, [Path(f"/proc/{p}/cmdline").read_bytes() for p in
                                        _pids_with(f"HPCML_TRAINER_LAUNCH={first}")]
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-2000:] + _why(run)
    res = json.loads(_line(out, "RESULT"))
    assert res["status"] == "ok" and (res["samples"]["ingested"], res["samples"]["missing"]) == (40, 0)
    record = json.loads((run / "campaign.json").read_text())
    assert (record["training"]["restarts"], record["training"]["returncode"]) == (1, 0)
    assert (run / "trainer.lease").read_text().strip() != first and release.exists()  # the relaunch released the sims
    assert "Address already in use" not in _text(run / "train.err")


@pytest.mark.timeout(200)
def test_a_trainer_whose_driver_and_watchdog_are_both_killed_exits_by_itself(tmp_path):
    """Nothing outlives the driver, even when the watchdog that would end the trainer dies
    with it (one SIGKILL for the whole session): every rank sees its driver gone and exits."""
    driver = _script(tmp_path, "my_campaign.py", DRIVER)
    run = tmp_path / "run"
    flags = {"sim": ["--steps", "40000", "--every", "4000", "--stream"], "steps": 100000,
             "train": ["--t-max", repr(t_max(40000)), "--ckpt-every", "1000", "--watermark", "2"]}
    proc = subprocess.Popen([sys.executable, str(driver), str(run), json.dumps(flags)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "trainer.lease").exists() or not _ranks_of(run):
            assert time.monotonic() < deadline and proc.poll() is None, _why(run)
            time.sleep(0.2)
        launch = (run / "trainer.lease").read_text().strip()
        watchdogs = [p for p in _pids_with(f"HPCML_TRAINER_LAUNCH={launch}") if b"hpcml.ensemble.watchdog" in
                     Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(watchdogs) == 1 and len(_ranks_of(run)) == 2
        for pid in (proc.pid, *watchdogs):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while _pids_with(f"HPCML_TRAINER_LAUNCH={launch}") and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        left = [Path(f"/proc/{p}/cmdline").read_bytes()[:100] for p in _pids_with(f"HPCML_TRAINER_LAUNCH={launch}")]
        assert left == [], left
    finally:
        for pid in _pids_with(f"HPCML_RUN_DIR={run}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "the campaign's driver (pid" in _text(run / "train.err") and "is gone: exiting" in _text(run / "train.err")


def _ranks_of(run: Path) -> list[int]:
    return [p for p in _pids_with(f"HPCML_RUN_DIR={run}") if b"train_burgers.py" in
            Path(f"/proc/{p}/cmdline").read_bytes() and b"mpiexec" not in Path(f"/proc/{p}/cmdline").read_bytes()
            and b"watchdog" not in Path(f"/proc/{p}/cmdline").read_bytes()
            and b"bash" not in Path(f"/proc/{p}/cmdline").read_bytes()[:20]]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _pids_with(entry: str) -> list[int]:
    """Live processes whose environment holds ``entry`` (NAME=value)."""
    needle, out = entry.encode() + b"\0", []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes() + b"\0" \
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(d.name))
        except OSError:
            continue
    return out
