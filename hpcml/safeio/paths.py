"""Opening a file of a directory others can write: regular files only, no link followed on the
way below ``root``, never blocked by a FIFO (:mod:`hpcml.safeio`)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from hpcml.errors import ConfigError

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
WRITE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FileRefused(ConfigError):
    """A file hpcml will not read or write: a link, not a regular file, too large, too deep."""


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def refuse(path, what: str) -> FileRefused:
    return FileRefused(f"{path}: {what}; expected a regular file (not a link, FIFO or device): refused")


def parent_fd(path: Path, root: str | os.PathLike | None) -> tuple[int, str]:
    """A descriptor of ``path``'s directory, every component below ``root`` opened without
    following a link, and the file's name."""
    if root is None:  # the parents are the caller's, as given
        return os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path.name
    root = Path(root)
    try:
        rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(root))
    except ValueError:
        raise FileRefused(f"{path}: outside the directory {root} it must be in") from None
    if not rel.parts or ".." in rel.parts:
        raise FileRefused(f"{path}: not a file under {root}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself is the user's choice
    try:
        for part in rel.parts[:-1]:
            try:
                nfd = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FileRefused(f"{path}: {part!r} on the way is {_what(part, fd)}, not a directory of "
                                      f"{root}: refused (a link there could lead anywhere)") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, rel.parts[-1]


def _what(name: str, dir_fd: int) -> str:
    try:
        return kind(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return "gone"


def open_fd(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644, *,
            root: str | os.PathLike | None = None) -> int:
    """A descriptor of regular file ``path`` (blocking again once open); FileNotFoundError if it
    is not there; FileRefused for a link, a non-regular file, a path out of ``root`` or, when
    writing, a file with other hard links."""
    path = Path(path)
    writing = flags & (os.O_WRONLY | os.O_RDWR)
    dfd, name = parent_fd(path, root)
    try:
        try:
            fd = os.open(name, flags | (WRITE_FLAGS if writing else READ_FLAGS), mode, dir_fd=dfd)
        except FileNotFoundError:
            raise
        except OSError:
            try:
                st_mode = os.lstat(name, dir_fd=dfd).st_mode
            except OSError:
                raise refuse(path, "cannot be opened") from None
            if stat.S_ISREG(st_mode):
                raise  # a regular file refused by the system (permissions): the caller's OSError
            raise refuse(path, f"is {kind(st_mode)}") from None
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise refuse(path, f"is {kind(st.st_mode)}")
    if writing and st.st_nlink > 1:
        os.close(fd)
        raise refuse(path, f"has {st.st_nlink} hard links (another name could be a file outside)")
    os.set_blocking(fd, True)
    return fd
