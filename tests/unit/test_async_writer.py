"""The async checkpoint writer process: staging buffer, job protocol, a writer that dies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from hpcml.ckpt.async_writer import ALIGN, ShardWriter, layout


def _stage(w: ShardWriter, arrays: dict[str, np.ndarray]) -> list[dict]:
    offsets, total = layout([a.nbytes for a in arrays.values()])
    buf = w.staging(total)
    items = []
    for (name, a), at in zip(arrays.items(), offsets):
        np.ndarray(a.shape, a.dtype, buffer=buf, offset=at)[...] = a
        items.append({"dataset": f"{name}/@0_0", "offset": [0, 0], "shape": list(a.shape), "dtype": a.dtype.str,
                      "at": at})
    return items


def test_layout_is_aligned_and_packed():
    offsets, total = layout([1, 64, 65, 0, 3])
    assert offsets == [0, 64, 128, 256, 256] and total == 320
    assert all(o % ALIGN == 0 for o in offsets)


def test_writer_writes_the_snapshot_not_later_values(tmp_path):
    w = ShardWriter()
    try:
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        b = (np.arange(6, dtype=np.uint16) * 1000).reshape(2, 3)  # bf16 bit patterns are stored as uint16
        items = _stage(w, {"model/a": a, "model/b": b})
        size = w.size
        w.submit(tmp_path / "rank_00000.h5", items)
        a += 100  # training changes its tensors at once: the staging copy is what gets written
        status = w.result()
        assert status["ok"], status
        assert len(status["datasets"]) == 2 and all(len(d["crc"]) == len(d["at"]) >= 1 for d in status["datasets"])
        with h5py.File(tmp_path / "rank_00000.h5", "r") as f:
            assert np.array_equal(f["model/a/@0_0"][...], np.arange(12, dtype=np.float32).reshape(3, 4))
            assert np.array_equal(f["model/b/@0_0"][...], b) and f["model/b/@0_0"].dtype == np.uint16
            assert list(f["model/a/@0_0"].attrs["offset"]) == [0, 0] and f["model/a/@0_0"].chunks
        # a second save of the same size reuses the buffer and the process
        pid = w._proc.pid
        w.submit(tmp_path / "rank_00001.h5", _stage(w, {"model/a": a}))
        assert w.result()["ok"] and w.size == size and w._proc.pid == pid
        with h5py.File(tmp_path / "rank_00001.h5", "r") as f:
            assert float(f["model/a/@0_0"][0, 0]) == 100.0
    finally:
        w.close()
    assert w._proc is None and w.buffer is None


def test_writer_error_is_reported_not_raised(tmp_path):
    w = ShardWriter()
    try:
        (tmp_path / "not_a_dir").write_text("x")
        w.submit(tmp_path / "not_a_dir" / "rank_00000.h5", _stage(w, {"model/a": np.ones((2, 2), np.float32)}))
        status = w.result()
        assert not status["ok"] and "not_a_dir" in status["error"]
        # the process survives a failed job
        w.submit(tmp_path / "ok.h5", _stage(w, {"model/a": np.ones((2, 2), np.float32)}))
        assert w.result()["ok"]
    finally:
        w.close()


def test_a_killed_writer_is_an_error_and_the_next_save_starts_a_new_one(tmp_path):
    w = ShardWriter()
    try:
        w.submit(tmp_path / "a.h5", _stage(w, {"model/a": np.ones((4, 4), np.float32)}))
        assert w.result()["ok"]
        old = w._proc.pid
        os.kill(old, signal.SIGKILL)
        w._proc.wait()
        w.submit(tmp_path / "b.h5", _stage(w, {"model/a": np.ones((4, 4), np.float32)}))  # restarts it
        assert w.result()["ok"] and w._proc.pid != old
        os.kill(w._proc.pid, signal.SIGKILL)  # dies while the job is in flight
        status = w.result()
        assert not status["ok"] and "writer process died" in status["error"] and "-9" in status["error"]
    finally:
        w.close()


def test_writer_process_imports_no_torch():
    code = "import sys, hpcml.ckpt.async_writer; print('torch' in sys.modules, 'mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("n", [0, 1, ALIGN + 1])
def test_staging_grows_only_when_needed(n):
    w = ShardWriter()
    try:
        w.staging(1000)
        assert w.size == 1000
        w.staging(n)
        assert w.size == 1000
        w.staging(5000)
        assert w.size == 5000 and len(w.buffer) == 5000
    finally:
        w.close()


def test_reserve_allocates_once_and_staging_reuses_it(tmp_path):
    w = ShardWriter()
    try:
        w.reserve(3 << 20)
        buf = w.staging(1 << 20)  # joins the background fill; big enough: the same buffer
        assert w.size == 3 << 20 and buf is w.buffer and w._reserving is None
        assert w._proc is not None and w._proc.poll() is None  # the process was started ahead
        w.reserve(2 << 20)  # already big enough: nothing new
        assert w.staging(3 << 20) is buf
        w.submit(tmp_path / "r.h5", _stage(w, {"model/a": np.full((8, 8), 7, np.float32)}))
        assert w.result()["ok"]
        with h5py.File(tmp_path / "r.h5", "r") as f:
            assert float(f["model/a/@0_0"][...].sum()) == 7 * 64
    finally:
        w.close()


def test_writer_reports_its_own_write_time_not_the_wait(tmp_path):
    w = ShardWriter()
    try:
        w.submit(tmp_path / "a.h5", _stage(w, {"model/a": np.ones((256, 256), np.float32)}))
        time.sleep(1.5)  # the rank trains on and asks for the status only at its next save
        status = w.result()
        assert status["ok"] and 0 < status["seconds"] < 1.0, status
    finally:
        w.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_async_save_logs_the_write_apart_from_the_wait(tmp_path):
    """The save is collected 1.5 s after it was requested: the log line and the result give
    the shard write (small) apart from the time to the commit (>= 1.5 s)."""
    import torch

    from hpcml import ckpt

    saver = ckpt.AsyncSaver()  # MPI's one-process world
    records = _Records()
    logging.getLogger("hpcml.ckpt.writer").addHandler(records)
    try:
        saver.save(tmp_path, 1, {"model/w": torch.ones(256, 512)})
        time.sleep(1.5)
        result = saver.wait()
    finally:
        logging.getLogger("hpcml.ckpt.writer").removeHandler(records)
        saver.close()
    assert result.path == tmp_path / "step_00000001" and result.bytes_written == 256 * 512 * 4
    assert result.seconds >= 1.5 and 0 < result.write_seconds < 1.0, result
    assert records.lines == [f"saved {result.path} (0.5 MB from this rank, written in {result.write_seconds:.2f} s; "
                             f"committed {result.seconds:.2f} s after the save began)"]


def test_a_signed_async_save_tags_every_chunk_in_the_writer_process(tmp_path, monkeypatch):
    """Under a key the writer process takes each chunk's keyed digest (it gets its file's key
    over the socket, never the signing key); a keyed reader checks them, a forged chunk fails."""
    import json

    import torch

    from hpcml import ckpt
    from hpcml.ckpt import keys
    from hpcml.errors import CheckpointError

    monkeypatch.delenv(keys.ENV_KEY, raising=False)
    monkeypatch.delenv(keys.ENV_KEY_FILE, raising=False)
    key = b"a" * 32
    w = torch.arange(256 * 512, dtype=torch.float32).reshape(256, 512)
    saver = ckpt.AsyncSaver()
    try:
        saver.save(tmp_path, 1, {"model/w": w}, key=key)
        result = saver.wait()
    finally:
        saver.close()
    m = json.loads((result.path / "manifest.json").read_text())
    piece = m["tensors"]["model/w"]["pieces"][0]
    assert len(piece["at"]) == 64 and len(piece["mac"]) == 64 * 32 and m["data_mac"]["salt"] == m["save_id"]
    back = {"model/w": torch.zeros_like(w)}
    ckpt.load(tmp_path, back, key=key)
    assert torch.equal(back["model/w"], w)
    with open(result.path / piece["file"], "r+b") as f:  # one byte of the last chunk
        f.seek(piece["at"][-1] + 5)
        b = f.read(1)
        f.seek(piece["at"][-1] + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CheckpointError, match="chunk 63 at byte .* fails its keyed digest"):
        ckpt.load(tmp_path, back, key=key)
