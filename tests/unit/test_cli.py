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


def test_grid_of_a_population_prints_one_members_layout(capsys):
    assert main(["grid", "--world", "8", "--pop", "2", "--tp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "population: 2 members of 4 ranks; member m is world ranks m*4 onwards, each laid out as:"
    assert lines[1].startswith("world 4 = pp(1) x dp(2) x cp(1) x tp(2)")
    assert main(["grid", "--world", "8", "--pop", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pop"] == 4 and got["world_size"] == 2 and got["axes"]["dp"] == 2


@pytest.mark.parametrize("pop", ["3", "0", "-2"])
def test_grid_of_a_population_that_does_not_divide_the_ranks_is_one_line(pop):
    out = run("grid", "--world", "8", "--pop", pop)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"hpcml: error: --pop {pop}: expected a positive divisor of the 8 ranks "
                                  f"(each member gets as many)")


@pytest.mark.parametrize("args,message", [
    (["--world", "8", "--tp", "3"], "hpcml: error: cannot infer dp: tp(3) * pp(1) = 3 does not divide world size 8; "
     "8 ranks fit only dp(8), or run on a multiple of 3 ranks"),
    (["--world", "8", "--tp", "3", "--dp", "1", "--pp", "2"],
     "hpcml: error: tp(3) * dp(1) * pp(2) = 6 != world size 8"),
    (["--world", "8", "--xp", "2"], "hpcml: error: unknown axis 'xp': expected one of pp, dp, ep, cp, tp, etp"),
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


@pytest.mark.parametrize("args,message", [
    (["--tp", "2"], "hpcml: error: tp(2) needs a multiple of 2 ranks, but this is a single process: add --world N "
     "to print the layout for N ranks, or run it under mpiexec -n N"),
    (["--pp", "2", "--tp", "2", "--json"], "hpcml: error: pp(2) x tp(2) needs a multiple of 4 ranks, but this is a "
     "single process: add --world N to print the layout for N ranks, or run it under mpiexec -n N"),
    (["--tp", "2", "--check"], "hpcml: error: tp(2) needs a multiple of 2 ranks, but this is a single process: run it "
     "under mpiexec -n N"),
])
def test_grid_of_several_ranks_in_one_process_says_to_add_world_or_mpiexec(args, message):
    out = run("grid", *args)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", message + "\n")


def test_grid_in_one_process_with_degrees_of_one_is_the_one_rank_layout():
    out = run("grid", "--tp", "1", "--dp", "-1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["axes"] == {"pp": 1, "dp": 1, "cp": 1, "tp": 1}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory) -> Path:
    """Two real checkpoints (steps 3 and 5; 5 is latest), saved by hpcml.ckpt.save in a subprocess."""
    root = tmp_path_factory.mktemp("ck")
    code = ("import sys, torch; from hpcml import ckpt; root = sys.argv[1]\n"
            "ckpt.save(root, 3, {'model/w': torch.ones(300, 256), 'model/b': torch.zeros(7, dtype=torch.bfloat16),"
            " 'optim/step': torch.tensor(3.0)}, layout={'dp': 1})\n"
            "ckpt.save(root, 5, {'model/w': torch.ones(300, 256)}, layout={'dp': 1})\n")
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, capture_output=True, env=CLEAN_ENV, timeout=120)
    return root


def _cli_without_torch(*args: str) -> tuple[int, list[str]]:
    """Run the CLI in a fresh interpreter; its output lines, after checking that it never imported torch."""
    code = ("import sys; from hpcml.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=CLEAN_ENV, timeout=60)
    lines = out.stdout.splitlines()
    assert lines and lines[-1].split()[:2] == ["TORCH", "False"], out.stdout + out.stderr
    return int(lines[-1].split()[2]), lines[:-1]


def test_ckpt_ls_lists_without_importing_torch(ckpt_root):
    rc, lines = _cli_without_torch("ckpt", "ls", str(ckpt_root))
    mb = {s: sum(f.stat().st_size for f in (ckpt_root / f"step_0000000{s}").iterdir()) / 1e6 for s in (3, 5)}
    assert rc == 0 and mb[3] > 0.3
    assert lines == [f"{ckpt_root}/step_00000003  step 3  {mb[3]:.1f} MB",
                     f"{ckpt_root}/step_00000005  step 5  {mb[5]:.1f} MB  latest"]


def test_ckpt_inspect_and_verify_without_importing_torch(ckpt_root):
    rc, lines = _cli_without_torch("ckpt", "inspect", str(ckpt_root / "step_00000003"), "--json")
    info = json.loads(lines[0])
    assert rc == 0 and (info["step"], info["world_size"], info["layout"]) == (3, 1, {"dp": 1})
    tensors = {n: (t["shape"], t["dtype"], t["bytes"], t["pieces"], t["partition"]) for n, t in info["tensors"].items()}
    assert tensors == {"model/b": ([7], "bfloat16", 14, 1, "replicated"),
                       "model/w": ([300, 256], "float32", 307200, 1, "replicated"),
                       "optim/step": ([], "float32", 4, 1, "replicated")}
    rc, lines = _cli_without_torch("ckpt", "inspect", str(ckpt_root))  # the root: its latest
    assert rc == 0 and lines[0].startswith(f"{ckpt_root}/step_00000005: step 5, format 2.0,")
    assert lines[1].split() == ["model/w", "[300,", "256]", "float32", "307200", "B", "1", "piece(s)", "replicated"]
    rc, lines = _cli_without_torch("ckpt", "verify", str(ckpt_root))
    assert (rc, lines) == (0, [f"{ckpt_root}: ok (unsigned)"])
