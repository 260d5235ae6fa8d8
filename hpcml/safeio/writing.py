"""Writing into a directory others can write: appends that never follow a link or feed a FIFO,
replacements that are a new file renamed over the name (:mod:`hpcml.safeio`)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from hpcml.safeio.paths import WRITE_FLAGS, kind, open_fd, parent_fd, refuse


def append(path: str | os.PathLike, data: str | bytes, *, root: str | os.PathLike | None = None,
           fsync: bool = False, lines: bool = False) -> None:
    """Append ``data`` to regular file ``path`` (created 0644 if missing) in one write, never
    through a link, into a FIFO or into a file with other hard links. ``lines``: ``data`` is
    whole lines, so a last line torn by a crash is ended first (not glued to the new one)."""
    raw = data.encode() if isinstance(data, str) else data
    fd = open_fd(path, (os.O_RDWR if lines else os.O_WRONLY) | os.O_APPEND | os.O_CREAT, root=root)
    try:
        if lines:
            raw = ends_torn(fd) + raw
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def ends_torn(fd: int) -> bytes:
    """b"\\n" when the file behind ``fd`` has bytes and its last is not a newline (a torn line), else b""."""
    size = os.fstat(fd).st_size
    if not size:
        return b""
    last = os.pread(fd, 1, size - 1)  # the descriptor must be readable (O_RDWR)
    return b"" if last == b"\n" else b"\n"


def replace(path: str | os.PathLike, data: str | bytes | Iterable[str | bytes], *, mode: int | None = None,
            root: str | os.PathLike | None = None, fsync: bool = False) -> None:
    """Write ``path`` atomically: a fresh temporary file (exclusive create, no link followed)
    renamed over it, so a reader never sees half a file and a link put at ``path`` is replaced,
    not written through; ``data`` may come in chunks (an iterable), written as they come. A
    directory, FIFO or device at ``path`` is refused. ``mode``: exactly
    these permissions (a script's 0755, a secret's 0600); None: 0666 less the umask, as ``open``."""
    path = Path(path)
    dfd, name = parent_fd(path, root)
    try:
        try:
            st = os.lstat(name, dir_fd=dfd)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                raise refuse(path, f"is {kind(st.st_mode)}")
        except FileNotFoundError:
            pass
        tmp = f".{name}.{os.getpid()}.tmp"
        try:
            os.unlink(tmp, dir_fd=dfd)  # a crash's leftover, or something planted: a name, never followed
        except FileNotFoundError:
            pass
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | WRITE_FLAGS
        fd = os.open(tmp, flags, 0o666 if mode is None else mode, dir_fd=dfd)
        try:
            for chunk in (data,) if isinstance(data, (str, bytes, bytearray, memoryview)) else data:
                view = memoryview(chunk.encode() if isinstance(chunk, str) else chunk)
                while view:
                    view = view[os.write(fd, view):]
            if mode is not None:
                os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        except BaseException:  # a chunk that could not be made: the old file stays, no leftover
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)
