"""The campaign's provenance: one JSON line per ended attempt in ``run_dir/provenance.jsonl``,
appended as attempts end and read back a line at a time (a resume, the ledger, ``hpcml``
summaries). The file is input like everything in the run directory (:mod:`hpcml.safeio`):
a line that is not one of ours is passed over; appends never go through a link.
:mod:`hpcml.ensemble.attempts` makes the records."""

from __future__ import annotations

import json
from pathlib import Path

from hpcml import safeio
from hpcml.idset import IdSet
from hpcml.errors import ConfigError

PROVENANCE_FILE = "provenance.jsonl"
"""One JSON record per ended attempt, in ``run_dir``."""
MAX_RECORD_LINE = 1 << 20
"""An attempt's record or provenance line larger than this is not one hpcml wrote: passed over."""


def read_provenance(run_dir: Path, sim_id: int | None = None) -> list[dict]:
    """The provenance records of ``run_dir`` (of one simulation, or all), in the order written;
    a line cut by a crash while it was appended is skipped."""
    return [rec for rec in iter_provenance(run_dir) if sim_id is None or rec.get("sim_id") == sim_id]


def iter_provenance(run_dir: Path):
    """The provenance records one at a time (a campaign of 10^5 members is not held at once);
    a line that is not one of ours (torn, too long, too deep, not JSON) is passed over."""
    for line in safeio.iter_lines(Path(run_dir) / PROVENANCE_FILE, MAX_RECORD_LINE, root=run_dir):
        try:
            rec = safeio.parse_json(line, PROVENANCE_FILE, max_depth=8)
        except ConfigError:
            continue
        if isinstance(rec, dict):
            yield rec


def append_provenance(run_dir: Path, records: list[dict]) -> None:
    """Append records to ``run_dir/provenance.jsonl`` in one write, never through a link
    (:func:`hpcml.safeio.append`)."""
    if records:
        safeio.append(Path(run_dir) / PROVENANCE_FILE, "".join(json.dumps(r, default=str) + "\n" for r in records),
                      root=run_dir, lines=True)


def scan(run_dir: Path) -> tuple[dict[int, dict], dict[int, int]]:
    """One pass over ``run_dir``'s provenance: :func:`completed_sims` and :func:`last_attempts`
    together (a resume at 10^5 members reads the file once for both)."""
    done: dict[int, dict] = {}
    last: dict[int, int] = {}
    for rec in iter_provenance(run_dir):
        sim, k = rec.get("sim_id"), rec.get("attempt")
        if not isinstance(sim, int):
            continue
        if isinstance(k, int):
            last[sim] = max(last.get(sim, -1), k)
        if rec.get("status") == "ok":  # the latest counts: a later run's
            done[sim] = {"attempt": k, "streamed": rec.get("streamed")}
    return done, last


def last_attempts(run_dir: Path) -> dict[int, int]:
    """The highest attempt number each simulation has in ``run_dir``'s provenance (one pass)."""
    return scan(run_dir)[1]


def completed_sims(run_dir: Path) -> dict[int, dict]:
    """Simulations with a successful attempt in ``run_dir``'s provenance: id -> its latest
    record's ``attempt`` and ``streamed`` (not the whole record: 10^5 of them add up)."""
    return scan(run_dir)[0]


def completed_ids(run_dir: Path) -> IdSet:
    """The ids of :func:`completed_sims` as an :class:`~hpcml.idset.IdSet` (a few runs
    of ids, whatever their number)."""
    return IdSet(rec["sim_id"] for rec in iter_provenance(run_dir)
                 if rec.get("status") == "ok" and type(rec.get("sim_id")) is int and rec["sim_id"] >= 0)
