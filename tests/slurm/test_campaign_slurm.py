"""An online campaign on the real Slurm cluster, both ways a centre runs one:

- pilot: the driver in a login shell; Parsl's SlurmProvider submits the simulations' block,
  the trainer gets an allocation of its own (srun);
- one allocation: the driver inside an `hpcml job --driver` batch job; the trainer on the
  job's first node, the simulations as srun steps on the other (Parsl's workers start in
  the job) -- and split by the walltime warning into two jobs: every simulation completes
  exactly once, every sample is ingested exactly once, no finished simulation runs again;
- the same, adaptive (issue 25): the simulations proposed in waves from the trainer's
  feedback; the requeued job proposes the same waves and runs none of them twice.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np

from tests.slurm.scenarios import ENV, HEAT, PY, ROOT, job, sh, submit, wait_done, wait_until

SIMS, OUTPUTS = 6, 400 // 40
SMALL = ["--sims", str(SIMS), "--val-sims", "1", "--nx", "16", "--ny", "16", "--sim-steps", "400", "--every", "40",
         "--max-concurrent", "3", "--steps", "150", "--ckpt-every", "25", "--quiet", "--no-report"]
# Simulations of 1-3 s each (the same 10 outputs, further apart): the warning must find one
# running, which sub-second ones on a loaded host did not always allow; 200,000 steps (3-6 s)
# cost the suite ~200 CPU-seconds of its ~770, half of them in the simulations' steps.
LONG = [*SMALL[:SMALL.index("--sim-steps")], "--sim-steps", "100000", "--every", "10000",
        *SMALL[SMALL.index("--every") + 2:]]


def provenance(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "provenance.jsonl").read_text().splitlines()]


def running(run_dir: Path) -> list[int]:
    """The simulations with an attempt started and not ended (``sims/sim_N/attempt_K.start``
    without its ``.end``)."""
    return sorted(int(p.parent.name.split("_")[1]) for p in (run_dir / "sims").glob("sim_*/attempt_*.start")
                  if not p.with_suffix(".end").exists())


def seen_keys(run_dir: Path) -> np.ndarray:
    ck = run_dir / "checkpoints"
    step = (ck / "latest").read_text().strip()
    with h5py.File(ck / step / "index.h5") as f:
        return np.concatenate([f[f"stream/rank_{r:05d}/seen"][()] for r in range(2)
                               if f"stream/rank_{r:05d}/seen" in f])


def test_pilot_campaign_from_a_login_shell(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([PY, HEAT, "--site", "slurm-local", "--nodes", "1", "--walltime", "00:10:00",
                          "--run-dir", str(run_dir), *SMALL], capture_output=True, text=True, env=ENV, cwd=ROOT,
                         timeout=400)
    assert out.returncode == 0, out.stderr[-3000:] + (run_dir / "train.err").read_text()[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["status"], s["sims_completed"], s["samples_ingested"], s["samples_missing"]) == ("ok", SIMS,
                                                                                             SIMS * OUTPUTS, 0)
    recs = provenance(run_dir)
    assert sorted(r["sim_id"] for r in recs if r["status"] == "ok") == list(range(SIMS + 1))
    for r in recs:  # MPIExecutor's srun step inside Parsl's block
        assert r["command"].startswith("srun --ntasks 2 --ntasks-per-node 2 --nodelist n"), r["command"]
    campaign = json.loads((run_dir / "campaign.json").read_text())
    assert campaign["training"]["launch"].startswith(
        f"srun --time=00:10:00 --signal=USR1@60 --partition=debug -N1 -n2 --ntasks-per-node=2 --mpi=pmi2 {PY} ")
    assert list((run_dir / "parsl").glob("*/submit_scripts/parsl.sims.block*"))  # Parsl submitted a block


def test_one_allocation_campaign_split_by_the_walltime_warning(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [PY, HEAT, "--site", "slurm-local", "--resume", "--run-dir", str(run_dir), *LONG]
    job_id = submit(tmp_path, "campaign", nodes="2", walltime="00:10:00", cmd=cmd, driver=True)
    # the warning comes once three simulations are done and another has just started
    wait_until(lambda: (run_dir / "provenance.jsonl").exists() and
               sum(r["status"] == "ok" for r in provenance(run_dir)) >= 3 and running(run_dir), 300,
               "three finished simulations and a running one")
    sh("scancel", "--signal=USR1", "--batch", job_id, check=True)
    record = wait_done(job_id, 400)
    text = (tmp_path / f"campaign-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and int(record["Restarts"]) >= 1, text[-3000:]
    assert "hpcml-job: not finished (exit 75): requeueing job" in text and "interrupted (walltime warning)" in text
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["status"], s["sims_completed"], s["sims_failed"]) == ("ok", SIMS, 0), s
    assert s["sims_resumed"] >= 3  # finished before the warning: not run again
    train_out = (run_dir / "train.out").read_text()
    assert "[train] stopped at step" in train_out and "[train] resumed at step" in train_out
    assert (s["samples_ingested"], s["samples_missing"]) == (SIMS * OUTPUTS, 0), s
    keys = seen_keys(run_dir)  # exactly once: every (simulation, output step) ingested once
    assert len(keys) == SIMS * OUTPUTS == len({tuple(k) for k in keys.tolist()})
    assert sorted({int(k[0]) for k in keys}) == list(range(SIMS))
    recs = provenance(run_dir)
    for sim in range(SIMS + 1):
        mine = [r for r in recs if r["sim_id"] == sim]
        ok = [r for r in mine if r["status"] == "ok"]
        assert len(ok) == 1, mine  # completed exactly once
        assert all(r["start"] <= ok[0]["end"] for r in mine)  # nothing of it ran after it finished
    assert any(r["status"] == "cancelled" for r in recs)  # the warning stopped a running one
    campaign = json.loads((run_dir / "campaign.json").read_text())
    assert campaign["deadline"] is not None  # every timeout followed from the walltime
    assert campaign["training"]["launch"].startswith("srun --nodelist=n1 -N1 -n2 ")  # trainer on the first node
    assert {r["command"].split("--nodelist ")[1].split()[0] for r in recs} == {"n2"}  # simulations on the other
    assert job(job_id)["NodeList"] == "n[1-2]"


def waves(run_dir: Path) -> list[dict]:
    """The recorded waves (a line being appended is not one yet)."""
    path = run_dir / "waves.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")] \
        if path.exists() else []


def test_adaptive_campaign_split_by_the_walltime_warning(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [PY, HEAT, "--site", "slurm-local", "--resume", "--run-dir", str(run_dir), "--adaptive", "--wave", "2",
           *LONG]
    job_id = submit(tmp_path, "adaptive", nodes="2", walltime="00:10:00", cmd=cmd, driver=True)
    # the warning comes with two waves proposed, three simulations done and another running
    wait_until(lambda: len(waves(run_dir)) >= 2 and (run_dir / "provenance.jsonl").exists() and
               sum(r["status"] == "ok" and r["sim_id"] < SIMS for r in provenance(run_dir)) >= 3 and running(run_dir),
               300, "two waves, three finished simulations and a running one")
    sh("scancel", "--signal=USR1", "--batch", job_id, check=True)
    before = waves(run_dir)
    record = wait_done(job_id, 400)
    text = (tmp_path / f"adaptive-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and int(record["Restarts"]) >= 1, text[-3000:]
    assert "hpcml-job: not finished (exit 75): requeueing job" in text and "interrupted (walltime warning)" in text
    after = waves(run_dir)
    assert after[:len(before)] == before  # the requeued job proposed on from the recorded waves
    assert [w["ids"] for w in after] == [[0, 1], [2, 3], [4, 5]]
    s = json.loads((run_dir / "summary.json").read_text())
    assert (s["status"], s["sims_completed"], s["sims_failed"]) == ("ok", SIMS, 0), s
    assert s["sims_resumed"] >= 3
    train_out = (run_dir / "train.out").read_text()  # the warning split the training too
    assert "[train] stopped at step" in train_out and "[train] resumed at step" in train_out
    # a simulation cut off by the warning runs again and resends what the trainer already holds:
    # the server drops those (duplicate_samples counts them), so every sample is trained on once
    assert (s["samples_ingested"], s["samples_missing"]) == (SIMS * OUTPUTS, 0), s
    keys = seen_keys(run_dir)  # exactly once
    assert len(keys) == SIMS * OUTPUTS == len({tuple(k) for k in keys.tolist()})
    recs = provenance(run_dir)
    for sim in range(SIMS + 1):  # the held-out one (id 6) beside the waves
        mine = [r for r in recs if r["sim_id"] == sim]
        assert sum(r["status"] == "ok" for r in mine) == 1, mine
    assert any(r["status"] == "cancelled" for r in recs)  # the warning stopped a running one
    assert json.loads((run_dir / "campaign_id.json").read_text())["simulations"]["count"] == SIMS + 1


def test_bundled_members_stream_through_the_scheduler_every_sample_once(tmp_path):
    """Issue 39, part 6 scaled down (the benchmark runs 10,000): members bundled 100 to a task
    through the site's Parsl executor on the Slurm nodes, each streaming one sample into a
    2-rank trainer: every member once, every sample once."""
    out = subprocess.run([PY, str(ROOT / "benchmarks" / "campaign_scale.py"), "--json", "--site", "slurm-local",
                          "--sims", "300", "--bundle", "100", "--threads", "3"], capture_output=True, text=True,
                         env=ENV, cwd=ROOT, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert (row["status"], row["duplicates"], row["missing"], row["training_returncode"]) == ("ok", 0, 0, 0), row
    assert (row["samples_expected"], row["samples_ingested"], row["samples_missing"], row["duplicate_samples"]) == \
        (300, 300, 0, 0), row
