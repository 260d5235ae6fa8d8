"""One driver per run directory without flock (issue 40): the driver lease and its heartbeat.

Lustre mounted with ``localflock`` (a lock per node) or without flock cannot exist on this
host, so the children below make ``flock`` fail as such a mount does (ENOLCK) -- the file
system, not the library, is what is stood in for; the lease, its files and its processes are real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpcml.ensemble import driver_lease, rundir
from hpcml.ensemble.driver_lease import LEASE, DriverLease
from hpcml.errors import ConfigError

CHILD = """
import errno, fcntl, sys, time
from pathlib import Path
def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = no_flock  # a mount without flock
from hpcml.ensemble import rundir
try:
    rundir._lock(Path(sys.argv[1]))
except ValueError as e:
    print("REFUSED", e, flush=True)
    sys.exit(3)
print("CLAIMED", flush=True)
time.sleep(float(sys.argv[2]))
rundir.release(Path(sys.argv[1]))
"""


def _driver(run, hold_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run), str(hold_s)], stdout=subprocess.PIPE, text=True)


def test_without_flock_a_second_driver_is_refused_by_the_lease_and_a_dead_ones_lease_taken_over(tmp_path):
    first = _driver(tmp_path, 60)
    assert first.stdout.readline().strip() == "CLAIMED"
    held = json.loads((tmp_path / LEASE).read_text())
    assert held["pid"] == first.pid and held["host"] == os.uname().nodename
    second = _driver(tmp_path, 0)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 3 and f"in use by a running driver (pid {first.pid} on " in out
    assert "renewed 0 s ago" in out or "renewed 1 s ago" in out
    first.send_signal(signal.SIGKILL)  # a driver killed: its lease stays, its process does not
    first.wait()
    third = _driver(tmp_path, 0)
    out, _ = third.communicate(timeout=60)
    assert third.returncode == 0 and out.strip() == "CLAIMED"
    assert not (tmp_path / LEASE).exists()  # released at its end


def _plant(run, **rec):
    who = {"host": "nid001234", "pid": 4242, "pid_start": 1, "boot_id": "b", "job": "77", "since": 1.0,
           "beat": time.time(), **rec}
    (run / LEASE).write_text(json.dumps(who))


def test_a_lease_of_another_host_holds_while_it_beats_and_lapses_after(tmp_path):
    _plant(tmp_path)
    with pytest.raises(ConfigError, match=r"in use by a running driver \(pid 4242 on nid001234, job 77, since .*; its "
                                          r"lease .*driver\.lease renewed 0 s ago\): wait for it to end"):
        DriverLease(tmp_path).take()
    _plant(tmp_path, beat=time.time() - 2 * driver_lease.STALE_S)  # that node was lost
    lease = DriverLease(tmp_path)
    lease.take()
    assert lease.ours() and json.loads((tmp_path / LEASE).read_text())["pid"] == os.getpid()
    lease.release()
    _plant(tmp_path, beat=time.time() + 10 * driver_lease.STALE_S)  # a beat from the future is no beat
    lease = DriverLease(tmp_path)
    lease.take()
    lease.release()


def test_the_lease_beats_and_a_planted_link_or_fifo_is_no_ones_lease(tmp_path):
    lease = DriverLease(tmp_path, beat_s=0.05)
    lease.take()
    first = json.loads((tmp_path / LEASE).read_text())["beat"]
    deadline = time.monotonic() + 5
    while json.loads((tmp_path / LEASE).read_text())["beat"] == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert json.loads((tmp_path / LEASE).read_text())["beat"] > first  # renewed by its thread
    lease.release()
    outside = tmp_path / "outside"
    outside.write_text("not a lease")
    (tmp_path / LEASE).symlink_to(outside)
    lease = DriverLease(tmp_path)
    lease.take()
    assert outside.read_text() == "not a lease" and not (tmp_path / LEASE).is_symlink()
    lease.release()
    os.mkfifo(tmp_path / LEASE)
    lease = DriverLease(tmp_path)
    lease.take()  # no hang on the FIFO: set aside, then taken
    assert lease.ours()
    lease.release()


def test_with_flock_the_claim_takes_the_lease_too_and_gives_it_back(tmp_path):
    rundir._lock(tmp_path.resolve())
    try:
        assert json.loads((tmp_path / LEASE).read_text())["pid"] == os.getpid()
    finally:
        rundir.release(tmp_path)
    assert not (tmp_path / LEASE).exists()
