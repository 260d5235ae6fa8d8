"""The one file layer: every file hpcml reads, appends or replaces for a user goes through here.

A campaign's run directory sits in a project directory the whole group can write, so any
name in it may have been put there by someone else: a symbolic link to a file outside, a
FIFO that blocks an ``open()`` for good, a file of a GiB, a sparse one that claims a TB, JSON
nested a million deep. Here every open is ``O_NOFOLLOW | O_NONBLOCK`` and takes regular
files only; with ``root`` (the run directory) every directory between it and the file is
opened without following links too, so no path leads out of it. Reads are bounded by the
file's size *and* its allocated blocks before a byte is read; JSON is refused past
:data:`MAX_DEPTH` levels before it is parsed; appends and replacements refuse a link, a
non-regular file and (appends) a file with other hard links (one could name a file outside);
a replacement is a new file renamed over the name, so what the old one linked to is untouched. Every
refusal is a :class:`FileRefused` (a ``ConfigError``, so a ``ValueError``) naming the file and
what it is. Imports nothing heavy.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hpcml.errors import ConfigError

#: JSON nested deeper than this is refused before it is parsed (hpcml's own records nest 4).
MAX_DEPTH = 64
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_WRITE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
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


def _refuse(path, what: str) -> FileRefused:
    return FileRefused(f"{path}: {what}; expected a regular file (not a link, FIFO or device): refused")


def _parent_fd(path: Path, root: str | os.PathLike | None) -> tuple[int, str]:
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
    dfd, name = _parent_fd(path, root)
    try:
        try:
            fd = os.open(name, flags | (_WRITE if writing else _READ), mode, dir_fd=dfd)
        except FileNotFoundError:
            raise
        except OSError:
            try:
                st_mode = os.lstat(name, dir_fd=dfd).st_mode
            except OSError:
                raise _refuse(path, "cannot be opened") from None
            if stat.S_ISREG(st_mode):
                raise  # a regular file refused by the system (permissions): the caller's OSError
            raise _refuse(path, f"is {kind(st_mode)}") from None
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, f"is {kind(st.st_mode)}")
    if writing and st.st_nlink > 1:
        os.close(fd)
        raise _refuse(path, f"has {st.st_nlink} hard links (another name could be a file outside)")
    os.set_blocking(fd, True)
    return fd


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


def read_bytes(path: str | os.PathLike, max_bytes: int, expected: str = "this file", *,
               root: str | os.PathLike | None = None) -> bytes | None:
    """The bytes of regular file ``path``, or None if it is not there; FileRefused (naming the
    file and ``expected``) for anything else, or more than ``max_bytes`` -- of length or of
    blocks -- checked before a byte is read."""
    try:
        fd = open_fd(path, root=root)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FileRefused(f"{path}: {e.strerror or e}") from None
    try:
        size = _bounded(fd, path, max_bytes, expected)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(min(size, max_bytes) + 1)  # what it holds (it may have grown since), not the limit
            if len(data) > size:
                data += f.read(max_bytes + 1 - len(data))
    except OSError as e:
        raise FileRefused(f"{path}: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:
        raise FileRefused(f"{path}: larger than {max_bytes} bytes, expected {expected}")
    return data


def read_text(path: str | os.PathLike, max_bytes: int, expected: str = "a short text", *,
              root: str | os.PathLike | None = None) -> str | None:
    """:func:`read_bytes` decoded (undecodable bytes replaced), or None if not there."""
    data = read_bytes(path, max_bytes, expected, root=root)
    return None if data is None else data.decode("utf-8", errors="replace")


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


_STRING = re.compile(rb'"(?:[^"\\]++|\\.|\\\Z)*+(?:"|\Z)', re.S)
"""A JSON string, or an unterminated one to the end: every match from a quote succeeds, so no
input is scanned twice (a string of escaped quotes cut off costs one pass, not one per quote)."""
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth(data: bytes, stop: int | None = None) -> int:
    """How deep ``data``'s arrays and objects nest (strings passed over), without parsing it:
    one pass (``stop``: return once deeper than it)."""
    depth = deepest = 0
    for c in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        if c in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop is not None and depth > stop:
                    return depth
        else:
            depth -= 1
    return deepest


def parse_json(data: bytes | str, where: str, *, max_depth: int = MAX_DEPTH, constants: bool = False) -> Any:
    """JSON of untrusted ``data`` from ``where``: FileRefused, naming it, when it is nested past
    ``max_depth`` (checked first), is not UTF-8 JSON, or holds NaN or Infinity (unless
    ``constants``: files of other tools that write them, a Hugging Face config)."""
    try:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        text = raw.decode("utf-8")  # strictly: a UTF-16 text would hide brackets from the scan below
    except UnicodeError as e:
        raise FileRefused(f"{where}: not JSON (not UTF-8: {str(e)[:120]})") from None
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # fewer brackets than that cannot nest deeper
        if json_depth(raw, stop=max_depth) > max_depth:
            raise FileRefused(f"{where}: JSON nested more than {max_depth} deep: refused before parsing")
    try:
        return (_LENIENT if constants else _STRICT).decode(text)
    except (ValueError, RecursionError) as e:
        raise FileRefused(f"{where}: not JSON ({str(e)[:120]})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    v = float(text)
    if v in (math.inf, -math.inf):  # 1e999: as infinite as Infinity
        raise ValueError(f"{text[:40]} overflows a float")
    return v


_STRICT = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
"""One decoder for every file (``json.loads`` with options builds one a call): NaN, Infinity
and a literal past a float's range (1e999) refused."""
_LENIENT = json.JSONDecoder()


def read_json(path: str | os.PathLike, max_bytes: int, *, root: str | os.PathLike | None = None,
              max_depth: int = MAX_DEPTH) -> dict[str, Any] | None:
    """A JSON object from regular file ``path``, or None if it is not there; FileRefused naming
    the file for anything else (size checked before reading, depth before parsing)."""
    data = read_bytes(path, max_bytes, "a small JSON record", root=root)
    if data is None:
        return None
    rec = parse_json(data, str(path), max_depth=max_depth)
    if not isinstance(rec, dict):
        raise FileRefused(f"{path}: expected a JSON object, got {type(rec).__name__}")
    return rec


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
    dfd, name = _parent_fd(path, root)
    try:
        try:
            st = os.lstat(name, dir_fd=dfd)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                raise _refuse(path, f"is {kind(st.st_mode)}")
        except FileNotFoundError:
            pass
        tmp = f".{name}.{os.getpid()}.tmp"
        try:
            os.unlink(tmp, dir_fd=dfd)  # a crash's leftover, or something planted: a name, never followed
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _WRITE, 0o666 if mode is None else mode, dir_fd=dfd)
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
