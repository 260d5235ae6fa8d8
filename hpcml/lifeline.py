"""A training job of a campaign never outlives its driver, nor its own replacement.

The driver supervises the training job through a watchdog process
(:mod:`hpcml.ensemble.watchdog`). If that watchdog is killed (an OOM killer sends SIGKILL,
which nothing can catch), the job's launcher and ranks are orphaned: they would go on,
holding the stream's ports, while the driver relaunches a new job. So every rank of a
campaign's training job watches two things itself, once a second, from a daemon thread:

- the driver (``HPCML_DRIVER_PID`` on ``HPCML_DRIVER_HOST``): gone, the rank exits;
- the run directory's lease (``trainer.lease``): the driver writes the token of each
  launch into it before starting it; a rank whose token is no longer there has been
  replaced, and exits before it touches the run directory again.

It exits with ``os._exit`` (no save: a replaced job must not write, and an orphaned one
has no one to report to; its last checkpoint is what a resume reads).
"""

from __future__ import annotations

import os
import sys
import threading

from hpcml import env, log
from hpcml.contract import Contract
from hpcml.errors import ConfigError

logger = log.get_logger(__name__)

#: Exit status of a rank that left because its driver or its launch is gone.
ORPHANED = 70
POLL_S = 1.0
_started: list[threading.Thread] = []


def check(contract: Contract, lease: bool = True) -> str | None:
    """Why this process must not go on (its driver is gone, or it was replaced), or None.
    ``lease``: read the lease file too (one rank per node does: a file read per rank and
    second would load a parallel file system for nothing -- one rank's exit ends the job)."""
    if contract.driver_gone():
        return f"the campaign's driver (pid {contract.driver_pid} on {contract.driver_host}) is gone"
    if lease and contract.superseded():
        return f"a newer launch of the training job holds {contract.run_dir}/trainer.lease"
    return None


def start(contract: Contract | None = None, poll_s: float = POLL_S) -> threading.Thread | None:
    """Watch the driver and the lease from a daemon thread (once per process); None when this
    process was not started by a campaign, or the contract names neither."""
    if _started:
        return _started[0]
    if contract is None:
        try:
            contract = Contract.from_env()
        except ConfigError:
            return None
    if contract.driver_pid is None and contract.launch is None:
        return None

    lease = env.detect().local_rank in (0, None)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            why = check(contract, lease)
            if why is not None:
                logger.error("%s: this training-job process exits (status %d)", why, ORPHANED)
                print(f"hpcml: {why}: exiting", file=sys.stderr, flush=True)
                os._exit(ORPHANED)

    thread = threading.Thread(target=watch, name="hpcml-lifeline", daemon=True)
    thread.start()
    _started.append(thread)
    return thread
