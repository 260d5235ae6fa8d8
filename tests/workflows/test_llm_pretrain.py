"""workflows/llm_pretrain.py as a user runs it: any layout gives the single-process losses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import h5py
import pytest

from tests.workflows.test_mpi_launch import ENV, ROOT, mpiexec

SCRIPT = str(ROOT / "workflows" / "llm_pretrain.py")
ARGS = ["--steps", "4", "--seed", "0", "--no-progress"]


def losses(out: subprocess.CompletedProcess) -> list[float]:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


@pytest.fixture(scope="module")
def single() -> list[float]:
    out = subprocess.run([sys.executable, SCRIPT, *ARGS], capture_output=True, text=True, env=ENV, timeout=300,
                         cwd=ROOT)
    return losses(out)


def test_tp2_pp2_matches_one_process(single, tmp_path):
    run_dir = tmp_path / "x"
    out = mpiexec(4, sys.executable, SCRIPT, "--tp", "2", "--pp", "2", *ARGS, "--run-dir", str(run_dir), timeout=300)
    assert losses(out) == pytest.approx(single, rel=1e-4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(single, rel=1e-4)
    assert all(r["tokens_per_s"] > 0 and r["mfu"] == "n/a" and r["peak_mem_mb"] > 0 for r in rows)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["layout"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 2}
    # the model's own config, as hpcml plan calibrate reads it back
    from hpcml.models.transformer import TransformerConfig
    from hpcml.plan.calibrate import read_runs

    assert TransformerConfig.from_dict(config["model"]) == read_runs([str(run_dir)], {})[0].layout.model


def test_cp2_fsdp2_matches_one_process(single):
    out = mpiexec(4, sys.executable, SCRIPT, "--cp", "2", "--fsdp", *ARGS, timeout=300)
    assert losses(out) == pytest.approx(single, rel=1e-4)


def test_bad_layout_is_one_line_on_every_rank_exit():
    out = mpiexec(2, sys.executable, SCRIPT, "--tp", "4", *ARGS, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "llm_pretrain: error: cannot infer dp: tp(4) * pp(1) = 4 does not divide world size 2; "
        "2 ranks fit tp(2) (dp takes the rest), or run on a multiple of 4 ranks"]


def test_moe_with_ep_matches_one_process_and_reports_balance():
    """Issue 13: ``--moe 8x2 --ep 2 --tp 2`` on 4 ranks trains the one-process MoE (losses and
    the Switch aux loss per step); a MoE option on a dense model is one line, exit 2."""
    args = [*ARGS, "--moe", "8x2", "--moe-every", "2"]
    one = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=ENV, timeout=300,
                         cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    ref = json.loads(one.stdout.strip().splitlines()[-1])
    out = mpiexec(4, sys.executable, SCRIPT, "--ep", "2", "--tp", "2", *args, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    assert out.returncode == 0, out.stderr[-3000:]
    assert got["layout"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 2, "ep": 2, "edp": 1}
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert got["moe_aux"] == pytest.approx(ref["moe_aux"], rel=1e-4) and all(0.9 < a < 2 for a in ref["moe_aux"])
    bad = subprocess.run([sys.executable, SCRIPT, *ARGS, "--moe-capacity", "1.25"], capture_output=True, text=True,
                         env=ENV, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "llm_pretrain: error: --moe-capacity needs a MoE model: give --moe E[xK] or a MoE preset "
        "(tiny-moe, mixtral-8x7b, grin-moe)")


def test_tied_embeddings_train_on_fsdp_and_resume_bitwise(tmp_path):
    """Issue 26: Llama 3.2 1B/3B tie the embedding and the output; ``--tie-embeddings`` builds
    that model, FSDP over 2 ranks trains the one-process losses, a resumed run continues them
    bitwise, and tp 2 is refused in one line (a tied weight cannot split two ways)."""
    args = [*ARGS[2:], "--steps", "6", "--tie-embeddings"]
    one = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=ENV, timeout=300,
                         cwd=ROOT)
    ref = losses(one)
    ck = tmp_path / "ck"
    full = mpiexec(2, sys.executable, SCRIPT, *args, "--fsdp", "--ckpt-dir", str(ck), "--ckpt-every", "2", "--keep",
                   "5", timeout=300)
    assert losses(full) == pytest.approx(ref, rel=1e-4)
    with h5py.File(ck / "step_00000006" / "index.h5") as f:  # one weight, saved once
        assert "tok_embeddings.weight" in f["model"] and "output.weight" not in f["model"]
    shutil.rmtree(ck / "step_00000006")
    (ck / "latest").write_text("step_00000004\n")
    again = mpiexec(2, sys.executable, SCRIPT, *args, "--fsdp", "--ckpt-dir", str(ck), "--resume", timeout=300)
    assert losses(again) == losses(full)[4:]  # bitwise
    bad = mpiexec(2, sys.executable, SCRIPT, *args, "--tp", "2", timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "llm_pretrain: error: tie_embeddings needs tp 1 and pp 1, got tp 2, pp 1"]


def test_pretraining_on_a_corpus_packed_in_parallel_matches_one_process(tmp_path):
    """Issue 43: `hpcml data pack` on 2 ranks, then `llm_pretrain.py --data --doc-mask` on 1 and on tp 2:
    the same sequences, the same losses; the tiny preset's embedding grows to the byte tokenizer's 257 ids."""
    sources = sorted(str(p) for p in (ROOT / "hpcml" / "ensemble").glob("*.py"))
    packed = mpiexec(2, sys.executable, "-m", "hpcml.cli", "data", "pack", str(tmp_path / "c.h5"), *sources,
                     "--tokenizer", "bytes", timeout=120)
    assert packed.returncode == 0 and f"{len(sources)} documents" in packed.stdout, packed.stderr
    args = [*ARGS, "--doc-mask", "--data", str(tmp_path / "c.h5"), "--seq-len", "64"]  # attention within documents
    one = losses(subprocess.run([sys.executable, SCRIPT, *args, "--val-data", str(tmp_path / "c.h5"), "--val-every",
                                 "2", "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=ENV,
                                timeout=300, cwd=ROOT))
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4] and all(m["val_loss"] > 0 for m in metrics
                                                                            if "val_loss" in m)
    two = losses(mpiexec(2, sys.executable, SCRIPT, "--tp", "2", *args, timeout=300))
    assert two == pytest.approx(one, rel=1e-4) and one[-1] < one[0]
    bad = subprocess.run([sys.executable, SCRIPT, *args[:-2], "--seq-len", "10000000"], capture_output=True, text=True,
                         env=ENV, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        f"llm_pretrain: error: token file {tmp_path / 'c.h5'}: "), bad.stderr
    synthetic = subprocess.run([sys.executable, SCRIPT, *ARGS, "--doc-mask"], capture_output=True, text=True, env=ENV,
                               timeout=120, cwd=ROOT)
    assert synthetic.returncode == 2 and synthetic.stderr.strip().splitlines() == [
        "llm_pretrain: error: --doc-mask needs --data: synthetic tokens have no documents"]


def test_members_of_different_layouts_with_dp_x_cp_swap_through_the_reshard(tmp_path):
    """Issue 45, 8 ranks: an FSDP member over dp 2 x cp 2 (its flattened dp_cp group, which
    torch makes on that member's ranks only: every other rank makes as many beside it) and a
    tp 2 x dp 2 member play a tournament at the last step; the checkpoints both then save hold
    one model bit for bit exactly when the two chose the same."""
    from hpcml import ckpt

    ck = tmp_path / "ck"
    out = mpiexec(8, sys.executable, SCRIPT, "--member", '{"dp": 2, "cp": 2, "fsdp": true}', "--member",
                  '{"tp": 2, "dp": 2}', "--tournament-every", "2", "--steps", "2", "--global-batch", "4",
                  "--seq-len", "32", "--no-progress", "--ckpt-dir", str(ck), "--ckpt-every", "2", "--run-dir",
                  str(tmp_path / "run"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted((json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")), key=lambda r: r["member"])
    assert [(r["member"], r["layout"]["cp"], r["layout"]["tp"]) for r in lines] == [(0, 2, 1), (1, 1, 2)]
    a, b = (ckpt.read_tensors(ck / f"member_{m}" / "step_00000002", "model/") for m in (0, 1))
    assert len(a) > 10 and a.keys() == b.keys()
    same = all(a[n].equal(b[n]) for n in a)
    # each member judged on its own data; the saves hold one model exactly when they chose the same
    rounds = [[json.loads(x) for x in (tmp_path / "run" / f"member_{m}" / "tournaments.jsonl").read_text()
               .splitlines()] for m in (0, 1)]
    assert [[r["step"] for r in rs] for rs in rounds] == [[2], [2]]
    kept = sorted(rs[-1]["kept"] for rs in rounds)
    assert same == (kept == ["own", "partner"]), (kept, same)
