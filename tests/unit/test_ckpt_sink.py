"""Direct (O_DIRECT) shard writes against the page-cache path: the same bytes on disk, the
same manifest entry, the kernel's refusal handled, the switch validated. Real files on the
test's own file system (ext4 here: it takes O_DIRECT; where it doesn't, the direct cases skip)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hpcml.ckpt import shard, sink


def _items():
    rng = np.random.default_rng(7)
    return [
        ("big", (0, 0), rng.standard_normal((3001, 1025), dtype=np.float32)),  # several 8 MiB runs, odd rows
        ("cube", (4, 0, 0), rng.standard_normal((37, 29, 131)).astype(np.float16)),  # chunks not whole rows
        ("ints", (0,), rng.integers(-9, 9, 1_000_003, dtype=np.int64)),
        ("tiny", (1,), np.arange(3, dtype=np.int8)),  # smaller than a page
        ("scalar", (), np.array(2.5, dtype=np.float64)),
    ]


def _write(path: Path, monkeypatch, direct: str) -> tuple[dict, bytes, list]:
    monkeypatch.setenv(sink.ENV, direct)
    used = []
    real = sink.DirectSink.close

    def close(self):
        real(self)  # every write finished
        used.append((type(self).__name__, self.direct_bytes))

    monkeypatch.setattr(sink.DirectSink, "close", close)
    info = shard.write_shard(path, _items(), attrs={"rank": 0})
    return info, path.read_bytes(), used


def test_direct_and_buffered_saves_write_the_same_file(tmp_path, monkeypatch):
    if not sink.takes_direct_writes(tmp_path):
        pytest.skip(f"{tmp_path} takes no O_DIRECT")
    info_d, bytes_d, used_d = _write(tmp_path / "d.h5", monkeypatch, "1")
    info_b, bytes_b, used_b = _write(tmp_path / "b.h5", monkeypatch, "0")
    assert used_b == []  # the page-cache path has no direct sink
    data = sum(a.nbytes for _, _, a in _items())
    (kind, direct_bytes), = used_d
    assert kind == "DirectSink" and 0.97 * data < direct_bytes <= info_d["bytes"], (direct_bytes, data)
    assert info_d == info_b
    assert bytes_d == bytes_b
    # and what was written reads back as the arrays, chunk by chunk, CRC-checked
    fd = shard.open_regular(tmp_path / "d.h5")
    try:
        for (name, _, arr), table in zip(_items(), info_d["datasets"]):
            want = arr.reshape(arr.shape or (1,))
            got, _ = shard.read_region(fd, want.shape, table, want.dtype, tuple(slice(0, s) for s in want.shape), name)
            np.testing.assert_array_equal(got, want)
    finally:
        os.close(fd)


def test_a_direct_write_the_kernel_refuses_is_redone_through_the_page_cache(tmp_path):
    if not sink.takes_direct_writes(tmp_path):
        pytest.skip(f"{tmp_path} takes no O_DIRECT")
    path = tmp_path / "f"
    path.write_bytes(bytes(3 * sink.ALIGN))
    fd = os.open(path, os.O_RDWR)
    try:
        with sink.DirectSink.open(path, fd, 1 << 20) as s:
            payload = np.arange(sink.ALIGN, dtype=np.uint8)
            s._direct(memoryview(payload)[1:], 1)  # offset 1: no device takes that with O_DIRECT
            assert s.direct is False and s.direct_bytes == 0
            buf = s.staging(sink.ALIGN, sink.ALIGN)  # later runs go through the page cache
            buf[:] = 7
            s.put(sink.ALIGN, buf)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[1:sink.ALIGN] == payload.tobytes()[1:] and data[0] == 0
    assert data[sink.ALIGN:2 * sink.ALIGN] == bytes([7]) * sink.ALIGN and data[2 * sink.ALIGN:] == bytes(sink.ALIGN)


@pytest.mark.parametrize("value,want", [("", True), ("1", True), ("on", True), ("0", False), ("OFF", False)])
def test_the_switch(monkeypatch, value, want):
    monkeypatch.setenv(sink.ENV, value)
    assert sink.direct_wanted() is want


def test_a_bad_switch_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv(sink.ENV, "maybe")
    with pytest.raises(ValueError, match=r"^\$HPCML_CKPT_DIRECT_IO='maybe': expected 1 .* or 0 "):
        sink.direct_wanted()


def test_switched_off_the_save_never_opens_the_file_for_direct_io(tmp_path, monkeypatch):
    monkeypatch.setenv(sink.ENV, "0")
    path = tmp_path / "f"
    path.touch()
    fd = os.open(path, os.O_RDWR)
    try:
        s = sink.DirectSink.open(path, fd, 1 << 20)
        assert type(s) is sink.BufferedSink and s.direct is False
    finally:
        os.close(fd)
