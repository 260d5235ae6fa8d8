"""One driver per run directory where ``flock`` cannot tell: a lease with a heartbeat.

``flock`` on the run directory stops a second driver on file systems that keep it across
nodes. Lustre mounted with ``localflock`` keeps it per node, and some NFS and Lustre mounts
have none, so the claim also takes ``run_dir/driver.lease``: the owner (host, pid and its
start, boot, batch job, since) and ``beat``, renewed every :data:`BEAT_S` by a thread of the
driver. Another driver is refused while the lease is fresh (renewed within :data:`STALE_S`)
and its owner not surely gone (a process of this host that no longer runs is); otherwise it
takes the lease over: the old one renamed aside, the new one created exclusively, so of two
drivers racing for a stale lease one wins. The lease is input like every file there
(:mod:`hpcml.safeio`): a link, FIFO or garbage at its name is no one's lease.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from hpcml import safeio
from hpcml.ckpt import lock
from hpcml.errors import ConfigError
from hpcml.log import get_logger

logger = get_logger(__name__)

LEASE = "driver.lease"
#: Seconds between heartbeats of the driver holding the lease.
BEAT_S = 10.0
#: A lease not renewed for this long is its driver's no more (a node lost with it).
STALE_S = 60.0
_MAX_BYTES = 4096


class DriverLease:
    """The lease of ``run_dir``: :meth:`take` it (or ConfigError naming the holder), then
    :meth:`release` it; a thread renews it meanwhile."""

    def __init__(self, run_dir: str | os.PathLike, *, beat_s: float = BEAT_S, stale_s: float = STALE_S) -> None:
        self.path = Path(run_dir) / LEASE
        self.beat_s, self.stale_s = beat_s, stale_s
        self.me = {**lock.owner(), "beat": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        for _ in range(4):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                prev = self.read()
                if prev is not None and self.live(prev):
                    age = time.time() - prev["beat"]
                    raise ConfigError(
                        f"run directory {self.path.parent} is in use by a running driver ({lock.describe(prev)}; "
                        f"its lease {self.path} renewed {age:.0f} s ago): wait for it to end, or use a new directory "
                        f"(if that driver is gone, the lease lapses {self.stale_s:.0f} s "
                        "after its last beat)") from None
                self._set_aside(prev)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me))
            self._thread = threading.Thread(target=self._renew, name="hpcml-driver-lease", daemon=True)
            self._thread.start()
            return
        raise ConfigError(f"run directory {self.path.parent}: could not take its lease {self.path} (other drivers "
                          f"keep taking it): one driver per directory")

    def read(self) -> dict | None:
        """The lease now, or None when there is none or it is no driver's (a link, a FIFO, garbage)."""
        try:
            rec = safeio.read_json(self.path, _MAX_BYTES)
        except (OSError, ConfigError):
            return None
        beat = rec.get("beat") if rec else None
        return rec if type(beat) in (int, float) else None

    def live(self, rec: dict) -> bool:
        """Renewed within :attr:`stale_s` (a beat from the future is no beat), by an owner not surely gone."""
        age = time.time() - rec["beat"]
        return -self.stale_s < age < self.stale_s and lock.maybe_alive(rec)

    def ours(self) -> bool:
        rec = self.read()
        return rec is not None and all(rec.get(k) == self.me.get(k) for k in ("host", "pid", "pid_start", "since"))

    def _set_aside(self, prev: dict | None) -> None:
        aside = self.path.with_name(f".{LEASE}.{os.getpid()}.stale")
        try:
            os.rename(self.path, aside)  # of two drivers that found it stale, one moves it
        except FileNotFoundError:
            return
        os.unlink(aside)
        if prev is not None:
            logger.info("took over the lease of run directory %s from %s (last beat %.0f s ago)", self.path.parent,
                        lock.describe(prev), time.time() - prev["beat"])

    def _renew(self) -> None:
        while not self._stop.wait(self.beat_s):
            if not self.ours():
                logger.error("the lease of run directory %s is no longer this driver's (another took it over after "
                             "%.0f s without a beat): a second driver may be running", self.path.parent, self.stale_s)
                return
            try:
                safeio.replace(self.path, json.dumps({**self.me, "beat": time.time()}))
            except (OSError, ConfigError) as e:
                logger.warning("cannot renew the lease %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.ours():
            self.path.unlink(missing_ok=True)
