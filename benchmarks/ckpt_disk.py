"""What the disk itself can do, and how the checkpoint benchmarks summarise repeated runs.

The limits are measured with the writers and bytes of the checkpoint itself: every rank
writes (or reads) its own file of the bytes it saves, all ranks at once, in pieces of
:data:`PIECE` bytes (the size of hpcml's coalesced writes) from one page-aligned ``mmap``
buffer that holds the rank's real tensor bytes:

* ``O_DIRECT``: straight from the buffer to the device, no page cache, then ``fsync``
  (for the file's metadata and the device's write cache, as both savers fsync);
* write + ``fsync``: buffered ``pwrite`` of the same pieces, then one ``fsync`` -- the path
  hpcml and torch DCP take;
* reads: ``O_DIRECT`` reads, and buffered reads after the page cache is dropped (the path
  both loaders take: the kernel's readahead streams the file).

``dd if=/dev/zero`` is not a limit: without ``conv=fsync`` it measures the page cache,
and zeros may never reach a virtual disk (a hypervisor can turn them into discards).
numpy-free, torch-free: ``mmap`` and ``os`` only.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

ALIGN = 4096
"""O_DIRECT alignment of buffer address, file offset and length (the logical block size
is 512 or 4096 on every device we run on)."""
PIECE = 8 << 20
"""Bytes per write/read call: hpcml's COALESCE (runs of adjacent chunks up to 8 MiB)."""


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where the kernel refuses."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of ``nbytes`` rounded up to :data:`ALIGN`: page aligned, as
    O_DIRECT needs, its pages touched so that no page fault is timed later."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    buf = mmap.mmap(-1, size)
    zeros = bytes(1 << 20)
    for at in range(0, size, len(zeros)):  # first touch of every page
        buf[at:at + min(len(zeros), size - at)] = zeros[:min(len(zeros), size - at)]
    return buf


def fill(buf: mmap.mmap, parts) -> int:
    """Copy the byte views ``parts`` (this rank's tensors) into ``buf`` one after another;
    the rest repeats them, so nothing written is a run of zeros. Returns the bytes copied."""
    view, at = memoryview(buf), 0
    try:
        while at < len(view):
            for p in parts:
                p = memoryview(p).cast("B")
                n = min(len(p), len(view) - at)
                view[at:at + n] = p[:n]
                at += n
                if at >= len(view):
                    break
            if not parts:
                break
    finally:
        view.release()
    return at


def _pieces(nbytes: int, piece: int = PIECE):
    for at in range(0, nbytes, piece):
        yield at, min(piece, nbytes - at)


def _all(fn, fd: int, view: memoryview, at: int) -> None:
    while len(view):
        n = fn(fd, view, at)
        if n <= 0:
            raise OSError(f"short I/O at {at}")
        view, at = view[n:], at + n


def write_direct(path: Path, buf: mmap.mmap, nbytes: int) -> float:
    """Seconds to write the first ``nbytes`` (rounded up to :data:`ALIGN`) of ``buf`` to a new
    file with O_DIRECT, then fsync it. Raises OSError where the file system has no O_DIRECT."""
    return _write(path, buf, -(-nbytes // ALIGN) * ALIGN, os.O_DIRECT)


def write_fsync(path: Path, buf: mmap.mmap, nbytes: int) -> float:
    """Seconds to write the first ``nbytes`` of ``buf`` to a new file through the page
    cache, then fsync it (what both checkpoint libraries do)."""
    return _write(path, buf, nbytes, 0)


def _write(path: Path, buf: mmap.mmap, nbytes: int, flags: int) -> float:
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        for at, n in _pieces(nbytes):
            _all(os.pwrite, fd, view[at:at + n], at)
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
    return time.perf_counter() - t0


def _preadinto(fd: int, view: memoryview, at: int) -> int:
    return os.preadv(fd, [view], at)


def read_direct(path: Path, buf: mmap.mmap, nbytes: int) -> float:
    """Seconds to read the first ``nbytes`` (rounded up to :data:`ALIGN`) of ``path`` with O_DIRECT."""
    return _read(path, buf, -(-nbytes // ALIGN) * ALIGN, os.O_DIRECT)


def read_buffered(path: Path, buf: mmap.mmap, nbytes: int) -> float:
    """Seconds to read the first ``nbytes`` of ``path`` through the page cache (cold when
    the caller dropped it first)."""
    return _read(path, buf, nbytes, 0)


def _read(path: Path, buf: mmap.mmap, nbytes: int, flags: int) -> float:
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        for at, n in _pieces(nbytes):
            _all(_preadinto, fd, view[at:at + n], at)
    finally:
        os.close(fd)
        view.release()
    return time.perf_counter() - t0


def direct_io_works(directory: Path) -> bool:
    """Whether the file system under ``directory`` takes O_DIRECT (tmpfs, for one, does not)."""
    probe = directory / ".odirect-probe"
    buf = aligned_buffer(ALIGN)
    try:
        write_direct(probe, buf, ALIGN)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        probe.unlink(missing_ok=True)


# -- repeated runs --------------------------------------------------------------------------


def spread(samples: list[float]) -> dict:
    """Median, min, max and the quartiles of ``samples`` (``n`` of them)."""
    xs = sorted(x for x in samples if x is not None)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0], xs[0], xs[0])
    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3}


def paired(num: list[float], den: list[float]) -> list[float]:
    """Per-repetition ratios ``num[i] / den[i]`` of two figures taken in the same repetition."""
    return [a / b if a is not None and b else None for a, b in zip(num, den)]


@dataclass(frozen=True)
class Target:
    """An issue's target on a ratio: ``ratio`` (a key of the ratios), ``op`` '<=' or '>='."""

    ratio: str
    op: str
    bound: float
    text: str

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def judge(self, samples: list[float]) -> dict:
        """Pass/fail of the median, and in how many repetitions the target was met."""
        s = spread(samples)
        each = [self.met(x) for x in samples if x is not None]
        return {"target": f"{self.op} {self.bound:g}", "text": self.text, **s,
                "pass": self.met(s["median"]), "met_in": sum(bool(m) for m in each), "of": len(each)}
