"""Reading a file of a directory others can write, bounded before a byte is read: by its
length and by its allocated blocks (a sparse file claiming a TB costs what it holds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

from hpcml.safeio.paths import FileRefused, open_fd


def refused_as(error: type[Exception] | None, read, *args):
    """``read(*args)``, its FileRefused raised as the caller's ``error`` class (None: the refusal is
    a miss, None) -- the one place a reader of this layer speaks the caller's error class."""
    try:
        return read(*args)
    except FileRefused as e:
        if error is None:
            return None
        if error is FileRefused:
            raise
        raise error(str(e)) from None


def read_fd(fd: int, path, max_bytes: int, expected: str = "this file", *,
            error: type[Exception] | None = FileRefused) -> bytes | None:
    """The bytes of the regular file open at ``fd`` (``path`` names it in messages); ``error``
    (naming the file and ``expected``) when it holds more than ``max_bytes`` -- of length or of
    blocks -- checked before a byte is read. The descriptor stays open."""
    return refused_as(error, _read_fd, fd, path, max_bytes, expected)


def _read_fd(fd: int, path, max_bytes: int, expected: str) -> bytes:
    try:
        size = _bounded(fd, path, max_bytes, expected)
        data = _pread(fd, 0, min(size, max_bytes) + 1)  # what it holds, not the limit
        if len(data) > size:  # it grew since: read on to the limit, no further
            data += _pread(fd, len(data), max_bytes + 1 - len(data))
    except OSError as e:
        raise FileRefused(f"{path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise FileRefused(f"{path}: larger than {max_bytes} bytes, expected {expected}")
    return data


def _pread(fd: int, at: int, n: int) -> bytes:
    """Up to ``n`` bytes from offset ``at``: fewer only at the end of the file."""
    parts, got = [], 0
    while got < n:
        part = os.pread(fd, n - got, at + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_bytes(path: str | os.PathLike, max_bytes: int, expected: str = "this file", *,
               root: str | os.PathLike | None = None, error: type[Exception] | None = FileRefused,
               required: bool = False) -> bytes | None:
    """The bytes of regular file ``path``, or None if it is not there (``required``: that is a
    refusal too); ``error`` -- the caller's exception class, FileRefused by default -- naming the
    file and ``expected`` for anything else: a link, not a regular file, a path out of ``root``,
    more than ``max_bytes`` (:func:`read_fd`). ``error=None``: every refusal is None, a miss
    (a record that is not one of ours counts as not there)."""
    return refused_as(error, _read_bytes, path, max_bytes, expected, root, required)


def _read_bytes(path, max_bytes: int, expected: str, root, required: bool) -> bytes | None:
    try:
        fd = open_fd(path, root=root)
    except FileNotFoundError:
        if required:
            raise FileRefused(f"{path}: no such file, expected {expected}") from None
        return None
    except OSError as e:
        raise FileRefused(f"{path}: {e.strerror or e}") from None
    try:
        return _read_fd(fd, path, max_bytes, expected)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, max_bytes: int, expected: str = "a short text", *,
              root: str | os.PathLike | None = None, error: type[Exception] | None = FileRefused,
              required: bool = False) -> str | None:
    """:func:`read_bytes` decoded (undecodable bytes replaced), or None if not there."""
    data = read_bytes(path, max_bytes, expected, root=root, error=error, required=required)
    return None if data is None else data.decode("utf-8", errors="replace")


def _bounded(fd: int, path, max_bytes: int, expected: str) -> int:
    st = os.fstat(fd)
    # allocated past its length (fallocate, preallocation) beyond what the file system's own
    # allocation unit explains: one with large blocks gives a small file more blocks than bytes
    # (GPFS allocates whole subblocks), and a small record must not be refused for that
    slack = max(1 << 20, 2 * getattr(st, "st_blksize", 0))
    held = max(st.st_size, st.st_blocks * 512 - slack)
    if held > max_bytes:
        raise FileRefused(f"{path}: {held} bytes, larger than {max_bytes} bytes, expected {expected}: refused before "
                          f"reading")
    return st.st_size


def data_bytes(path: str | os.PathLike, size: int, *, max_extents: int = 4096) -> int:
    """The bytes of regular file ``path`` (``size`` long) outside its holes: what a sparse file
    really holds, where its blocks would undercount a compressed one (no holes, few blocks).
    0 for anything but a regular file; past ``max_extents`` extents, those counted so far."""
    try:
        fd = open_fd(path)
    except (OSError, ValueError):
        return 0
    try:
        held, pos = 0, 0
        for _ in range(max_extents):
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            held, pos = held + end - start, end
            if pos >= size:
                break
        return min(held, size)
    finally:
        os.close(fd)


def tail(path: str | os.PathLike, max_bytes: int, *, root: str | os.PathLike | None = None) -> bytes:
    """The last ``max_bytes`` of regular file ``path`` (a log, a simulation's output): b"" when
    it is not there or is not a regular file -- output is never worth failing over."""
    try:
        fd = open_fd(path, root=root)
    except (OSError, FileRefused):
        return b""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, min(size, max_bytes), max(0, size - max_bytes))
    except OSError:
        return b""
    finally:
        os.close(fd)


def iter_lines(path: str | os.PathLike, max_line: int, *, root: str | os.PathLike | None = None
               ) -> Iterator[bytes]:
    """The lines of regular file ``path`` (none if it is not there), each at most ``max_line``
    bytes and its newline (a torn last line comes without one): a longer line is passed over
    without being held, and a hole of a sparse file is jumped (``SEEK_DATA``: zeros are no
    line of a file that is appended to), so a file claiming a TiB costs what it holds."""
    try:
        fd = open_fd(path, root=root)
    except FileNotFoundError:
        return
    except OSError as e:
        raise FileRefused(f"{path}: {e.strerror or e}") from None
    try:
        size = os.fstat(fd).st_size
        pos, line, spoiled = 0, bytearray(), False
        while pos < size:
            try:
                data_at = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole after pos
                return
            if data_at > pos:  # a hole: the line it is in is not one of ours
                line.clear()
                spoiled, pos = True, data_at
            chunk = os.pread(fd, 1 << 20, pos)
            if not chunk:
                return
            pos += len(chunk)
            parts = chunk.split(b"\n")
            for i, part in enumerate(parts[:-1]):  # each ends a line
                if not spoiled and len(line) + len(part) <= max_line:
                    yield (bytes(line) + part if i == 0 and line else part) + b"\n"
                if i == 0:
                    line.clear()
                spoiled = False
            if not spoiled:
                line += parts[-1]
                if len(line) > max_line:
                    line.clear()
                    spoiled = True
        if line and not spoiled:
            yield bytes(line)
    finally:
        os.close(fd)
