"""The walltime warning as a process-wide flag: installed first, read by whoever loops.

Schedulers warn a job before its walltime with a signal (Slurm ``--signal``, LSF ``-wa``,
the timer of ``hpcml job`` scripts on PBS). A handler installed late -- after torch's
import, after the grid is built -- leaves a window in which SIGUSR1's default action kills
the process, and a killed run is not requeued. So entry points call :func:`install` first
thing; the training loops and the campaign read :func:`requested` at their next step.
Imports nothing heavy.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable

#: The signals that mean "save and stop": the walltime warning and a polite kill.
STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)

_reason: list[str] = []


def request(reason: str) -> None:
    """Ask the loops of this process to save and stop (the first reason is kept).

    No lock: this runs in signal handlers, which CPython nests -- a second signal while
    the first held a lock would deadlock the main thread. Under the GIL, in the main
    thread, "append if empty" needs none."""
    if not _reason:
        _reason.append(reason)


def requested() -> str | None:
    """Why a stop was asked (``"SIGUSR1"``...), or None."""
    return _reason[0] if _reason else None


def clear() -> None:
    """Forget a request (a test that runs several loops in one process)."""
    _reason.clear()


def install(signals: Iterable[int] = STOP_SIGNALS) -> dict[int, object]:
    """Handlers that record a stop request for ``signals``; the previous handlers, for
    :func:`restore`. Only the main thread may install them: elsewhere nothing happens."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, lambda signum, _f: request(signal.Signals(signum).name)) for s in signals}


def finished(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """The run's outcome is decided (done, or saved and stopping): ignore a late warning.

    At exit Python puts back the default action of every signal it handled -- for SIGUSR1,
    death -- so a warning in the last moments of a finished job would turn its exit 0 into
    a kill, and the job would count as failed. An ignored signal stays ignored.
    """
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            signal.signal(s, signal.SIG_IGN)


def restore(previous: dict[int, object]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)
