"""Commit order and full disks: no crash point leaves ``latest`` naming an incomplete step
(re-saves included), and a disk that fills up gives one line naming the cause, keeps the
previous checkpoint intact and leaves no ``.tmp`` behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcml import ckpt
from hpcml.ckpt import format as fmt, index, shard, tools
from hpcml.errors import CheckpointError


def _state(n: int, value: float) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((n, 256), value), "optim/step": torch.tensor(value)}


def _values(root: Path, n: int) -> tuple[int, float]:
    dst = _state(n, 0.0)
    report = ckpt.load(root, dst)
    return report.step, float(dst["model/w"].mean())


def test_resaving_a_step_swaps_it_whole(tmp_path):
    ckpt.save(tmp_path, 1, _state(4, 1.0))
    ckpt.save(tmp_path, 2, _state(4, 2.0))
    ckpt.save(tmp_path, 2, _state(4, 3.0))  # the heat workflow saves its last step twice
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hpcml-lock", "latest", "step_00000001", "step_00000002"]
    assert _values(tmp_path, 4) == (2, 3.0) and tools.verify(tmp_path) == []


def _crash_between_the_renames(monkeypatch, step_name: str) -> None:
    """The file system cannot swap two directories atomically, and the save is killed after
    the old copy moved aside, before the new one took its name."""
    monkeypatch.setattr(index, "_exchange", lambda a, b: False)
    real = Path.rename

    def crash(self, target):
        if self.name.endswith(".tmp") and Path(target).name == step_name:
            raise KeyboardInterrupt("killed between the renames")
        return real(self, target)
    monkeypatch.setattr(Path, "rename", crash)


@pytest.mark.parametrize("steps_before", [[1, 2], [2]], ids=["with-an-older-step", "the-only-step"])
def test_a_crash_inside_a_resave_resumes_from_the_copy_latest_named(tmp_path, monkeypatch, steps_before):
    """Where the file system cannot swap directories (Lustre, NFS): the old copy of the step
    is moved aside to ``step_N.old`` and read from there while ``step_N`` is missing, so
    nothing saved is lost, even when it is the only step. The next save cleans up."""
    for step in steps_before:
        ckpt.save(tmp_path, step, _state(4, float(step)))
    _crash_between_the_renames(monkeypatch, "step_00000002")
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 2, _state(4, 3.0))
    monkeypatch.undo()
    assert not (tmp_path / "step_00000002").exists() and (tmp_path / "step_00000002.old").is_dir()
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert _values(tmp_path, 4) == (2, 2.0)  # the committed copy, bit for bit
    assert ckpt.Checkpoint(tmp_path).path.name == "step_00000002.old"
    ckpt.save(tmp_path, 2, _state(4, 3.0))  # the next save commits and removes the copy aside
    assert _values(tmp_path, 4) == (2, 3.0) and not (tmp_path / "step_00000002.old").exists()
    assert tools.verify(tmp_path) == []


def test_a_crash_after_a_resave_of_another_step_leaves_no_copy_aside(tmp_path, monkeypatch):
    """A crash mid-re-save, a resume from the copy aside, then a save of a later step: the
    stale ``step_N.old`` goes once ``latest`` names the new step; a symlink named like one is
    neither read nor followed."""
    ckpt.save(tmp_path, 2, _state(4, 2.0))
    _crash_between_the_renames(monkeypatch, "step_00000002")
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 2, _state(4, 3.0))
    monkeypatch.undo()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    (tmp_path / "step_00000002.old").rename(outside)
    (tmp_path / "step_00000002.old").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="names step_00000002, which is missing"):
        ckpt.Checkpoint(tmp_path)
    (tmp_path / "step_00000002.old").unlink()
    outside.rename(tmp_path / "step_00000002.old")
    ckpt.save(tmp_path, 3, _state(4, 4.0))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")) \
        == [".hpcml-lock", "latest", "step_00000003"]
    assert _values(tmp_path, 4) == (3, 4.0)


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs): needs root, as CI and `make test` have here."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("precheck", [True, False])
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(small_disk, monkeypatch, precheck):
    ckpt.save(small_disk, 1, _state(64, 1.0))  # 64 KiB: fits
    if not precheck:  # the space runs out after the free-space check: the reservation catches it
        monkeypatch.setattr(shard, "_free_bytes", lambda d: None)
    with pytest.raises(CheckpointError, match=r"^saving .*step_00000002 failed: rank 0: no space left on device "
                                              r"writing .*rank_00000.h5$"):
        ckpt.save(small_disk, 2, _state(2048, 2.0))  # 2 MiB: does not
    assert sorted(p.name for p in small_disk.iterdir()) == [".hpcml-lock", "latest", "step_00000001"]  # no .tmp left
    assert _values(small_disk, 64) == (1, 1.0) and tools.verify(small_disk) == []
    saver = ckpt.AsyncSaver(MPI.COMM_WORLD)  # the writer process: the same one line, not "writer died"
    try:
        saver.save(small_disk, 3, _state(2048, 3.0))
        with pytest.raises(CheckpointError, match=r"^saving .*step_00000003 failed: rank 0: no space left on device"):
            saver.wait()
    finally:
        saver.close()
    assert sorted(p.name for p in small_disk.iterdir()) == [".hpcml-lock", "latest", "step_00000001"]
    assert _values(small_disk, 64) == (1, 1.0)
    assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize > 900_000  # nothing left taking space


def test_latest_is_refused_unless_a_plain_step_name(tmp_path):
    ckpt.save(tmp_path, 1, _state(4, 1.0))
    (tmp_path / fmt.LATEST).write_text("step_00000001/../../elsewhere\n")
    with pytest.raises(CheckpointError, match=r"latest names 'step_00000001/../../elsewhere': expected a step name"):
        ckpt.resolve(tmp_path)


def test_overlap_copies_the_named_tensors_before_returning(tmp_path, monkeypatch):
    """With overlap the background copy may run late; what ``copy_now`` names (a sample
    source's state, which changes before the next optimizer step) holds the values of the
    moment of the save all the same."""
    import threading

    from hpcml.ckpt.async_save import AsyncSaver

    go = threading.Event()
    real = AsyncSaver._stage
    monkeypatch.setattr(AsyncSaver, "_stage", lambda self, *a: (go.wait(30), real(self, *a)))
    w, src = torch.arange(64.0).reshape(8, 8), torch.full((16,), 3.0)
    saver = AsyncSaver(MPI.COMM_WORLD)
    try:
        saver.save(tmp_path, 1, {"model/w": w, "source/buf": src}, overlap=True, copy_now={"source/buf"})
        src.add_(100.0)  # the next batch arrives before the optimizer step's guard
        go.set()
        saver.wait_staged()
        w.add_(1000.0)  # the optimizer step, after the guard
        saver.wait()
    finally:
        go.set()
        saver.close()
    back = {"model/w": torch.zeros(8, 8), "source/buf": torch.zeros(16)}
    ckpt.load(tmp_path, back, comm=MPI.COMM_WORLD)
    assert torch.equal(back["model/w"], torch.arange(64.0).reshape(8, 8))
    assert torch.equal(back["source/buf"], torch.full((16,), 3.0))


def test_the_hooks_overlap_setting_is_checked():
    from hpcml.train.checkpointing import CheckpointHook

    with pytest.raises(ValueError, match=r"^CheckpointHook\(overlap='yes'\): expected True, False or 'auto'$"):
        CheckpointHook("/nonexistent", 1, overlap="yes")
