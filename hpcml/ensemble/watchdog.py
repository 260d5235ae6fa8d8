"""Nothing outlives the driver: the training job dies with the process that started it.

The Campaign starts the training job in a process group of its own (so that it can be
signalled as a whole) -- which also means a ``kill -9`` of the driver leaves it running:
``mpiexec``, its proxies and every rank then wait for ``sims_done.json`` for ever. So the
job runs under this watchdog::

    python -m hpcml.ensemble.watchdog -- /bin/bash -c "<launch line>"

It is the group's leader and the driver's child. It runs the command in the same group,
passes its exit status through (128 + N for a signal, as bash does), and watches its own
parent: once the driver is gone (this process was re-parented), it sends TERM to the whole
group, then KILL after ``HPCML_WATCHDOG_GRACE_S`` (default 5 s). Signals the driver sends
to the group (the walltime warning, TERM) reach the command directly; the watchdog's own
handlers do nothing, and Python handlers, unlike ignored signals, are not inherited by
the command. Simulations are watched by their attempt wrapper
(:data:`hpcml.ensemble.attempts.ATTEMPT_SH`), which checks ``HPCML_DRIVER_PID``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ENV_DRIVER_PID = "HPCML_DRIVER_PID"
ENV_DRIVER_HOST = "HPCML_DRIVER_HOST"
ENV_GRACE = "HPCML_WATCHDOG_GRACE_S"
POLL_S = 0.2


def command(argv: list[str]) -> list[str]:
    """``argv`` under the watchdog."""
    return [sys.executable, "-m", "hpcml.ensemble.watchdog", "--", *argv]


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def main(argv: list[str]) -> int:
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m hpcml.ensemble.watchdog -- COMMAND...", file=sys.stderr)
        return 2
    driver = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)  # meant for the command (same group): it gets them itself
    child = subprocess.Popen(argv[1:])
    while True:
        rc = child.poll()
        if rc is not None:
            return _status(rc)
        if os.getppid() != driver:
            break
        time.sleep(POLL_S)
    grace = float(os.environ.get(ENV_GRACE, "5"))
    print(f"hpcml watchdog: the driver (pid {driver}) is gone: stopping the training job (TERM, KILL after "
          f"{grace:g} s)", file=sys.stderr, flush=True)
    os.killpg(0, signal.SIGTERM)
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)  # whatever is left of the group, this process last
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
