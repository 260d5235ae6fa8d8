"""Checkpoints as a user meets them: a job stopped by the scheduler's signal resumes with the
same losses -- bitwise on the same layout, to 1e-4 on another layout and rank count --,
a save killed at any moment never breaks `latest`, and plain h5py reads the checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.workflows.test_llm_pretrain import ARGS, SCRIPT, losses
from tests.workflows.test_mpi_launch import ENV, ROOT, mpiexec

STEPS = ["--steps", "8", "--seed", "0", "--no-progress"]


def result(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """An 8-step tp2 x pp2 run stopped by SIGUSR1 (as a scheduler warns before walltime) after
    step >= 2, and the same run uninterrupted -- which saves every 3 steps in the background
    (``--async-save --async-overlap``: the snapshot copy beside the next step's forward and
    backward, the optimizer step waiting for it) into a directory of its own: the reference
    losses come from a run that saved asynchronously, and the stopped run, which did not,
    must match them."""
    base = tmp_path_factory.mktemp("resume")
    ck, run = base / "ck", base / "run"
    uninterrupted = result(mpiexec(4, sys.executable, SCRIPT, "--tp", "2", "--pp", "2", *STEPS, "--ckpt-dir",
                                   str(base / "async"), "--ckpt-every", "3", "--async-save", "--async-overlap",
                                   timeout=300))
    proc = subprocess.Popen(["mpiexec", "-n", "4", sys.executable, SCRIPT, "--tp", "2", "--pp", "2", *STEPS,
                             "--ckpt-dir", str(ck), "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    subprocess.run(["pkill", "-USR1", "-f", f"^{sys.executable} {SCRIPT} .*{ck}"], check=False)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]  # saved and stopped early: "not finished"
    assert "stopped by a signal at step" in err and "exit 75 (not finished" in err
    first = json.loads(out.strip().splitlines()[-1])
    return uninterrupted["losses"], first, ck, base / "async"


def test_signal_saves_and_stops(stopped):
    full, first, ck, _ = stopped
    k = first["steps"][-1]
    assert 2 <= k < 8, f"stopped after step {k}"
    assert (ck / "latest").read_text().strip() == f"step_{k:08d}"
    assert first["losses"] == full[:k]


def test_resume_same_layout_is_bitwise(stopped):
    full, first, ck, _ = stopped
    k = first["steps"][-1]
    out = result(mpiexec(4, sys.executable, SCRIPT, "--tp", "2", "--pp", "2", *STEPS, "--ckpt-dir", str(ck),
                         "--resume", timeout=300))
    assert out["steps"] == list(range(k + 1, 9))
    assert out["losses"] == full[k:]  # bitwise: same layout, same reduction order


@pytest.mark.parametrize("n,flags", [(2, ["--fsdp"]), (1, []), (4, ["--cp", "2"])],
                         ids=["fsdp2", "one-process", "cp2xdp2"])
def test_resume_other_layout_and_rank_count(stopped, tmp_path, n, flags):
    full, first, ck, _ = stopped
    k = first["steps"][-1]
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)  # keep the shared checkpoint untouched
    cmd = [sys.executable, SCRIPT, *flags, *STEPS, "--ckpt-dir", str(copy), "--resume"]
    out = result(mpiexec(n, *cmd, timeout=300) if n > 1 else
                 subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300))
    assert out["steps"] == list(range(k + 1, 9))
    assert out["losses"] == pytest.approx(full[k:], rel=1e-4)


def test_resume_without_checkpoint_is_one_line(tmp_path):
    out = mpiexec(2, sys.executable, SCRIPT, *ARGS, "--ckpt-dir", str(tmp_path / "none"), "--resume", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"llm_pretrain: error: no checkpoint at {tmp_path / 'none'}: the path does not exist"]


def test_a_second_job_on_the_checkpoint_directory_is_one_line_on_every_rank(tmp_path):
    """Issue 40: the refusal was clear but came as a traceback from the first step."""
    (ck := tmp_path / "ck").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hpcml.ckpt import lock; "
                               "lock.hold(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(ck)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = mpiexec(2, sys.executable, SCRIPT, *ARGS, "--ckpt-dir", str(ck), timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"llm_pretrain: error: {ck} is being saved to by another job "
                                                     f"(pid {holder.pid} on ")  # rank 0 says it; every rank exits 2
    assert not list(ck.glob("step_*"))  # nothing trained or saved


SAVER = textwrap.dedent("""
    # torch imported once (~1.5 s of CPU); each line on stdin forks a saver, which prints its pid
    # and then each step it saved, until it is killed; the parent reaps it and says so
    import os, sys, torch
    from hpcml import ckpt
    root = sys.argv[1]
    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            print("pid", os.getpid(), flush=True)
            torch.manual_seed(0)
            state = {f"model/w{i}": torch.randn(512, 1024) for i in range(6)}   # 12 MB a save
            for step in range(1, 10_000):
                for t in state.values():
                    t.fill_(float(step))
                ckpt.save(root, step, state, keep=2, extra={"step": step})
                print(step, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
""")


def test_kill_9_at_random_moments_never_breaks_latest(tmp_path):
    from hpcml import ckpt  # imported here: the saver runs in its own process

    rng = random.Random(1234)
    root = tmp_path / "ck"
    (tmp_path / "saver.py").write_text(SAVER)
    checked = 0
    forks = subprocess.Popen([sys.executable, str(tmp_path / "saver.py"), str(root)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT, text=True)
    for trial in range(8):  # each trial a fresh saver process (forked): 8 kills, >= 5 checked
        forks.stdin.write("go\n")
        forks.stdin.flush()
        word, pid = forks.stdout.readline().split()
        assert word == "pid" and forks.stdout.readline().strip().isdigit()  # the first save is done
        time.sleep(rng.random() * 1.5)  # then anywhere inside a later save (each takes ~0.1 s)
        os.kill(int(pid), signal.SIGKILL)
        while (line := forks.stdout.readline().strip()) != "reaped":  # the steps it saved before the kill
            assert line.isdigit(), line
        if not (root / "latest").exists():
            continue
        path, step, extra = ckpt.read_extra(root)
        target = {f"model/w{i}": __import__("torch").zeros(512, 1024) for i in range(6)}
        report = ckpt.load(root, target)
        assert report.step == step == extra["step"]
        assert all(bool((t == float(step)).all()) for t in target.values())  # a whole, consistent save
        checked += 1
    forks.stdin.close()
    assert forks.wait(timeout=30) == 0
    assert checked >= 5


def test_index_readable_by_plain_h5py_without_hpcml(stopped):
    _, first, ck, _ = stopped
    script = textwrap.dedent(f"""
        import sys, h5py, numpy as np
        step = open("{ck}/latest").read().strip()
        with h5py.File("{ck}/" + step + "/index.h5", "r") as f:
            w = f["model/layers.0.attention.wq.weight"][()]
            e = f["model/tok_embeddings.weight"][:4, :8]
            m = f["optim/output.weight/exp_avg_sq"][()]
            assert w.shape == (64, 64) and np.isfinite(w).all() and w.std() > 0
            assert e.shape == (4, 8) and (m >= 0).all() and f.attrs["format_version"] == "2.0"
        assert not any(name.startswith("hpcml") for name in sys.modules)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def hpcml_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "hpcml"), "ckpt", *args],
                          capture_output=True, text=True, env=ENV, timeout=120)


def test_ckpt_command_line(stopped, tmp_path):
    _, first, ck, _ = stopped
    k = first["steps"][-1]
    out = hpcml_cli("ls", str(ck))
    assert out.returncode == 0 and out.stdout.split()[:3] == [str(ck / f"step_{k:08d}"), "step", str(k)]
    assert out.stdout.rstrip().endswith("latest")
    info = json.loads(hpcml_cli("inspect", str(ck), "--json").stdout)
    assert info["step"] == k and info["layout"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 2} and info["world_size"] == 4
    assert info["tensors"]["model/layers.0.attention.wo.weight"]["shape"] == [64, 64]
    assert info["tensors"]["model/tok_embeddings.weight"]["logical_shape"] == [256, 64]
    assert hpcml_cli("verify", str(ck)).stdout.strip() == f"{ck}: ok (unsigned)"
    # export: consolidated weights under their plain names, equal to the index's
    import h5py
    from safetensors.torch import load_file

    assert hpcml_cli("export", str(ck), str(tmp_path / "w.safetensors")).returncode == 0
    weights = load_file(str(tmp_path / "w.safetensors"))
    with h5py.File(ck / f"step_{k:08d}" / "index.h5", "r") as f:
        assert np.array_equal(weights["layers.1.feed_forward.w2.weight"].numpy(),
                              f["model/layers.1.feed_forward.w2.weight"][()])
    assert len(weights) == 2 + 4 * 9 + 1
    assert hpcml_cli("consolidate", str(ck), str(tmp_path / "one.h5")).returncode == 0
    with h5py.File(tmp_path / "one.h5", "r") as g, h5py.File(ck / f"step_{k:08d}" / "index.h5", "r") as f:
        assert not g["model/output.weight"].is_virtual and f["model/output.weight"].is_virtual
        assert np.array_equal(g["optim/output.weight/exp_avg"][()], f["optim/output.weight/exp_avg"][()])


def test_ckpt_command_line_bad_input(stopped, tmp_path):
    _, first, ck, _ = stopped
    out = hpcml_cli("inspect", str(tmp_path / "nope"))
    assert out.returncode == 2 \
        and out.stderr == f"hpcml: error: no checkpoint at {tmp_path / 'nope'}: the path does not exist\n"
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(ck), str(broken)], check=True)
    step = (broken / "latest").read_text().strip()
    shard = broken / step / "rank_00002.h5"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot in the middle of a shard
    shard.write_bytes(bytes(data))
    out = hpcml_cli("verify", str(broken))
    assert out.returncode == 1 and "rank_00002.h5" in out.stderr \
        and ("fails its CRC-32" in out.stderr or "differs from what was saved" in out.stderr)


def test_async_periodic_saves_resume_bitwise(stopped):
    full, first, _, ck = stopped
    args = [sys.executable, SCRIPT, "--tp", "2", "--pp", "2", *STEPS, "--ckpt-dir", str(ck)]
    # the reference run saved in the background; the stopped run did not, and trained the same
    assert first["losses"] == full[:len(first["losses"])]
    # every 3 steps, and the last step: the trained model is never left unsaved (step 8 of 8, not 6)
    assert sorted(p.name for p in ck.iterdir()) == [".hpcml-lock", "latest", "step_00000003", "step_00000006",
                                                   "step_00000008"]
    assert (ck / "latest").read_text().strip() == "step_00000008"
    assert hpcml_cli("verify", str(ck)).returncode == 0
    # the job requeued or resubmitted once done: nothing to train, said, exit 0, before torch (no step, no save)
    done = mpiexec(4, *args, "--auto-resume", timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1]) == {
        "losses": [], "steps": [], "finished_before": 8}, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (f"llm_pretrain: already finished: {ck / 'step_00000008'} holds "
                                                    f"step 8 of --steps 8; nothing to train (give more --steps to "
                                                    f"train on)")
    probe = subprocess.run([sys.executable, "-c", "import runpy, sys; rc = runpy.run_path(sys.argv[1])['main']("
                            "sys.argv[2:]); print('torch' in sys.modules, rc)", *args[1:], "--auto-resume"],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert probe.stdout.strip().splitlines()[-1] == "False 0", probe.stderr[-2000:]  # torch never imported
    fewer = subprocess.run([sys.executable, SCRIPT, "--tp", "2", "--pp", "2", "--steps", "7", "--ckpt-dir", str(ck),
                            "--resume"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)  # a mistake
    assert fewer.returncode == 2 and fewer.stderr.strip().splitlines() == [
        f"llm_pretrain: error: {ck / 'step_00000008'} holds step 8, past --steps 7: nothing to train; give --steps "
        f"above 8 to train on from it"]
    (ck / "latest").write_text("step_00000006\n")  # rolled back by hand: steps 7 and 8 again, saved over step 8
    resumed = result(mpiexec(4, *args, "--resume", "--ckpt-every", "3", timeout=300))
    assert resumed["steps"] == [7, 8] and resumed["losses"] == full[6:]
    assert (ck / "latest").read_text().strip() == "step_00000008" and hpcml_cli("verify", str(ck)).returncode == 0
