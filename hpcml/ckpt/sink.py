"""Where a shard's data runs go on their way to the disk: straight to the device
(``O_DIRECT``), or through the page cache with its writeback streamed.

A save writes each byte once and nobody reads it back soon, so the page cache only costs it:
the buffered path copies every byte into the cache and the kernel writes it out later, which
here ran at 0.65 of what the same writers reach with ``O_DIRECT`` (docs/benchmarks.md, issue
24). :class:`DirectSink` copies each run (up to ``COALESCE`` bytes) into one of a few
page-aligned buffers -- the copy the CRC-32 reads anyway -- and two writer threads send the
runs' whole pages to the device while the next run is copied; the partial pages at a run's
two ends go through the page cache, so HDF5's layout needs no alignment. The closing
``fsync`` still follows (the device's cache, the file's metadata, those end pages).

``$HPCML_CKPT_DIRECT_IO=0`` turns it off; where the file system refuses ``O_DIRECT`` (tmpfs,
some network file systems) or a direct write is refused, the save goes on buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hpcml import log

logger = log.get_logger(__name__)

ALIGN = max(4096, mmap.PAGESIZE)
"""Alignment of a direct write's file offset, length and buffer address: the largest logical
block size of the devices we run on (512 or 4096), and at least a page, so that no page of
the page cache holds both a buffered end piece and part of a direct write (64 KiB pages on
some aarch64 kernels)."""
ENV = "HPCML_CKPT_DIRECT_IO"


def direct_wanted() -> bool:
    """``$HPCML_CKPT_DIRECT_IO``: unset, ``1``/``on``: direct writes; ``0``/``off``: the page cache."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("1", "on", "true", "yes", ""):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"${ENV}={value!r}: expected 1 (direct writes, the default) or 0 (through the page cache)")


def takes_direct_writes(directory) -> bool:
    """Whether a save into ``directory`` writes its data with O_DIRECT (the switch is on and
    the file system takes it)."""
    probe = os.path.join(directory, f".hpcml-direct-probe-{os.getpid()}")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with DirectSink.open(probe, fd, ALIGN) as s:
            return s.direct
    finally:
        os.close(fd)
        os.unlink(probe)


def pwrite_all(fd: int, data, at: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


class Writeback:
    """Streams a file's dirty pages to the disk as it is written (Linux ``sync_file_range``):
    each run is queued for writeback once written, and the run :data:`AHEAD` runs back is
    waited for, so the disk works while the CPU copies and checksums the next runs and the
    closing ``fsync`` finds almost nothing left (it was 60% of a save: 1.6 of 2.7 s per GiB,
    docs/benchmarks.md). Durability is unchanged: the ``fsync`` still follows. Elsewhere, or
    where the file system refuses, it does nothing."""

    AHEAD = 4
    _WRITE, _WAIT_BEFORE, _WAIT_AFTER = 2, 1, 4
    _fn = None

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending: list[tuple[int, int]] = []
        if Writeback._fn is None:
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                Writeback._fn = fn
            except (OSError, AttributeError):
                Writeback._fn = False

    def wrote(self, at: int, n: int) -> None:
        if not self._fn:
            return
        if self._fn(self.fd, at, n, self._WRITE) != 0:
            Writeback._fn = False  # not supported here: the fsync does it all
            return
        self.pending.append((at, n))
        if len(self.pending) > self.AHEAD:
            old_at, old_n = self.pending.pop(0)
            self._fn(self.fd, old_at, old_n, self._WAIT_BEFORE | self._WRITE | self._WAIT_AFTER)


class BufferedSink:
    """Runs written through the page cache, straight from the caller's array when it can
    (``zero_copy``), with :class:`Writeback` streaming them out."""

    zero_copy = True
    direct = False

    def __init__(self, fd: int, run_bytes: int) -> None:
        self.fd, self.run_bytes = fd, run_bytes
        self.flush = Writeback(fd)
        self._staging: np.ndarray | None = None

    def staging(self, at: int, n: int) -> np.ndarray:
        """A reusable byte buffer to assemble the run of ``n`` bytes that goes to ``at``."""
        if self._staging is None or self._staging.nbytes < n:
            self._staging = np.empty(max(n, min(self.run_bytes, 8 << 20)), dtype=np.uint8)
        return self._staging[:n]

    def put(self, at: int, data) -> None:
        pwrite_all(self.fd, data, at)
        self.flush.wrote(at, memoryview(data).nbytes)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectSink(BufferedSink):
    """Each run is assembled in one of :data:`DEPTH` page-aligned buffers, placed so that its
    file offset and its buffer address agree modulo :data:`ALIGN`; its whole pages go out with
    ``O_DIRECT`` on one of two writer threads while the caller fills the next buffer, and the partial
    pages at its ends go through the page cache (``fd``). A direct write the kernel refuses
    (``EINVAL``: an alignment this device wants larger) is redone buffered, and the rest of the
    file is written buffered."""

    zero_copy = False
    direct = True
    DEPTH = 3

    def __init__(self, fd: int, direct_fd: int, run_bytes: int) -> None:
        super().__init__(fd, run_bytes)
        self.direct_fd = direct_fd
        size = -(-(min(run_bytes, 8 << 20) + ALIGN) // ALIGN) * ALIGN
        self.size = size
        self.buffers = [mmap.mmap(-1, size) for _ in range(self.DEPTH)]
        self.arrays = [np.frombuffer(b, dtype=np.uint8) for b in self.buffers]
        self.pending: list[Future | None] = [None] * self.DEPTH
        self.turn = 0
        self.direct_bytes = 0  # written with O_DIRECT (the rest went through the page cache)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="hpcml-direct")

    @classmethod
    def open(cls, path, fd: int, run_bytes: int) -> BufferedSink:
        """A direct sink for ``path`` (already open as ``fd``), or a buffered one where direct
        writes are turned off or refused."""
        if not direct_wanted() or not hasattr(os, "O_DIRECT"):
            return BufferedSink(fd, run_bytes)
        try:
            direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW)
        except OSError as e:  # EINVAL: tmpfs and others have no O_DIRECT
            logger.debug("no O_DIRECT for %s (%s): writing through the page cache", path, e)
            return BufferedSink(fd, run_bytes)
        try:
            a, b = os.fstat(fd), os.fstat(direct_fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # the name was swapped since fd was opened
                raise OSError(f"{path} is no longer the file being written")
            return cls(fd, direct_fd, run_bytes)
        except BaseException:
            os.close(direct_fd)
            raise

    def _wait(self, k: int) -> None:
        job, self.pending[k] = self.pending[k], None
        if job is not None:
            self.direct_bytes += job.result()  # a write's error (ENOSPC, EIO) surfaces in the caller

    def staging(self, at: int, n: int) -> np.ndarray:
        if n + at % ALIGN > self.size:
            return super().staging(at, n)  # longer than a run (not made by this module's callers)
        k = self.turn % self.DEPTH
        self._wait(k)
        return self.arrays[k][at % ALIGN:at % ALIGN + n]

    def put(self, at: int, data) -> None:
        view = memoryview(data).cast("B")
        n = view.nbytes
        lo, hi = -(-at // ALIGN) * ALIGN, (at + n) // ALIGN * ALIGN
        mine = isinstance(data, np.ndarray) and any(np.may_share_memory(data, a) for a in self.arrays)
        if not self.direct or not mine or hi <= lo:
            pwrite_all(self.fd, view, at)
            return
        if lo > at:
            pwrite_all(self.fd, view[:lo - at], at)
        if at + n > hi:
            pwrite_all(self.fd, view[hi - at:], hi)
        k = self.turn % self.DEPTH
        self.pending[k] = self.pool.submit(self._direct, view[lo - at:hi - at], lo)
        self.turn += 1

    def _direct(self, view: memoryview, at: int) -> int:
        """Write ``view`` at ``at``; the bytes that went with O_DIRECT (0: through the page cache)."""
        if self.direct:
            try:
                pwrite_all(self.direct_fd, view, at)
                return view.nbytes
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                logger.warning("O_DIRECT write refused at offset %d (%s): writing through the page cache", at, e)
                self.direct = False
        pwrite_all(self.fd, view, at)
        return 0

    def close(self) -> None:
        try:
            for k in range(self.DEPTH):
                self._wait(k)
        finally:
            self.pool.shutdown(wait=True)
            os.close(self.direct_fd)
            self.arrays.clear()  # the maps go with the last view of them (a caller may still hold one)
            self.buffers.clear()
