"""The main job end to end, and its reliability: a simulation killed mid-run, the trainer
killed and restarted from its checkpoint. Real Parsl, real mpiexec, real ZeroMQ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--sims", "6", "--val-sims", "1", "--nx", "16", "--ny", "16", "--sim-steps", "400", "--every", "40",
         "--max-concurrent", "3", "--quiet"]
OUTPUTS = 400 // 40  # per simulation


def run(tmp_path: Path, *extra: str, name: str = "run", ok: bool = True) -> tuple[dict, Path]:
    run_dir = tmp_path / name
    proc = subprocess.run([sys.executable, str(ROOT / "workflows" / "heat_surrogate.py"), "--run-dir", str(run_dir),
                           *SMALL, *extra], cwd=ROOT, capture_output=True, text=True, timeout=400)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:] + (run_dir / "train.err").read_text()[-3000:] \
            if (run_dir / "train.err").exists() else proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["_returncode"], summary["_stderr"] = proc.returncode, proc.stderr
    return summary, run_dir


def provenance(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "provenance.jsonl").read_text().splitlines()]


def test_online_run_ingests_every_sample_once_and_reports(tmp_path):
    s, run_dir = run(tmp_path, "--steps", "200")
    assert s["mode"] == "online" and s["sims_completed"] == 6 and s["sims_failed"] == 0
    assert s["samples_ingested"] == 6 * OUTPUTS and s["duplicate_samples"] == 0 and s["samples_missing"] == 0
    assert s["dropped_messages"] == {} and s["gradient_steps"] == 200
    assert s["bytes_ingested"] == 6 * OUTPUTS * 16 * 16 * 4
    # held-out error after 200 online steps on samples in arrival order (timing-dependent): finite and
    # not diverged; that it learned is the training-loss drop below (val < 1 failed 4 of 6 runs at 1.01-1.13)
    assert 0 < s["val_rel_l2"] < 1.5 and s["val_samples"] == OUTPUTS
    assert 0 <= s["trainer_idle_fraction"] < 0.5
    for key in ("intake_mb_s", "wall_s", "sims_completed", "samples_ingested", "duplicate_samples", "val_rel_l2"):
        assert key in s
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 201))
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 5  # it learned
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000200"
    prov = provenance(run_dir)
    assert sorted(r["sim_id"] for r in prov) == list(range(7)) and all(r["status"] == "ok" for r in prov)
    streamed = [r for r in prov if r["sim_id"] < 6]
    assert all(r["samples_sent"] == OUTPUTS for r in streamed)
    # the checkpoint holds the stream state: every ingested key once, readable by plain h5py
    import h5py
    import numpy as np

    ck = run_dir / "checkpoints" / "step_00000200" / "index.h5"
    with h5py.File(ck) as f:
        seen = np.concatenate([f[f"stream/rank_{r:05d}/seen"][()] for r in range(2)
                               if f"stream/rank_{r:05d}/seen" in f])
    assert len(seen) == 6 * OUTPUTS and len({tuple(k) for k in seen.tolist()}) == 6 * OUTPUTS


def test_killed_simulation_is_retried_and_no_sample_is_trained_twice(tmp_path):
    # sim 2's rank 0 SIGKILLs itself at time step 200 on attempt 0; Parsl retries it. FIFO:
    # every sample is used exactly once, so a duplicate ingestion would show as reuse.
    s, run_dir = run(tmp_path, "--crash-sim", "2:200", "--buffer", "fifo", "--capacity", "64", "--watermark", "4",
                     "--batch", "2", "--steps", "1000")
    assert s["sims_completed"] == 6 and s["sims_retried"] == 1 and s["sim_attempts"] == 8
    assert s["samples_ingested"] == 6 * OUTPUTS and s["samples_missing"] == 0
    assert 0 <= s["duplicate_samples"] <= 4  # steps 40..160 of attempt 0, unless lost with the killed rank
    for rank in s["buffer"]["per_rank"]:
        assert set(rank["reuse_hist"]) <= {"1"}, rank  # nothing trained on twice
    assert s["samples_trained"] + s["samples_unused"] == 6 * OUTPUTS  # FIFO: each used once or left over
    sim2 = sorted((r["attempt"], r["status"]) for r in provenance(run_dir) if r["sim_id"] == 2)
    assert [a for a, _ in sim2] == [0, 1] and sim2[0][1] != "ok" and sim2[1][1] == "ok"


def test_trainer_killed_resumes_from_checkpoint_while_simulations_reconnect(tmp_path):
    s, run_dir = run(tmp_path, "--crash-trainer-at", "30", "--ckpt-every", "20", "--steps", "200",
                     "--sim-steps", "4000", "--every", "400", ok=False)  # long simulations: still running at the kill
    out = (run_dir / "train.out").read_text()
    assert "killing trainer rank 0 after step 30 (crash 1 of 1)" in out
    resumed = [line for line in out.splitlines() if "resumed at step" in line]
    assert len(resumed) == 1 and "resumed at step 20 " in resumed[0], out[-2000:]
    assert s["gradient_steps"] == 200 and s["sims_completed"] == 6 and s["sims_failed"] == 0
    assert s["duplicate_samples"] == 0
    # what the killed trainer ingested after its last checkpoint is not re-sent (documented limit);
    # if anything was lost the run says so and fails (no silent success), else it succeeds
    assert s["samples_ingested"] + s["samples_missing"] == 6 * 10
    if s["samples_missing"]:
        assert (s["_returncode"], s["status"]) == (1, "failed")
        assert (f"{s['samples_missing']} of 60 samples of completed simulations never reached training (simulation "
                in s["_stderr"].splitlines()[-1])
        assert s["samples_missing"] == sum(s["missing_by_sim"].values())
    else:
        assert (s["_returncode"], s["status"]) == (0, "ok"), s["_stderr"][-2000:]
    metrics = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[:30] == list(range(1, 31)) and metrics[30:] == list(range(21, 201))  # resumed at 21
    assert s["samples_ingested"] == _checkpointed_samples(run_dir)  # the summary is the stream state


def _checkpointed_samples(run_dir: Path) -> int:
    """Samples the latest checkpoint's stream state holds, over every saved trainer rank, each once."""
    from hpcml.train.online import load_source_states

    keys = [tuple(k) for st in load_source_states(run_dir / "checkpoints") for k in st["seen"].tolist()]
    assert len(keys) == len(set(keys))
    return len(keys)


def test_trainer_killed_twice_on_another_rank_then_restarts_exhausted(tmp_path):
    """Issue 12: the summary after restarts matches the checkpointed stream state on 2 trainer
    ranks (it said 28 ingested with 158 in the checkpoint); the restart policy is explicit
    (--trainer-restarts), and past it the run writes summary.json with the reason and fails."""
    long = ["--ckpt-every", "20", "--steps", "60", "--sim-steps", "4000", "--every", "400", "--crash-trainer-at", "30",
            "--crash-trainer-times", "2", "--crash-trainer-rank", "1"]
    s, run_dir = run(tmp_path, *long, "--trainer-restarts", "2", ok=False)
    out = (run_dir / "train.out").read_text()
    resumed = (run_dir / "train.err").read_text().count("INFO hpcml.train.online: resumed at step 20 from")
    assert "killing trainer rank 1 after step 30 (crash 2 of 2)" in out and resumed == 2, (
        out[-1500:] + (run_dir / "train.err").read_text()[-3000:])
    assert s["gradient_steps"] == 60 and s["sims_completed"] == 6
    assert s["samples_ingested"] == _checkpointed_samples(run_dir) and s["duplicate_samples"] == 0
    assert s["samples_ingested"] + s["samples_missing"] == 60
    assert (s["_returncode"], s["status"]) == ((1, "failed") if s["samples_missing"] else (0, "ok")), s["_stderr"]
    # one restart allowed, two crashes: the run stops, says why, and exits non-zero
    s, run_dir = run(tmp_path, *long, "--trainer-restarts", "1", name="exhausted", ok=False)
    assert (s["_returncode"], s["status"]) == (1, "failed")
    (why,) = s["problems"]
    assert why.startswith("training job exited with code 9 after ") and "1 of 1 restart(s) used, none left" in why
    assert why.endswith("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)"), why
    assert "Traceback" not in s["_stderr"] and s["_stderr"].strip().splitlines()[-1] == f"heat_surrogate: failed: {why}"


def test_nothing_outlives_a_killed_driver(tmp_path):
    """Issue 12: `kill -9` of the driver left the trainer's mpiexec, its proxy and both ranks
    waiting for ever; now the trainer's watchdog and the attempts' wrapper end them."""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "workflows" / "heat_surrogate.py"), "--run-dir", str(run_dir),
                             *SMALL, "--steps", "100000", "--sim-steps", "40000", "--every", "4000", "--no-report"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not (run_dir / "endpoints.json").exists():  # the trainer is up, the simulations start
            assert time.monotonic() - t0 < 120 and proc.poll() is None
            time.sleep(0.2)
        time.sleep(3)
        before = _processes_of(run_dir, proc.pid)
        assert len(before) >= 6, before  # watchdog, bash, mpiexec, proxy, 2 ranks; and simulations
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t1 = time.monotonic()
        while _processes_of(run_dir, proc.pid) and time.monotonic() - t1 < 10:
            time.sleep(0.2)
        left = _processes_of(run_dir, proc.pid)
        assert left == [], left
    finally:
        _kill_everything_of(run_dir)


def _processes_of(run_dir: Path, driver: int) -> list[str]:
    """Live (not zombie) processes of this campaign, by command line or environment."""
    import os

    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in (os.getpid(), driver):
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            if (str(run_dir).encode() in cmd or f"HPCML_RUN_DIR={run_dir}".encode() in (d / "environ").read_bytes()) \
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace")[:120])
        except OSError:
            continue
    return found


def _kill_everything_of(run_dir: Path) -> int:
    """SIGKILL every process of this campaign (driver, trainer, simulations), as the end of
    a job without a warning does; how many."""
    import os
    import signal
    import time

    killed = 0
    for _ in range(3):  # the driver may start one more attempt while the others die
        for d in Path("/proc").iterdir():
            try:
                mine = d.name.isdigit() and (str(run_dir).encode() in (d / "cmdline").read_bytes() or
                                             f"HPCML_RUN_DIR={run_dir}".encode() in (d / "environ").read_bytes())
            except OSError:
                continue
            if mine and int(d.name) != os.getpid():
                try:
                    os.kill(int(d.name), signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        time.sleep(0.3)
    return killed


def test_resume_after_a_hard_kill_runs_again_what_the_checkpoint_lacks(tmp_path):
    """The job killed at its walltime with no warning (everything SIGKILLed), then the same
    command again with --resume: simulations that finished after the trainer's last save
    run again, and every sample is ingested exactly once."""
    import time

    run_dir = tmp_path / "run"
    # training ends (and saves) at step 30, early; the trainer then takes in the rest of the
    # stream without saving until the end: simulations that finish meanwhile are in no checkpoint
    # (at step 60 with simulations a quarter as long, the save came after every simulation in some
    # runs on a loaded host: nothing left to test)
    cmd = [sys.executable, str(ROOT / "workflows" / "heat_surrogate.py"), "--run-dir", str(run_dir), *SMALL,
           "--steps", "30", "--ckpt-every", "30", "--watermark", "4", "--max-concurrent", "1", "--resume",
           "--sim-steps", "4800", "--every", "480"]  # slow simulations: the save comes while they run
    from hpcml.train.online import simulations_in

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, held, finished = time.monotonic() + 200, None, set()
    # the save at step 30, then a simulation finished that it does not hold (one whose provenance line
    # came after the save may still be all in it; all six may be done while the trainer still ingests)
    while time.monotonic() < deadline:
        prov = run_dir / "provenance.jsonl"
        finished = {json.loads(x)["sim_id"] for x in prov.read_text().splitlines()
                    if x.endswith("}") and json.loads(x)["status"] == "ok" and json.loads(x)["sim_id"] < 6} \
            if prov.exists() else set()
        if held is None and (run_dir / "checkpoints" / "latest").exists():
            held = simulations_in(run_dir / "checkpoints", OUTPUTS)  # what the save holds
        if held is not None and finished - held or proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None and held is not None and finished - held, \
        f"no moment to kill: the save holds {held}, {sorted(finished)} done, run exit {proc.poll()}"
    assert _kill_everything_of(run_dir) >= 2
    proc.wait(timeout=30)
    held = simulations_in(run_dir / "checkpoints", OUTPUTS)  # what the last save holds
    finished = {r["sim_id"] for r in provenance(run_dir) if r["status"] == "ok" and r["sim_id"] < 6}
    n_before = len(provenance(run_dir))
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["status"], s["sims_completed"], s["samples_ingested"], s["samples_missing"]) == ("ok", 6, 60, 0)
    import h5py
    import numpy as np

    step = (run_dir / "checkpoints" / "latest").read_text().strip()
    with h5py.File(run_dir / "checkpoints" / step / "index.h5") as f:
        seen = np.concatenate([f[f"stream/rank_{r:05d}/seen"][()] for r in range(2)
                               if f"stream/rank_{r:05d}/seen" in f])
    assert len(seen) == 60 == len({tuple(k) for k in seen.tolist()})  # every sample once
    ran_again = {r["sim_id"] for r in provenance(run_dir)[n_before:] if r["sim_id"] < 6}
    assert ran_again == set(range(6)) - held  # what the checkpoint lacked, and only that
    assert finished - held, "the kill came before any simulation finished after the last save: nothing tested"


@pytest.mark.parametrize("bad, says", [
    (["--sims", "0"], "--sims must be >= 1, got 0"),
    (["--sim-steps", "10", "--every", "40"], "--sim-steps 10 < --every 40"),
    (["--watermark", "300", "--capacity", "256"], "--capacity 256 --watermark 300: buffer needs capacity >= 1 and "
                                                  "0 <= watermark <= capacity, got capacity 256, watermark 300"),
    (["--lr", "-1"], "--lr -1.0: expected a finite learning rate > 0"),
    (["--lr", "nan"], "--lr nan: expected a finite learning rate > 0"),
    (["--trainer-restarts", "-1"], "--trainer-restarts must be >= 0, got -1"),
    (["--site", "nosuchsite"], "nosuchsite"),
    (["--run-dir", "FILE/x"], "--run-dir {tmp}/FILE/x: Not a directory; expected a directory (or a path to create "
                              "one) under a directory"),
])
def test_bad_arguments_fail_in_one_line(tmp_path, bad, says):
    """Issue 12: a trainer config error used to surface as the driver's traceback of MPI_Abort
    lines, --site and --run-dir as tracebacks: each is one line now, before anything starts."""
    (tmp_path / "FILE").write_text("a regular file")
    bad = [b.replace("FILE", str(tmp_path / "FILE")) for b in bad]
    proc = subprocess.run([sys.executable, str(ROOT / "workflows" / "heat_surrogate.py"), "--run-dir",
                           str(tmp_path / "x"), *bad], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "error:" in lines[-1] and says.format(tmp=tmp_path) in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x").exists()


def test_offline_mode_trains_from_the_files_at_equal_steps(tmp_path):
    s, run_dir = run(tmp_path, "--mode", "offline", "--steps", "100", name="off")
    assert s["mode"] == "offline" and s["sims_completed"] == 6 and s["gradient_steps"] == 100
    assert s["samples_ingested"] == 6 * OUTPUTS and s["samples_missing"] == 0
    files = sorted(p.name for p in (run_dir / "data").glob("sim_*.h5"))
    assert files == [f"sim_{i:05d}.h5" for i in range(6)]
    assert not (run_dir / "endpoints.json").exists()  # nothing streamed
    # held-out error after 100 steps: 0.92-0.97 here, 1.01 once in CI (the buffer fills while training
    # starts, so the order varies): finite and not diverged; that it learned is the loss drop below
    assert 0 < s["val_rel_l2"] < 1.5
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 101))
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 5  # it learned (0.168 -> 0.0065 here)


def test_offline_trainer_killed_resumes_and_reads_every_sample_once(tmp_path):
    """Offline, the file source's state is in the checkpoint: the restarted trainer reads on
    from where its last save was, takes no sample twice and loses none."""
    s, run_dir = run(tmp_path, "--mode", "offline", "--steps", "100", "--crash-trainer-at", "30", "--ckpt-every", "20",
                     name="off-crash")
    out = (run_dir / "train.out").read_text()
    assert "killing trainer rank 0 after step 30 (crash 1 of 1)" in out and "[train] resumed at step 20 " in out, \
        out[-2000:]
    assert (s["status"], s["gradient_steps"], s["samples_missing"], s["duplicate_samples"]) == ("ok", 100, 0, 0)
    assert s["samples_ingested"] == 6 * OUTPUTS
    import h5py
    import numpy as np

    step = (run_dir / "checkpoints" / "latest").read_text().strip()
    with h5py.File(run_dir / "checkpoints" / step / "index.h5") as f:
        seen = np.concatenate([f[f"stream/rank_{r:05d}/seen"][()] for r in range(2)])
    assert len(seen) == len({tuple(k) for k in seen.tolist()}) == 6 * OUTPUTS
