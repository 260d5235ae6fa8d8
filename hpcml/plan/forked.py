"""Pure-Python work split over the cores a process may use, by ``fork``: the search's pricing of
a 16,384-GPU layout space is ~80% of its wall time and shares nothing between its halves but the
candidate list the children inherit. Only where forking is safe -- no other thread, MPI not
initialised -- else everything runs here, as it also does when a child fails."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable

MAX_REPLY = 16 << 20
"""Bytes a child's reply may have (its own JSON, a summary: a search's is under a kilobyte)."""


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a batch job's share, not the node's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fork_safe() -> bool:
    """A child forked now runs plain Python safely: no other thread holds a lock it would inherit
    locked, and no MPI library (whose network state a child must not touch) has started."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    mpi = sys.modules.get("mpi4py.MPI")
    return not (mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized())


def fork_map(work: Callable[[int], dict], n: int) -> list[dict | None]:
    """``[work(0), ..., work(n - 1)]``: ``work(0)`` here, the others in forked children that send
    back their JSON dict. A child that fails (an exception, a signal, a reply that does not parse)
    or that could not be forked (no process or descriptor left) gives None: the caller does that
    part itself. ``n`` 1, or forking unsafe: ``[work(0)]`` and
    Nones, nothing forked."""
    if n <= 1 or not fork_safe():
        return [work(0), *([None] * (n - 1))]
    children: list[tuple[int, int]] = []
    for i in range(1, n):
        try:
            r, w = os.pipe()
        except OSError:  # out of file descriptors: this share and the rest are the caller's
            break
        try:
            pid = os.fork()
        except OSError:  # out of processes or memory (a login node's limits): the caller's, as above
            os.close(r)
            os.close(w)
            break
        if pid == 0:  # the child: its part, its reply, and out without the parent's exit handlers
            os.close(r)
            code = 1
            try:
                data = json.dumps(work(i)).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(w, view):]
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r))
    try:
        here = work(0)
    except BaseException:
        for pid, r in children:  # nobody will read their replies
            _reap(pid, r, kill=True)
        raise
    return [here, *(_reply(pid, r) for pid, r in children), *([None] * (n - 1 - len(children)))]


def _reply(pid: int, r: int) -> dict | None:
    """A child's JSON dict, or None where it failed or sent more than :data:`MAX_REPLY`."""
    chunks, size = [], 0
    with os.fdopen(r, "rb", closefd=False) as f:
        while size <= MAX_REPLY and (chunk := f.read(1 << 16)):
            size += len(chunk)
            chunks.append(chunk)
    if not _reap(pid, r, kill=size > MAX_REPLY):
        return None
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def _reap(pid: int, r: int, *, kill: bool) -> bool:
    """Wait for a child (killed first where ``kill``), its pipe closed; whether it exited 0."""
    os.close(r)
    if kill:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return not kill and os.waitstatus_to_exitcode(status) == 0
