"""A simulation whose attempts end on the same exception of its own twice is not tried a third
time (a newcomer's solver that raises on one parameter point ran 3 times, 3x its node-hours);
one a retry may cure -- the network's, a launch's, a timeout, a signal -- is retried as before."""

from __future__ import annotations

import json

from hpcml.ensemble import attempts
from hpcml.outcome import failed_alike, raised

TRACE = ("Traceback (most recent call last):\n  File \"sim.py\", line 42, in <module>\n    step()\n"
         "[rank 0] RuntimeError: my solver blew up at kappa=0.3\n"
         "Abort(1) on node 0 (rank 0 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 1) - process 0\n")


def _attempt(d, k, err, rc=1, reason=""):
    (d / f"attempt_{k}.start").write_text("{}")
    (d / f"attempt_{k}.err").write_text(err)
    (d / f"attempt_{k}.end").write_text(json.dumps({"returncode": rc, "end": 1.0, "reason": reason}))


def test_the_same_exception_twice_is_not_tried_a_third_time(tmp_path):
    d = tmp_path / "sims" / "sim_00002"
    d.mkdir(parents=True)
    (tmp_path / "sims" / "attempt.sh").write_text("")
    assert raised(TRACE) == "RuntimeError: my solver blew up at kappa=0.3"
    _attempt(d, 0, TRACE)
    assert failed_alike(str(d), 1) is None  # one attempt says nothing
    cmd = attempts.hpcml_sim(str(d), 2, "mpiexec -n 2", ["sim.py"], 0, 5, {})
    assert cmd.startswith("exec /bin/bash") and " 2 1 0 5 -- " in cmd  # the second attempt (k=1) runs
    _attempt(d, 1, TRACE)
    assert failed_alike(str(d), 2) == "RuntimeError: my solver blew up at kappa=0.3"
    cmd = attempts.hpcml_sim(str(d), 2, "mpiexec -n 2", ["sim.py"], 0, 5, {})
    assert cmd.endswith("exit 1") and "attempts 0 and 1 both raised RuntimeError: my solver blew up" in cmd
    assert not (d / "attempt_2.start").exists()  # nothing claimed, nothing launched


def test_what_a_retry_may_cure_is_retried(tmp_path):
    cases = {"different": (TRACE, TRACE.replace("kappa=0.3", "kappa=0.4"), 1, ""),
             "network": ("ConnectionRefusedError: [Errno 111] refused\n",) * 2 + (1, ""),
             "launch": ("hpcml.errors.LaunchError: no trainer endpoints yet\n",) * 2 + (1, ""),
             "timeout": (TRACE, TRACE, 143, "timeout"), "killed": ("Killed\n", "Killed\n", 137, ""),
             "memory": ("MemoryError: out of memory\n",) * 2 + (1, "")}
    for name, (a, b, rc, reason) in cases.items():
        d = tmp_path / name
        d.mkdir()
        _attempt(d, 0, a, rc, reason)
        _attempt(d, 1, b, rc, reason)
        assert failed_alike(str(d), 2) is None, name


def test_a_retry_after_an_interruption_waits_for_the_campaigns_cancel(tmp_path):
    """A whole job stopped (SIGTERM to its process group): the worker's signal interrupted the
    attempt, Parsl retried it, and the retry launched before the driver wrote CANCEL (a newcomer
    saw attempt 1 start and be cancelled a second later). The retry now waits briefly for CANCEL;
    a lone worker's interruption (no CANCEL comes) is retried as before, after the grace."""
    import threading
    import time

    d = tmp_path / "sims" / "sim_00003"
    d.mkdir(parents=True)
    (tmp_path / "sims" / "attempt.sh").write_text("")
    _attempt(d, 0, "", rc=143, reason="interrupted")
    threading.Timer(0.5, (tmp_path / "sims" / attempts.CANCEL_FILE).touch).start()
    t0 = time.monotonic()
    assert attempts.hpcml_sim(str(d), 3, "", ["sim.py"], 0, 5, {}) == "exit 125"
    assert 0.4 < time.monotonic() - t0 < attempts.INTERRUPT_GRACE_S and not (d / "attempt_1.start").exists()
    (tmp_path / "sims" / attempts.CANCEL_FILE).unlink()
    cmd = attempts.hpcml_sim(str(d), 3, "", ["sim.py"], 0, 5, {})
    assert cmd.startswith("exec /bin/bash") and " 3 1 0 5 -- " in cmd  # no CANCEL: the retry runs
    _attempt(d, 1, "", rc=143, reason="timeout")  # only an interruption waits
    t0 = time.monotonic()
    assert " 3 2 0 5 -- " in attempts.hpcml_sim(str(d), 3, "", ["sim.py"], 0, 5, {})
    assert time.monotonic() - t0 < attempts.INTERRUPT_GRACE_S
