"""What one execution of a campaign reports: the :class:`CampaignResult` that ``run()`` returns,
and the summary written beside it (``campaign.json``) -- read from a finished
:class:`~hpcml.ensemble.runner.Run`, changing nothing."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hpcml import contract, idset, log, safeio
from hpcml.ensemble import attempts, provenance
from hpcml.ensemble.book import CANCELLED, COMPLETED, FAILED, PENDING, RUNNING
from hpcml.ensemble.spec import CampaignResult

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ensemble.runner import Run

logger = log.get_logger(__name__)


def result(run: Run, wall_s: float) -> CampaignResult:
    """What ``run()`` returns: every simulation's outcome, the trainer's, and the run's timings."""
    book = run.book
    overhead = book.overheads.median()
    complete = book.all_done() and (run.trainer is None or run.trainer.returncode == 0)
    interrupted = run.stop_reason is not None and not complete  # a late warning changes nothing done
    return CampaignResult(
        run_dir=str(run.run_dir), total=len(book), completed=book.ids(COMPLETED), failed=book.ids(FAILED),
        cancelled=book.ids(CANCELLED, PENDING, RUNNING), attempts=book.attempts(), retried=book.retried_ids(),
        samples_sent=book.samples_sent, wall_s=round(wall_s, 3), parsl_load_s=round(run.parsl_load_s, 3),
        task_overhead_s=round(overhead, 4) if overhead is not None else None,
        training_returncode=run.trainer.returncode if run.trainer else None, error=run.error,
        skipped=book.skipped, interrupted=interrupted,
        campaign_id=getattr(run, "claim", None) and run.claim.campaign,
        run_id=getattr(run, "claim", None) and run.claim.run, samples=run.samples)


def summary(run: Run, r: CampaignResult) -> dict:
    """``campaign.json`` (``training.json`` offline): the result with the run's settings and what every run
    of the campaign completed."""
    d = {f.name: getattr(r, f.name) for f in fields(r)}  # the id sets and attempts stay views: written in chunks
    d.update(version=2, status=r.status, started=attempts.iso(run.started_at), ended=attempts.iso(time.time()),
             host=socket.gethostname(), max_concurrent=run.c.max_concurrent, retries=run.retries,
             sim_timeout_s=run.c.sim_timeout_s, provenance=run.prov_path.name, ok=r.ok,
             stop_reason=run.stop_reason, deadline=run.deadline, pid=os.getpid(),
             training=None if run.trainer is None else run.trainer.summary(),
             cumulative={"sims_completed": provenance.completed_ids(run.run_dir),
                         "samples": run.samples})  # every run of the campaign, not only this one
    return d


def write_summary(path: Path, record: dict) -> None:
    """``record`` as JSON, atomically and a chunk at a time (:func:`hpcml.idset.dump`):
    at 10^5 simulations neither the text nor a list of the ids is built whole."""
    safeio.replace(path, idset.dump(record))


def workflow_summary(r: CampaignResult, run_dir: str | os.PathLike, problems: list[str], *,
                     counted: Callable[[int], bool] = lambda sim_id: True, **extra: Any) -> dict:
    """What a workflow reports of one campaign run (its ``summary.json``, written here): the
    trainer's own summary of this run (``train_summary.json``: samples, steps, errors), the
    status (``failed`` with ``problems``, ``interrupted``, ``ok``), the simulations' counts --
    of those ``counted`` (e.g. not the held-out ones) -- and ``extra``."""
    run_dir = Path(run_dir)
    try:  # the run directory is untrusted input: bounded, a regular file, JSON checked
        train = safeio.read_json(run_dir / contract.SUMMARY_FILE, contract.MAX_RECORD_BYTES) or {}
    except (ValueError, OSError) as e:
        logger.warning("the trainer's summary is not read: %s", e)
        train = {}
    out = {**(train if train.get("run") == r.run_id else {}), "problems": problems, **extra,
           "status": "failed" if problems else "interrupted" if r.interrupted else "ok",
           "sims_completed": sum(1 for s in r.completed if counted(s)), "sims_resumed": len(r.skipped),
           "sims_failed": sum(1 for s in r.failed if counted(s)), "sim_attempts": sum(r.attempts.values()),
           "sims_retried": len(r.retried)}
    safeio.write_json(run_dir / "summary.json", out)
    return out
