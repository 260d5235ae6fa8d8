"""What an attempt of a simulation leaves beside it for its campaign, where the attempt wrapper
asks (``HPCML_STREAM_RECORD``): what it streamed, and the deterministic error that ended it.
Nothing outside a campaign. Imports nothing heavy: simulations write these."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

from hpcml import safeio
from hpcml.contract import ENV_STREAM_RECORD
from hpcml.errors import ConfigError

def write_stream_record(n_sent: int, nbytes: int, sim: int, attempt: int,
                        environ: Mapping[str, str] | None = None) -> None:
    """Rank 0 of a streaming simulation: what it sent, where the attempt wrapper asked
    (``HPCML_STREAM_RECORD``); nothing outside a campaign."""
    path = (os.environ if environ is None else environ).get(ENV_STREAM_RECORD)
    if path:
        safeio.write_json(path, {"sim": sim, "attempt": attempt, "n_sent": n_sent, "bytes": nbytes,
                                 "time": time.time()})


#: Beside an attempt's stream record: the deterministic error that ended it (never retried).
FINAL_SUFFIX = ".final.json"


def write_final_error(message: str, sim: int, attempt: int, environ: Mapping[str, str] | None = None) -> None:
    """A simulation's deterministic error, where the attempt wrapper looks for it: the
    campaign then retries nothing and names the cause (:func:`read_final_error`). The first
    rank's message is kept; nothing outside a campaign."""
    path = (os.environ if environ is None else environ).get(ENV_STREAM_RECORD)
    if not path or not path.endswith(".stream.json"):
        return
    final = path[:-len(".stream.json")] + FINAL_SUFFIX
    try:
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return  # another rank's is there, or the directory is gone
    with os.fdopen(fd, "w") as f:
        json.dump({"sim": sim, "attempt": attempt, "error": message[:4000], "time": time.time()}, f, default=str)


def read_final_error(sim_dir: str | os.PathLike) -> str | None:
    """The deterministic error an attempt of the simulation in ``sim_dir`` recorded, or None."""
    for path in sorted(Path(sim_dir).glob(f"attempt_*{FINAL_SUFFIX}")):
        try:
            rec = safeio.read_json(path, 16384)
        except ConfigError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("error"), str):
            return rec["error"]
    return None


#: In the run directory: a training job's deterministic end (exit 78), for a Parsl retry of it.
TRAINER_FINAL = "train.final.json"


def write_trainer_final(run_dir: str, run: str, message: str) -> None:
    """Rank 0 of a training job that ends on a mistake a relaunch would repeat (exit 78): said
    where a retry of the job looks first (:func:`trainer_final`), so a workflow's retries of it
    (Parsl's ``retries``, :func:`hpcml.ensemble.apps.training`) launch nothing."""
    if run_dir and os.path.isdir(run_dir):
        safeio.write_json(Path(run_dir) / TRAINER_FINAL, {"run": run, "error": message[:4000], "time": time.time()})


def trainer_final(run_dir: str, run: str) -> str | None:
    """This run's training job ended on a deterministic error (:func:`write_trainer_final`): its message."""
    try:
        rec = safeio.read_json(Path(run_dir) / TRAINER_FINAL, 1 << 16)
    except (ConfigError, OSError):
        return None
    if isinstance(rec, dict) and rec.get("run") == run and isinstance(rec.get("error"), str):
        return rec["error"]
    return None


#: Exceptions a retry may cure -- the machine's, the network's, a launch's -- never taken as repeated.
_TRANSIENT = ("Launch", "Connection", "Timeout", "OSError", "IOError", "BrokenPipe", "Memory", "ZMQ", "Interrupt",
              "Signal", "Stream", "Handshake")
_RAISED = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception)): \S.{0,300}")


def raised(err_text: str) -> str | None:
    """The exception a failed attempt's stderr ends with (its last ``Name: message`` line),
    or None: none, or one a retry may cure (:data:`_TRANSIENT`)."""
    for line in reversed(err_text.splitlines()[-60:]):
        m = _RAISED.search(line)
        if m:
            return None if any(t in m.group(1) for t in _TRANSIENT) else m.group(0)
    return None


def repeated(seen: list[str | None]) -> str | None:
    """The exception the last two attempts in ``seen`` (each :func:`raised`'s answer) both ended on, else None."""
    return seen[-1] if len(seen) >= 2 and seen[-1] is not None and seen[-1] == seen[-2] else None


def failed_alike(sim_dir: str, k: int) -> str | None:
    """Attempts ``k - 2`` and ``k - 1`` of the simulation in ``sim_dir`` both ended with a
    non-zero exit and no timeout, cancellation or signal (their ``.end``) on the same exception
    of the simulation's own: it (a third would raise it again), else None."""
    if k < 2:
        return None
    seen = []
    for i in (k - 2, k - 1):
        base = Path(sim_dir) / f"attempt_{i}"
        try:
            end = safeio.read_json(f"{base}.end", 4096)
            err = safeio.tail(f"{base}.err", 16384).decode(errors="replace")
        except (ConfigError, OSError):
            return None
        if not isinstance(end, dict) or end.get("returncode") in (0, None) or end.get("reason"):
            return None
        seen.append(raised(err))
    return repeated(seen)
