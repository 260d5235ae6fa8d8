"""Issue 12: inputs that gave tracebacks (or ran out of memory) give one line naming the
value and what was expected, exit 2, and write nothing."""

from __future__ import annotations

import time

import h5py
import pytest
import torch
from mpi4py import MPI

from hpcml import ckpt, interop
from hpcml.ckpt import tools
from hpcml.cli import MAX_PRINT_WORLD, main
from hpcml.errors import CheckpointError, ConfigError, GridError
from hpcml.grid.layout import Layout


@pytest.mark.parametrize("args, message", [
    (["grid", "--world", "100000000"], f"--world 100000000: expected 1 to {MAX_PRINT_WORLD} ranks"),  # MemoryError
    (["grid", "--world", "9223372036854775807"], f"--world 9223372036854775807: expected 1 to {MAX_PRINT_WORLD} ranks"),
    (["grid", "--world", "0"], f"--world 0: expected 1 to {MAX_PRINT_WORLD} ranks"),
    (["grid", "--check", "--backend", "bogus"], "--backend 'bogus': this torch build has gloo"),
    (["grid", "--check", "--backend", "nccl"], "--backend 'nccl': this torch build has gloo (nccl needs a CUDA build "
                                               "of torch and a GPU)"),
])
def test_grid_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", f"hpcml: error: {message}\n")


def test_grid_text_of_a_large_world_is_short_and_fast(capsys):
    assert main(["grid", "--world", str(MAX_PRINT_WORLD), "--tp", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"world {MAX_PRINT_WORLD} = pp(1) x dp({MAX_PRINT_WORLD // 8}) x cp(1) x tp(8)")
    assert lines[4] == ("  tp groups: [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20, "
                        "21, 22, 23], [24, 25, 26, 27, 28, 29, 30, 31], [32, 33, 34, 35, 36, 37, 38, 39], [40, 41, 42, "
                        "43, 44, 45, 46, 47], [48, 49, 50, 51, 52, 53, 54, 55], [56, 57, 58, 59, 60, 61, 62, 63], ... "
                        f"({MAX_PRINT_WORLD // 8} groups of 8)]")
    assert lines[2].startswith("  dp groups: [[0, 8, 16, 24, 32, 40, 48, 56, ..., ") and sum(map(len, lines)) < 4000


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck") / "run"
    ckpt.save(root, 1, {"model/w": torch.ones(3, 4)})
    plain = root.parent / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = [1, 2, 3]
    return root, plain


def _not_a_checkpoint(path) -> str:
    return (f"no checkpoint at {path}: it is a file; expected a checkpoint directory (a step_N with manifest.json, "
            f"or the run directory with 'latest')")


@pytest.mark.parametrize("cmd, rc, head", [(["inspect"], 2, "hpcml: error: "), (["verify"], 1, "hpcml ckpt verify: "),
                                           (["export", "OUT"], 2, "hpcml: error: "),
                                           (["consolidate", "OUT"], 2, "hpcml: error: ")])
def test_ckpt_on_a_plain_hdf5_file_is_one_line(capsys, saved, tmp_path, cmd, rc, head):
    """Issue 12: a plain HDF5 file (once a KeyError traceback) is named, with what was expected."""
    _, plain = saved
    args = ["ckpt", cmd[0], str(plain)] + [str(tmp_path / "out")] * (len(cmd) - 1)
    assert main(args) == rc
    assert capsys.readouterr().err == f"{head}{_not_a_checkpoint(plain)}\n"
    assert list(tmp_path.iterdir()) == []


def test_ckpt_api_says_the_same_line_as_the_cli(saved, tmp_path):
    """The validation is the library's: the tools raise (or verify returns) the CLI's message."""
    _, plain = saved
    with pytest.raises(CheckpointError) as info:
        tools.inspect(plain)
    assert str(info.value) == _not_a_checkpoint(plain)
    with pytest.raises(CheckpointError, match="it is a file"):
        ckpt.Checkpoint(plain)
    assert tools.verify(plain) == [_not_a_checkpoint(plain)]
    for where, why in [(plain, "it is a file"), (tmp_path / "none", "the path does not exist")]:
        with pytest.raises(CheckpointError) as info:
            tools.list_checkpoints(where)
        assert str(info.value) == (f"no checkpoint directory at {where}: {why}; expected the run directory that "
                                   f"holds its step_N checkpoints")


def test_ckpt_ls_on_a_file_is_one_line(capsys, saved):
    _, plain = saved
    assert main(["ckpt", "ls", str(plain)]) == 2
    assert capsys.readouterr().err == (f"hpcml: error: no checkpoint directory at {plain}: it is a file; expected "
                                       f"the run directory that holds its step_N checkpoints\n")


def test_ckpt_ls_and_verify_on_a_population_and_on_an_empty_directory(capsys, tmp_path):
    """A population's run directory (``member_K``, before its best member's export): ``ls``
    lists every member's steps, ``verify`` names a member to give it; an empty directory
    says so rather than printing nothing."""
    root = tmp_path / "checkpoints"
    for k, steps in ((0, (2, 4)), (1, (4,))):
        for step in steps:
            ckpt.save(root / f"member_{k}", step, {"model/w": torch.full((3,), float(k))}, comm=MPI.COMM_SELF)
    assert main(["ckpt", "ls", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in out] == [f"{root}/member_0/step_00000002", f"{root}/member_0/step_00000004",
                                                     f"{root}/member_1/step_00000004"]
    assert [line.endswith("latest") for line in out] == [False, True, True]
    assert main(["ckpt", "verify", str(root)]) == 1
    assert capsys.readouterr().err == (f"hpcml ckpt verify: no checkpoint at {root}: it holds a population's members, "
                                       f"each with checkpoints of its own: name one ({root}/member_0, ...; hpcml "
                                       f"ckpt ls {root} lists them)\n")
    assert main(["ckpt", "verify", str(root / "member_1")]) == 0
    capsys.readouterr()
    assert main(["ckpt", "ls", str(tmp_path / "checkpoints" / "member_0" / "step_00000002")]) == 0
    said = capsys.readouterr()
    assert said.out == "" and said.err.endswith(": no checkpoints (no step_N directories, nor a population's member_K "
                                                "ones)\n")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_ckpt_export_into_a_missing_directory_or_onto_one(capsys, saved, tmp_path, fmt):
    root, _ = saved
    missing = tmp_path / "nodir" / "sub" / "model.out"
    assert main(["ckpt", "export", str(root), str(missing), "--format", fmt]) == 2
    assert capsys.readouterr().err == (f"hpcml: error: output {missing}: directory {missing.parent} does not exist "
                                       f"(create it first)\n")
    assert main(["ckpt", "export", str(root), str(tmp_path), "--format", fmt]) == 2
    assert capsys.readouterr().err == (f"hpcml: error: output {tmp_path} is a directory: expected a file path, e.g. "
                                       f"{tmp_path}/<name>\n")
    assert main(["ckpt", "consolidate", str(root), str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written
    assert main(["ckpt", "export", str(root), str(tmp_path / "m"), "--format", fmt]) == 0  # and a good path works
    assert (tmp_path / "m").stat().st_size > 48


def test_ckpt_outputs_under_a_file_are_one_line(capsys, saved, tmp_path):
    """A file where a directory must be: mkdir's "Not a directory" named nothing expected."""
    root, plain = saved
    under = plain / "sub"
    assert main(["ckpt", "export", str(root), str(under)]) == 2
    assert capsys.readouterr().err == f"hpcml: error: output {under}: {plain} is a file, expected a directory\n"
    for args in (["export", str(root), str(under / "hf"), "--format", "hf"], ["convert", str(root), str(under),
                                                                           "--to", "dcp", "--model", "tiny"]):
        assert main(["ckpt", *args]) == 2
        assert capsys.readouterr().err == (f"hpcml: error: output directory {args[2]}: {plain} is a file, expected "
                                           f"a directory or a new path\n")
    with pytest.raises(ConfigError, match=f"^output directory {under}: {plain} is a file"):
        interop.export(root, under, "hf")


@pytest.mark.parametrize("script, message", [
    ("NODIR/job.sh", "--script {tmp}/NODIR/job.sh: directory {tmp}/NODIR does not exist (create it first)"),
    (".", "--script {tmp} is a directory: expected a file path, e.g. {tmp}/<name>"),
])
@pytest.mark.parametrize("submit", [[], ["--submit"]])
def test_job_script_path_is_checked_before_anything_is_written(capsys, tmp_path, script, message, submit):
    path = tmp_path / script if script != "." else tmp_path
    args = ["job", "--site", "local", "--nodes", "1", "--walltime", "00:10:00", "--script", str(path), *submit,
            "--", "true"]
    assert main(args) == 2
    assert capsys.readouterr().err == f"hpcml: error: {message.format(tmp=tmp_path)}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tp", [10**20, 2**63 - 1])
def test_a_huge_degree_is_refused_at_once(capsys, tp):
    """Issue 12 follow-up: the "what fits" hint counted to the wanted degree (tp 10^20: > 10 min
    at 100% CPU, on every rank before ProcessGrid's agreement); it lists divisors of gcd now."""
    t0 = time.perf_counter()
    assert main(["grid", "--world", "8", "--tp", str(tp)]) == 2
    fits = "tp(8) (dp takes the rest)" if tp % 8 == 0 else "only dp(8)"
    assert capsys.readouterr().err == (f"hpcml: error: cannot infer dp: tp({tp}) * pp(1) = {tp} does not divide "
                                       f"world size 8; 8 ranks fit {fits}, or run on a multiple of {tp} ranks\n")
    # three huge highly composite degrees: too many candidates to search, so the multiple alone
    # (ep folds over cp x dp: it is no factor of the world size)
    with pytest.raises(GridError) as info:
        Layout(world_size=720720, tp=720720, cp=720720, ep=720720, pp=720720)
    assert str(info.value).endswith(f"does not divide world size 720720; run on a multiple of {720720 ** 3} ranks")
    assert time.perf_counter() - t0 < 1.0
