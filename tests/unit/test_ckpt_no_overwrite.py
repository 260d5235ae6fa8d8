"""A run that does not resume never saves over an earlier run's checkpoints: a reused
``--ckpt-dir`` without ``--resume`` used to retrain from step 0 and move ``latest`` back
(exit 0, no word), the newest steps then rotated out by ``--keep``."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from hpcml import ckpt
from hpcml.ckpt import format as fmt
from hpcml.errors import CheckpointError
from hpcml.train.checkpointing import CheckpointHook

ROOT = Path(__file__).resolve().parents[2]


def _llm_pretrain():
    spec = importlib.util.spec_from_file_location("llm_pretrain_under_test", ROOT / "workflows" / "llm_pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_held_names_the_newest_complete_step(tmp_path):
    assert fmt.held(tmp_path) is None and fmt.held(tmp_path / "missing") is None
    (tmp_path / "step_00000030").mkdir()  # killed before its manifest: nothing a run could lose
    assert fmt.held(tmp_path) is None
    ckpt.save(tmp_path, 10, {"model/w": torch.ones(3)})
    ckpt.save(tmp_path, 20, {"model/w": torch.ones(3)})
    assert fmt.held(tmp_path) == "a checkpoint at step 20 (step_00000020)"
    other = tmp_path / "other"
    other.mkdir()
    (other / "latest").write_text("step_00000005")  # its steps deleted: still an earlier run's
    assert fmt.held(other) == "a 'latest' file"


def test_the_hook_refuses_a_directory_of_saves_unless_the_trainer_resumed(tmp_path):
    CheckpointHook(tmp_path / "fresh", 5)  # nothing there: taken
    ckpt.save(tmp_path, 7, {"model/w": torch.ones(3)})
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointError) as e:
        CheckpointHook(tmp_path, 5)
    assert str(e.value) == (f"{tmp_path} already holds a checkpoint at step 7 (step_00000007) from an earlier run, "
                            "and this run starts at step 0: its saves would replace that one; load them first "
                            "(load_trainer) and pass resumed=True, or give an empty directory")
    CheckpointHook(tmp_path, 5, resumed=True)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("pop", [1, 2])
def test_llm_pretrain_refuses_a_reused_ckpt_dir_without_resume(tmp_path, capsys, pop):
    saved = tmp_path / ("member_1" if pop > 1 else "")
    ckpt.save(saved, 12, {"model/w": torch.ones(3)})
    before = _snapshot(tmp_path)
    script = _llm_pretrain()
    argv = ["--steps", "2", "--ckpt-dir", str(tmp_path), *(["--pop", "2"] if pop > 1 else [])]
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"llm_pretrain: error: {os.path.normpath(saved)} already holds a checkpoint at step 12 "
                   "(step_00000012) from an earlier run, and this run starts at step 0: its saves would replace "
                   "that one; rerun with --resume (or --auto-resume) to continue from it, or give another "
                   "--ckpt-dir to start over"]
    assert _snapshot(tmp_path) == before  # nothing written, nothing moved


def test_auto_resume_without_latest_is_refused_with_advice_that_works(tmp_path, capsys):
    """Steps saved but ``latest`` gone (deleted by hand, a copy without it): --auto-resume sees
    nothing to resume and would start over them; refused, and the advice given resumes."""
    ckpt.save(tmp_path, 4, {"model/w": torch.ones(3)})
    (tmp_path / "latest").unlink()
    before = _snapshot(tmp_path)
    script = _llm_pretrain()
    assert script.main(["--steps", "2", "--ckpt-dir", str(tmp_path), "--auto-resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"llm_pretrain: error: {tmp_path} already holds a checkpoint at step 4 (step_00000004) from an "
                   "earlier run, and this run starts at step 0: its saves would replace that one; --auto-resume found "
                   f"no 'latest' there: write the step's name (e.g. step_00000100) into {tmp_path / 'latest'} to "
                   "resume it, or give another --ckpt-dir to start over"]
    assert _snapshot(tmp_path) == before
    (tmp_path / "latest").write_text("step_00000004")  # the advice, followed: a resume finds the step
    assert fmt.resolve(tmp_path) == tmp_path / "step_00000004"
