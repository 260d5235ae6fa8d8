"""A run directory used twice: a fresh run sets the earlier run's record (config.json,
metrics.jsonl) aside in ``previous-N/`` instead of appending its steps to the earlier history
(before, two runs' steps 1..N followed each other in one metrics.jsonl under the second run's
config.json, which ``hpcml plan calibrate`` read as one layout's); a run resumed from a
checkpoint continues the history in place."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpcml.models.transformer import TransformerConfig
from hpcml.train import run_record
from hpcml.train.checkpointing import load_trainer, save_trainer
from hpcml.train.recipe import build_llm_trainer
from hpcml.train.trainer import TrainConfig

MODEL = TransformerConfig.preset("tiny")


def _run(run_dir: Path, steps: int, seq_len: int = 16, ckpt: Path | None = None, resume: bool = False) -> list[dict]:
    from mpi4py import MPI

    cfg = TrainConfig(steps=steps, global_batch=2, seq_len=seq_len, progress=False, run_dir=str(run_dir))
    trainer = build_llm_trainer(MODEL, cfg, comm=MPI.COMM_SELF)
    if resume:
        load_trainer(trainer, str(ckpt))
    history = trainer.fit()
    if ckpt is not None and not resume:
        save_trainer(trainer, str(ckpt))
    trainer.close()
    return history


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_second_fresh_run_sets_the_first_aside(tmp_path):
    rd = tmp_path / "run"
    _run(rd, 3, seq_len=16)
    _run(rd, 2, seq_len=32)
    _run(rd, 1, seq_len=16)
    assert _steps(rd / "metrics.jsonl") == [1] and _steps(rd / "previous-2" / "metrics.jsonl") == [1, 2]
    assert _steps(rd / "previous-1" / "metrics.jsonl") == [1, 2, 3]
    seq = {p: json.loads((rd / p / "config.json").read_text())["train"]["seq_len"] for p in ("", "previous-1",
                                                                                           "previous-2")}
    assert seq == {"": 16, "previous-1": 16, "previous-2": 32}  # each history with its own config
    assert sorted(p.name for p in rd.iterdir()) == ["config.json", "metrics.jsonl", "previous-1", "previous-2"]


def test_a_resumed_run_continues_its_history(tmp_path):
    rd, ck = tmp_path / "run", tmp_path / "ck"
    _run(rd, 2, ckpt=ck)
    _run(rd, 4, ckpt=ck, resume=True)
    assert _steps(rd / "metrics.jsonl") == [1, 2, 3, 4] and not (rd / "previous-1").exists()


def test_set_aside_moves_entries_without_following_links(tmp_path):
    rd, outside = tmp_path / "run", tmp_path / "outside.jsonl"
    rd.mkdir()
    outside.write_text('{"step": 1}\n')
    os.symlink(outside, rd / "metrics.jsonl")  # a link placed by someone else in a group-writable directory
    assert not run_record.holds_run(rd)  # not a regular file: nothing of ours to set aside
    (rd / "metrics.jsonl").unlink()
    (rd / "metrics.jsonl").write_text('{"step": 1}\n')
    (rd / "previous-1").mkdir()  # taken: the next free one
    dest = run_record.set_aside(rd)
    assert dest == rd / "previous-2" and (dest / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert outside.read_text() == '{"step": 1}\n' and not (rd / "metrics.jsonl").exists()


def test_a_fresh_run_after_an_empty_history_writes_over_nothing(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.jsonl").write_text("")
    assert not run_record.holds_run(rd)
    _run(rd, 1)
    assert _steps(rd / "metrics.jsonl") == [1] and not (rd / "previous-1").exists()


def test_a_run_that_takes_no_step_leaves_the_earlier_record_alone(tmp_path):
    """The config is written with the first step: a run that ends before one does not put its
    config over an earlier run's history."""
    from mpi4py import MPI

    rd = tmp_path / "run"
    _run(rd, 2, seq_len=16)
    before = (rd / "config.json").read_text()
    cfg = TrainConfig(steps=1, global_batch=2, seq_len=32, progress=False, run_dir=str(rd))
    trainer = build_llm_trainer(MODEL, cfg, comm=MPI.COMM_SELF)
    assert trainer.fit(steps=0) == []
    trainer.close()
    assert (rd / "config.json").read_text() == before and _steps(rd / "metrics.jsonl") == [1, 2]
