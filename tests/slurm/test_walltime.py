"""The walltime, survived: the job script asks Slurm for SIGUSR1 before the end, the trainer
saves and exits 75, the job requeues itself and the next run resumes from `latest` -- until
the training is done, with the losses of an uninterrupted run, bitwise (same layout). The job is
`hpcml plan --emit job`'s, on a packed corpus (issue 43)."""

from __future__ import annotations

import subprocess

from tests.slurm.scenarios import BIN, ENV, LLM, PY, ROOT, final_losses, job, metrics, segments, sh, wait_done, \
    wait_until

# Long enough that the warning always lands mid-training: Slurm sends it by 60 s into the
# 2-minute job, and 80 steps once finished in 51 s on a quiet host, before any warning came;
# 100 take >= 64 s of training after ~10 s of start-up alone, and twice that beside the reference
# run, which trains at the same time (160, once: 276 s of the Slurm suite's 580). At micro-batch 1
# (8 micro-steps a step, given: the plan would take 8, one micro-step, and the steps would end first).
STEPS = 100
ARGS = ["--tp", "2", "--steps", str(STEPS), "--seed", "0", "--no-progress"]


def test_training_split_by_the_walltime_and_a_signal_resumes_bitwise(tmp_path):
    """Issue 43 too: the job is the one `hpcml plan --emit job` writes (`eval` submits it), on a
    corpus packed from hpcml's own sources; the plan prices the layout on a device it knows,
    the site says where the job goes."""
    import shlex

    corpus = tmp_path / "corpus.h5"
    sources = sorted(str(p) for p in (ROOT / "hpcml").rglob("*.py"))[:80]  # real text
    sh(str(BIN / "hpcml"), "data", "pack", str(corpus), *sources, "--tokenizer", "bytes", check=True)
    data = ["--data", str(corpus)]
    reference = subprocess.Popen(["mpiexec", "-n", "2", PY, LLM, *ARGS, *data], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                 env={k: v for k, v in ENV.items() if k != "SLURM_CONF"})
    run = tmp_path / "run"
    plan = sh(str(BIN / "hpcml"), "plan", "--model", "tiny", "--gpus", "2", "--gpu", "a100-80gb", "--site",
              "slurm-local", "--gpus-per-node", "1", "--seq-len", "32", "--global-batch", "8", "--tp", "2",
              "--precision", "fp32", "--micro-batch", "1", "--emit", "job", "--steps", str(STEPS), "--walltime",
              "00:02:00", *data,
              "--ckpt-every", "10", check=True)
    line = shlex.split(plan.stdout.strip())
    assert line[:2] == ["hpcml", "job"] and "--submit" in line and "--auto-resume" in line, line
    # as the user runs it (eval), with a name and a run directory of this test's; a real 2-minute walltime:
    # Slurm sends USR1 at the first of slurmctld's 30-s ticks once 60 + 30 s or less are left: 30-60 s in
    line[2:2] = ["--name", "wall", "--warn", "60"]
    line += ["--seed", "0", "--no-progress", "--run-dir", str(run)]
    out = subprocess.run(shlex.join(line), shell=True, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    job_id = out.stdout.strip().splitlines()[0]
    assert job_id.isdigit(), out.stdout
    wait_until(lambda: int(job(job_id).get("Restarts", 0)) >= 1, 240, "the walltime warning to requeue the job")
    assert len(metrics(run)) < STEPS  # the walltime split it, not the end of training
    # the second run: stopped by hand, as `scancel --signal` does for a test
    wait_until(lambda: len(p := segments(metrics(run))) >= 2 and len(p[-1]) >= 3, 240, "the resumed run's steps")
    sh("scancel", "--signal=USR1", "--batch", job_id, check=True)
    record = wait_done(job_id, 420)
    text = (tmp_path / f"wall-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text[-3000:]
    assert int(record["Restarts"]) >= 2, text[-3000:]
    assert text.count("hpcml-job: not finished (exit 75): requeueing job") >= 2
    parts = segments(metrics(run))
    assert len(parts) >= 3
    for before, after in zip(parts, parts[1:]):  # saved at the signal: the next run starts right after it
        assert after[0]["step"] == before[-1]["step"] + 1
    out, err = reference.communicate(timeout=600)
    assert reference.returncode == 0, err[-2000:]
    expected = [float(x) for x in __import__("json").loads(out.strip().splitlines()[-1])["losses"]]
    final = final_losses(metrics(run))
    assert sorted(final) == list(range(1, STEPS + 1))
    assert [final[s] for s in range(1, STEPS + 1)] == expected  # bitwise

