"""workflows/llm_pretrain.py as a user runs it: any layout gives the single-process losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.workflows.test_mpi_launch import ENV, ROOT, mpiexec

SCRIPT = str(ROOT / "workflows" / "llm_pretrain.py")
ARGS = ["--steps", "4", "--seed", "0", "--no-progress"]


def losses(out: subprocess.CompletedProcess) -> list[float]:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


@pytest.fixture(scope="module")
def single() -> list[float]:
    out = subprocess.run([sys.executable, SCRIPT, *ARGS], capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)
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


def test_cp2_fsdp2_matches_one_process(single):
    out = mpiexec(4, sys.executable, SCRIPT, "--cp", "2", "--fsdp", *ARGS, timeout=300)
    assert losses(out) == pytest.approx(single, rel=1e-4)


def test_bad_layout_is_one_line_on_every_rank_exit():
    out = mpiexec(4, sys.executable, SCRIPT, "--tp", "8", *ARGS, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "llm_pretrain: error: cannot infer dp: tp(8) * pp(1) = 8 does not divide world size 4; "
        "4 ranks fit tp(4) (dp takes the rest), or run on a multiple of 8 ranks"]
