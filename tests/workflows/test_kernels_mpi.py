"""The kernels as the campaign runs them: ``mpiexec -n k python -m kernels.<name> ... --out f.h5``.

Same answer on 1, 2 and 4 ranks (uneven splits), the HDF5 layout the offline trainer reads,
a real ``kill -9`` that leaves no final file and a retry that completes, clean bad-input exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items()
       if not k.startswith(("PMI_", "MPI_LOCAL", "SLURM_", "OMPI_", "HYDRA_", "HPCML_STREAM_", "HPCML_ATTEMPT"))}
NX, NY, STEPS, EVERY = 45, 37, 50, 10  # 45 = 23 + 22 and 37 = 19 + 18: uneven blocks on 2 and 4 ranks
RUNS = {
    "heat2d": ["--params-json", '{"alpha": 0.5, "t_left": 1.0, "t_top": 0.25}', "--t-init", "0.5"],
    "gray_scott": ["--params-json", '{"F": 0.03, "k": 0.06, "seed": 2}', "--Dv", "0.09"],
}
PARAMS = {
    "heat2d": {"alpha": 0.5, "t_left": 1.0, "t_right": 0.0, "t_bottom": 0.0, "t_top": 0.25, "t_init": 0.5,
               "source_power": 0.0, "source_x": 0.5, "source_y": 0.5, "source_width": 0.1},
    "gray_scott": {"F": 0.03, "k": 0.06, "Du": 0.2, "Dv": 0.09, "seed": 2.0},
}
FIELDS = {"heat2d": ["T"], "gray_scott": ["u", "v"]}


def launch(n: int, kernel: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = ["timeout", "300", "mpiexec", "-n", str(n), sys.executable, "-m", f"kernels.{kernel}",
           "--nx", str(NX), "--ny", str(NY), "--steps", str(STEPS), "--every", str(EVERY), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=320)


def result_line(out: subprocess.CompletedProcess) -> dict:
    lines = [line for line in out.stdout.splitlines() if line.startswith("HPCML_SIM_RESULT ")]
    assert len(lines) == 1, out.stdout + out.stderr
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, int], tuple[Path, dict]]:
    """Every kernel on 1, 2 and 4 ranks, once for the whole module: (file, result line)."""
    d = tmp_path_factory.mktemp("kernels")
    done = {}
    for kernel, args in RUNS.items():
        for n in (1, 2, 4):
            path = d / f"{kernel}_{n}.h5"
            out = launch(n, kernel, *args, "--sim-id", "3", "--out", str(path))
            assert out.returncode == 0, out.stderr
            done[kernel, n] = (path, result_line(out))
    return done


def read(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {name: f[name][...] for name in ["step", "time", *(f"fields/{k}" for k in f["fields"])]}


@pytest.mark.parametrize("kernel", list(RUNS))
def test_same_fields_on_1_2_and_4_ranks(runs, kernel):
    ref = read(runs[kernel, 1][0])
    for n in (2, 4):
        other = read(runs[kernel, n][0])
        assert other.keys() == ref.keys()
        for name in ref:
            np.testing.assert_allclose(other[name], ref[name], rtol=0, atol=1e-12, err_msg=f"{name} on {n} ranks")
    for name in FIELDS[kernel]:  # and the answer is not trivially the same: it evolves, with structure
        f = ref[f"fields/{name}"]
        assert np.abs(f[-1] - f[0]).max() > 1e-3 and f[-1].std() > 1e-3


@pytest.mark.parametrize("kernel", list(RUNS))
def test_file_layout_and_result_line(runs, kernel):
    path, result = runs[kernel, 4]
    assert not path.with_name(path.name + ".tmp").exists()
    with h5py.File(path, "r") as f:
        names = []
        f.visit(names.append)
        assert sorted(names) == sorted(["fields", "step", "time", *(f"fields/{k}" for k in FIELDS[kernel])])
        for k in FIELDS[kernel]:
            assert f[f"fields/{k}"].shape == (STEPS // EVERY, NX, NY) and f[f"fields/{k}"].dtype == np.float32
        assert f["step"].dtype == np.int64 and f["step"][:].tolist() == [10, 20, 30, 40, 50]
        assert f["time"].dtype == np.float64
        np.testing.assert_allclose(f["time"][:], f["step"][:] * result["dt"], rtol=1e-15)
        attrs = dict(f.attrs)
    assert sorted(attrs) == sorted(["kernel", "params", "nx", "ny", "sim_id", *PARAMS[kernel]])
    assert (attrs["kernel"], attrs["nx"], attrs["ny"], attrs["sim_id"]) == (kernel, NX, NY, 3)
    assert json.loads(attrs["params"]) == PARAMS[kernel]
    assert {k: attrs[k] for k in PARAMS[kernel]} == PARAMS[kernel]
    assert all(isinstance(attrs[k], np.float64) for k in PARAMS[kernel])
    assert {k: result[k] for k in ("sim_id", "kernel", "steps", "outputs", "samples_sent", "ranks")} == {
        "sim_id": 3, "kernel": kernel, "steps": STEPS, "outputs": 5, "samples_sent": 5, "ranks": 4}
    assert result["wall_s"] > 0 and result["params"] == PARAMS[kernel]


def test_killed_run_leaves_no_final_file_and_the_retry_completes(runs, tmp_path):
    path = tmp_path / "crash.h5"
    args = [*RUNS["heat2d"], "--sim-id", "3", "--crash-at-step", "20", "--out", str(path)]
    out = launch(2, "heat2d", *args)
    # MPICH's mpiexec exits with the signal number of a killed rank (9); a bare process, -9 or 137.
    assert out.returncode in (9, -9, 137), (out.returncode, out.stderr)
    assert "signal 9" in out.stdout + out.stderr and "HPCML_SIM_RESULT" not in out.stdout
    assert not path.exists() and path.with_name("crash.h5.tmp").exists()
    retry = launch(2, "heat2d", *args, env={**ENV, "HPCML_ATTEMPT": "1"})
    assert retry.returncode == 0, retry.stderr
    assert result_line(retry)["samples_sent"] == 5
    assert path.exists() and not path.with_name("crash.h5.tmp").exists()
    ref = read(runs["heat2d", 2][0])
    assert all(np.array_equal(v, ref[k]) for k, v in read(path).items())


@pytest.mark.parametrize("n, kernel, args, message", [
    (2, "heat2d", ["--alpha", "-1"], "heat2d: error: alpha must be > 0, got -1.0"),
    (4, "gray_scott", ["--nx", "1"],
     "gray_scott: error: nx=1 is smaller than the 2 ranks along x (process grid 2x2 for 4 ranks): expected nx >= 2"),
    (2, "heat2d", ["--params-json", '{"alpha": 1, "t_middle": 3}'],
     "heat2d: error: unknown parameter 't_middle' in --params-json: expected one of "
     "alpha, t_left, t_right, t_bottom, t_top, t_init, source_power, source_x, source_y, source_width"),
])
def test_bad_input_is_one_line_and_exit_2(n, kernel, args, message):
    out = launch(n, kernel, *args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [message] and out.stdout == ""


def test_stream_without_the_campaign_environment_is_one_line_and_exit_2():
    # --stream imports hpcml.stream only then; without the campaign's variables every rank stops together.
    out = launch(2, "gray_scott", "--stream")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["gray_scott: error: HPCML_RUN_DIR and HPCML_CAMPAIGN_ID not set: this process was not started "
                     "by a campaign (hpcml.ensemble.Campaign or hpcml.ensemble.apps set them)"]
