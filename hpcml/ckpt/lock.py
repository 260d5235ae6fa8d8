"""One saving job per checkpoint directory.

Two trainings saving into one ``--ckpt-dir`` at once clear each other's ``step_N.tmp`` and
prune each other's steps. A training (``CheckpointHook``, at its first step) takes
``.hpcml-lock`` in the directory and keeps it until it closes; a plain ``ckpt.save`` takes it
for the save. It is an ``flock`` (rank 0's), so a job killed by any means leaves no lock
held, with its owner (host, pid, job id, start time) written inside; a second job is
refused in one line naming the owner. Where the file system has no
``flock`` (a Lustre mount without ``-o flock``), the owner record decides: a dead process on
this host, or this same batch job requeued, is a stale owner and is replaced (logged).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from hpcml import log, safeio
from hpcml.errors import CheckpointError

logger = log.get_logger(__name__)

LOCK = ".hpcml-lock"
MAX_LOCK_BYTES = 4096
JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID", "FLUX_JOB_ID")
_held: dict[str, int] = {}


def owner() -> dict:
    """Who this process is, as a lock records it."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _start_time(pid), "boot_id": _boot_id(),
            "job": next((os.environ[v] for v in JOB_VARS if os.environ.get(v)), ""), "since": round(time.time(), 3)}


def describe(who: dict) -> str:
    job = f", job {who['job']}" if who.get("job") else ""
    t = who.get("since")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"
    return f"pid {who.get('pid', '?')} on {str(who.get('host', '?'))[:64]}{job}, since {since}"


def hold(root: str | os.PathLike) -> bool:
    """Take (or keep) this process's lock on checkpoint directory ``root``; raise
    CheckpointError naming the owner when another live job holds it. True when taken now
    (False: this process held it already)."""
    root = Path(root)
    key = os.path.realpath(root)
    if key in _held:
        return False
    path = root / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise CheckpointError(f"cannot take the checkpoint lock {path}: {(e.strerror or str(e)).lower()}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_LOCK_BYTES:
            raise CheckpointError(f"{path} is not a lock file hpcml wrote (not a small regular file): remove it")
        prev = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{root} is being saved to by another job ({describe(prev)}): one job per "
                                  f"checkpoint directory -- wait for it, stop it, or save elsewhere") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise CheckpointError(f"cannot take the checkpoint lock {path}: {e.strerror}") from None
            if prev and maybe_alive(prev):
                raise CheckpointError(f"{root} is being saved to by {describe(prev)} (by its lock {path}; this file "
                                      f"system has no flock): remove {path} if that job is over") from None
        me = owner()
        if prev and (prev.get("pid"), prev.get("host")) != (me["pid"], me["host"]):
            logger.info("took the checkpoint lock of %s (last held by %s, which has let it go)", root, describe(prev))
        data = json.dumps(me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _held[key] = fd
    return True


def hold_on(root: str | os.PathLike, comm) -> None:
    """:func:`hold` by rank 0 of ``comm`` (collective: one allgather), refused on every rank
    when refused there -- a training checks it at its first step, not at its first save."""
    error = None
    if comm.Get_rank() == 0:
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            hold(root)
        except (CheckpointError, OSError) as e:
            error = str(e)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0])


def release(root: str | os.PathLike) -> None:
    """Give up this process's lock on ``root`` (exiting does it too)."""
    fd = _held.pop(os.path.realpath(root), None)
    if fd is not None:
        os.close(fd)


def _read(fd: int) -> dict:
    """Who the lock file open at ``fd`` names ({} for nothing readable: it is advice, not a record;
    JSON nested past the file layer's depth is refused before parsing, never a RecursionError)."""
    try:
        raw = os.pread(fd, MAX_LOCK_BYTES, 0)
        who = safeio.parse_json(raw, LOCK) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return who if isinstance(who, dict) else {}


def maybe_alive(who: dict) -> bool:
    """False only when the owner is surely gone: a process of this boot of this host that
    no longer runs (or another process now has its pid), or this same batch job, requeued."""
    me = owner()
    if who.get("job") and who.get("job") == me["job"] and who.get("pid") != me["pid"]:
        return False
    if who.get("host") != me["host"] or who.get("boot_id") != me["boot_id"]:
        return who.get("host") != me["host"]  # same host, other boot: gone
    pid, started = who.get("pid"), who.get("pid_start")
    return isinstance(pid, int) and pid > 0 and started is not None and _start_time(pid) == started


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


__all__ = ["LOCK", "describe", "hold", "hold_on", "maybe_alive", "owner", "release"]
