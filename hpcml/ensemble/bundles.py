"""The driver's side of bundles: members of ``SimSpec(entry=...)`` grouped into tasks of
``Campaign.bundle`` members (:mod:`hpcml.ensemble.bundle` runs them), and their records
folded into the campaign's provenance when a task ends."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcml.ensemble import bundle, provenance
from hpcml.log import get_logger

logger = get_logger(__name__)


@dataclass
class BundleTask:
    """One task of bundled members (``sims``: the pool's Sim records of them)."""

    sims: list
    dir: Path

    @property
    def sim_ids(self) -> list[int]:
        return [s.spec.sim_id for s in self.sims]

    @property
    def streams(self) -> bool:
        return any(s.streams for s in self.sims)

    def running(self) -> bool:
        """Its attempt has started and not ended (one member runs at a time)."""
        starts = sorted(self.dir.glob("attempt_*.start"))
        return bool(starts) and not starts[-1].with_suffix(".end").exists()


def start(sims: list, run_dir: Path, run: str, retries: int, first_attempts: dict[int, int]) -> BundleTask:
    """Write the task's members (each with the attempt number it starts from) into a directory
    of this run's; the task runs ``python -m hpcml.ensemble.bundle DIR`` there."""
    d = run_dir / "sims" / f"bundle_{run}_{sims[0].spec.sim_id:08d}"
    members = [{"sim_id": s.spec.sim_id, "params": dict(s.spec.params),
                "first_attempt": first_attempts.get(s.spec.sim_id, 0)} for s in sims]
    bundle.write_spec(d, sims[0].spec.entry, members, retries)
    return BundleTask(sims=sims, dir=d)


def argv(task: BundleTask) -> list[str]:
    return [sys.executable, "-m", "hpcml.ensemble.bundle", str(task.dir)]


def settle(task: BundleTask, run_dir: Path, launch: str, exc: BaseException | None) -> None:
    """Fold the task's member records into provenance and set each member's outcome and
    final error; a member with no record was lost with its task (``exc``) or never started."""
    by: dict[int, list[dict]] = {}
    for rec in bundle.read_records(task.dir, root=run_dir):
        by.setdefault(rec["sim_id"], []).append(rec)
    rows = []
    for s in task.sims:
        recs = by.get(s.spec.sim_id, [])
        for r in recs:
            if r["attempt"] in s.recorded:
                continue
            row = bundle.provenance_row(r, s.spec.entry, launch, task.dir.name)
            s.recorded[r["attempt"]] = {k: row[k] for k in ("status", "samples_sent", "duration_s", "streamed")}
            rows.append(row)
        last = recs[-1] if recs else None
        s.finished = time.monotonic()
        if last is not None and last["status"] == "ok":
            s.outcome = "completed"
        elif last is not None and last["status"] == "final":
            s.outcome, s.final_error = "failed", str(last.get("error"))
        elif last is not None or exc is not None:
            s.outcome = "failed"
        else:
            s.outcome = "cancelled"
    provenance.append_provenance(run_dir, rows)  # one write for the task's members
