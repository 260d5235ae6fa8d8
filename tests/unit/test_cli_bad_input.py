"""Issue 12: inputs that gave tracebacks (or ran out of memory) give one line naming the
value and what was expected, exit 2, and write nothing."""

from __future__ import annotations

import h5py
import pytest
import torch

from hpcml import ckpt
from hpcml.cli import MAX_PRINT_WORLD, main


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


@pytest.mark.parametrize("cmd", ["inspect", "verify", "ls"])
def test_ckpt_on_a_plain_hdf5_file_is_one_line(capsys, saved, cmd):
    _, plain = saved
    rc = main(["ckpt", cmd, str(plain)])
    err = capsys.readouterr().err
    assert rc in (1, 2) and len(err.splitlines()) == 1 and str(plain) in err
    assert "expected manifest.json or a 'latest' file" in err or "no checkpoint directory at" in err


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
