"""A run directory's record of its run, ``config.json`` and ``metrics.jsonl``, kept apart from an
earlier run that used the same directory: a fresh run (not resumed from a checkpoint) moves the
earlier record into ``previous-N/`` instead of appending to its history, so no two runs' steps
mix (a calibration reading the directory would take both for one layout) and nothing is lost."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hpcml import log

logger = log.get_logger(__name__)

RECORD = ("config.json", "metrics.jsonl")
MAX_PREVIOUS = 10_000


def holds_run(run_dir: str | os.PathLike) -> bool:
    """``run_dir`` holds an earlier run's history: a non-empty regular ``metrics.jsonl``."""
    try:
        st = os.lstat(Path(run_dir) / "metrics.jsonl")
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


def set_aside(run_dir: str | os.PathLike) -> Path:
    """Move the earlier run's record into a new ``run_dir/previous-N`` (the lowest N free) and
    return it. Only the entries are renamed (a link stays a link, nothing is followed)."""
    run_dir = Path(run_dir)
    for n in range(1, MAX_PREVIOUS + 1):
        dest = run_dir / f"previous-{n}"
        try:
            os.mkdir(dest, 0o755)
        except FileExistsError:
            continue
        for name in RECORD:
            try:
                os.rename(run_dir / name, dest / name)
            except FileNotFoundError:
                pass
        logger.warning("run directory %s held an earlier run: its config.json and metrics.jsonl moved to %s "
                       "(resume from a checkpoint to continue a run's history)", run_dir, dest)
        return dest
    raise FileExistsError(f"run directory {run_dir}: previous-1 ... previous-{MAX_PREVIOUS} all exist; give a new "
                          f"--run-dir")
