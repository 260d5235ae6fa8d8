"""The async checkpoint writer: one long-lived process per rank that writes shards from a
shared staging buffer while training goes on.

Why a process: h5py holds one global lock, so a writer thread would not overlap training's
own h5py use, and HDF5 compression/checksums would contend for the GIL. Why not ``fork``
per save: forking a multi-GiB, multi-threaded process (gloo, OpenMP, CUDA) copies its
page tables on every save, charges copy-on-write faults to the training steps that follow,
and runs h5py in a child of a threaded parent. Instead the rank copies its pieces into a
``memfd`` staging buffer (the only blocking part: one memcpy, or the device-to-host copy on
a GPU), hands the descriptor to this process over a Unix socket, and goes on. Host memory
is bounded by one staging buffer of this rank's shard size, reused across saves.

The process runs ``python -m hpcml.ckpt.async_writer FD``: numpy and h5py only, no torch,
no MPI. It exits when the socket closes (the rank exited or died).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from hpcml.ckpt.chunkmac import ChunkMac
from hpcml.ckpt.shard import write_shard

ALIGN = 64  # staging offsets: cache-line aligned
NICE = 10  # the writer's CPU priority below the ranks' (its work only has to end before the next save)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("writer socket closed")
        buf += part
    return bytes(buf)


def send(sock: socket.socket, obj: dict, fds: tuple[int, ...] = ()) -> None:
    """A length-prefixed JSON message (never pickle), with file descriptors on its header."""
    payload = json.dumps(obj).encode()
    head = struct.pack("!Q", len(payload))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(payload)


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict, list[int]]:
    if maxfds:
        head, fds, _, _ = socket.recv_fds(sock, 8, maxfds)
    else:
        head, fds = sock.recv(8), []
    if not head:
        raise EOFError("writer socket closed")
    head += _exact(sock, 8 - len(head))
    return json.loads(_exact(sock, struct.unpack("!Q", head)[0])), fds


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Aligned offsets of consecutive pieces in the staging buffer, and its total size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


class ShardWriter:
    """The rank's side: a staging buffer that grows to the largest save, and the process."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._fd: int | None = None
        self.buffer: mmap.mmap | None = None
        self.size = 0
        self._reserving: threading.Thread | None = None

    def staging(self, nbytes: int) -> mmap.mmap:
        """A writable buffer of at least ``nbytes``, reused while big enough."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if nbytes > self.size or self.buffer is None:
            self._allocate(nbytes)
        return self.buffer

    def reserve(self, nbytes: int) -> None:
        """Start the process and allocate the buffer now, its pages filled by a background
        thread (first-touch page faults cost 0.2-1 s per GiB), so that the first save blocks
        only for its copy."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if self._reserving is None and (nbytes > self.size or self.buffer is None):
            self._allocate(nbytes)
            self._reserving = threading.Thread(target=_populate, args=(self.buffer,), name="hpcml-ckpt-staging",
                                               daemon=True)
            self._reserving.start()

    def _allocate(self, nbytes: int) -> None:
        self._free_buffer()
        fd = os.memfd_create("hpcml-ckpt-staging", os.MFD_CLOEXEC)
        size = max(nbytes, ALIGN)
        os.ftruncate(fd, size)
        self.buffer = mmap.mmap(fd, size)
        self._fd, self.size = fd, size

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_"))}
        self._proc = subprocess.Popen([sys.executable, "-m", "hpcml.ckpt.async_writer", str(child.fileno())],
                                      pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
        child.close()
        self._sock = parent

    def submit(self, path: Path, items: list[dict], attrs: dict | None = None, mac_key: bytes | None = None) -> None:
        """Write ``items`` (dataset, offset, shape, dtype, at: staging offset) into ``path``,
        whose root carries ``attrs`` (the save's step and id); ``mac_key``: in a signed save, the
        key of this file's chunk digests (this file's alone: the process never holds the signing key)."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        send(self._sock, {"op": "write", "path": str(path), "size": self.size, "items": items, "attrs": attrs,
                          "mac_key": mac_key.hex() if mac_key is not None else None}, (self._fd,))

    def result(self) -> dict:
        """The status of the submitted write: ``{"ok": True, "bytes", "meta_sha256", "datasets",
        "seconds"}`` (:func:`~hpcml.ckpt.shard.write_shard`'s entry, timed) or
        ``{"ok": False, "error"}``. ``seconds`` is the write alone, timed by the writer: the
        rank asks for the result only at its next save, which may be minutes later."""
        try:
            status, _ = recv(self._sock)
            return status
        except (EOFError, OSError) as e:
            code = self._proc.wait() if self._proc is not None else None
            self._proc = None
            return {"ok": False, "error": f"writer process died (exit status {code}): {e}"}

    def close(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._sock is not None:
            self._sock.close()  # the writer sees EOF and exits
            self._sock = None
        if self._proc is not None:
            self._proc.wait()
            self._proc = None
        self._free_buffer()

    def _free_buffer(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.size = 0


def _populate(buf: mmap.mmap) -> None:
    """Fault in every page of ``buf`` with madvise(MADV_POPULATE_WRITE) (Linux >= 5.14),
    through ctypes so the GIL is released meanwhile (mmap's own MAP_POPULATE holds it);
    without it, the first save's copy takes the faults."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        view = ctypes.c_char.from_buffer(buf)
        try:
            libc.madvise(ctypes.addressof(view), len(buf), getattr(mmap, "MADV_POPULATE_WRITE", 23))
        finally:
            del view  # the export must go before the map can close
    except (OSError, AttributeError, ValueError):
        pass


def _write(job: dict, fd: int) -> dict:
    path = Path(job["path"])
    t0 = time.perf_counter()
    mm = mmap.mmap(fd, job["size"], prot=mmap.PROT_READ)
    try:
        items = [(it["dataset"], tuple(it["offset"]),
                  np.ndarray(tuple(it["shape"]), np.dtype(it["dtype"]), buffer=mm, offset=it["at"]))
                 for it in job["items"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        mac = ChunkMac(bytes.fromhex(job["mac_key"])) if job.get("mac_key") else None
        info = write_shard(path, items, attrs=job.get("attrs"), mac=mac)
        del items  # the views must go before the map closes
        return {"ok": True, **info, "seconds": time.perf_counter() - t0}
    finally:
        mm.close()


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    try:  # background work: where cores are shared, training's ranks come first
        os.nice(NICE)
    except OSError:
        pass
    while True:
        try:
            job, fds = recv(sock, maxfds=1)
        except EOFError:
            return 0
        try:
            status = _write(job, fds[0])
        except Exception as e:  # noqa: BLE001 -- reported to the rank, which reports it on every rank
            nospace = isinstance(e, OSError) and e.errno == errno.ENOSPC
            status = {"ok": False, "error": f"no space left on device writing {job.get('path')}" if nospace
                      else f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        try:
            send(sock, status)
        except OSError:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
