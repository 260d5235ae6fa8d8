"""What an attempt of a simulation leaves beside it for its campaign, where the attempt wrapper
asks (``HPCML_STREAM_RECORD``): what it streamed, and the deterministic error that ended it.
Nothing outside a campaign. Imports nothing heavy: simulations write these."""

from __future__ import annotations

import json
import os
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
