"""The `hpcml` command without MPI: grid layouts, JSON, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcml.cli import main

HPCML = str(Path(sys.executable).parent / "hpcml")
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_LOCAL", "SLURM_", "OMPI_"))}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HPCML, *args], capture_output=True, text=True, env=CLEAN_ENV, timeout=60)


def test_grid_json_console_script():
    out = run("grid", "--world", "8", "--tp", "2", "--pp", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "world_size": 8, "axes": {"pp": 2, "dp": 2, "cp": 1, "tp": 2},
        "groups": {"pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                   "cp": [[0], [1], [2], [3], [4], [5], [6], [7]], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}}


def test_grid_text(capsys):
    assert main(["grid", "--world", "8", "--cp", "2", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("world 8 = pp(1) x dp(2) x cp(2) x tp(2)")
    assert "tp groups: [[0, 1], [2, 3], [4, 5], [6, 7]]" in text
    assert "cp groups: [[0, 2], [1, 3], [4, 6], [5, 7]]" in text


@pytest.mark.parametrize("args,message", [
    (["--world", "8", "--tp", "3"], "hpcml: error: cannot infer dp: tp(3) * pp(1) = 3 does not divide world size 8; "
     "8 ranks fit only dp(8), or run on a multiple of 3 ranks"),
    (["--world", "8", "--tp", "3", "--dp", "1", "--pp", "2"], "hpcml: error: tp(3) * dp(1) * pp(2) = 6 != world size 8"),
    (["--world", "8", "--xp", "2"], "hpcml: error: unknown axis 'xp': expected one of pp, dp, ep, cp, tp"),
    (["--world", "8", "--tp", "0"], "hpcml: error: degree of tp must be a positive integer or -1 (inferred), got 0"),
    (["--world", "8", "--tp", "-4"], "hpcml: error: degree of tp must be a positive integer or -1 (inferred), got -4"),
    (["--world", "8", "--tp", "-1", "--dp", "-1"],
     "hpcml: error: only one axis degree may be -1 (inferred), got -1 for dp and tp"),
    (["--world", "8", "--tp", "two"], "hpcml grid: error: argument --tp: invalid int value: 'two'"),
])
def test_bad_input_is_one_line(args, message):
    out = run("grid", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr == message + "\n"


def test_info_json():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["hdf5"]["parallel"] is True
    assert "gloo" in info["torch"]["backends"]
    assert "MPICH" in info["mpi"]["library"] or "Open MPI" in info["mpi"]["library"]
    assert info["launch"]["world_size"] == 1 and info["launch"]["scheduler"] == "none"


def test_info_shows_faked_scheduler():
    fake = {**CLEAN_ENV, "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}
    out = subprocess.run([HPCML, "info"], capture_output=True, text=True, env=fake, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "scheduler=slurm, launcher=srun" in out.stdout and "SLURM_JOB_ID=42" in out.stdout
