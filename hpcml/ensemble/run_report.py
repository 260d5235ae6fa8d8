"""What one execution of a campaign reports: the :class:`CampaignResult` that ``run()`` returns,
and the summary written beside it (``campaign.json``) -- read from a finished
:class:`~hpcml.ensemble.runner.Run`, changing nothing."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from hpcml.ensemble import attempts, provenance
from hpcml.ensemble.spec import CampaignResult

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ensemble.runner import Run


def result(run: Run, wall_s: float) -> CampaignResult:
    """What ``run()`` returns: every simulation's outcome, the trainer's, and the run's timings."""
    overheads = run.pool.overheads()
    by = lambda o: [s.spec.sim_id for s in run.sims if s.outcome == o]  # noqa: E731
    complete = all(s.outcome == "completed" for s in run.sims) and (
        run.trainer is None or run.trainer.returncode == 0)
    interrupted = run.stop_reason is not None and not complete  # a late warning changes nothing done
    return CampaignResult(
        run_dir=str(run.run_dir), total=len(run.sims), completed=by("completed"), failed=by("failed"),
        cancelled=[s.spec.sim_id for s in run.sims if s.outcome in ("cancelled", "pending", "running")],
        attempts={s.spec.sim_id: len(s.recorded) for s in run.sims},
        retried=[s.spec.sim_id for s in run.sims if len(s.recorded) > 1],
        samples_sent=sum(r["samples_sent"] or 0 for s in run.sims for r in s.recorded.values()
                         if r["status"] == "ok" and isinstance(r["samples_sent"], int)),
        wall_s=round(wall_s, 3), parsl_load_s=round(run.parsl_load_s, 3),
        task_overhead_s=round(overheads[len(overheads) // 2], 4) if overheads else None,
        training_returncode=run.trainer.returncode if run.trainer else None, error=run.error,
        skipped=[s.spec.sim_id for s in run.sims if s.skipped], interrupted=interrupted,
        campaign_id=getattr(run, "claim", None) and run.claim.campaign,
        run_id=getattr(run, "claim", None) and run.claim.run, samples=run.samples)

def summary(run: Run, r: CampaignResult) -> dict:
    """``campaign.json`` (``training.json`` offline): the result with the run's settings and what every run
    of the campaign completed."""
    d = asdict(r)
    d["attempts"] = {str(k): v for k, v in r.attempts.items()}
    d.update(version=2, status=r.status, started=attempts.iso(run.started_at), ended=attempts.iso(time.time()),
             host=socket.gethostname(), max_concurrent=run.c.max_concurrent, retries=run.retries,
             sim_timeout_s=run.c.sim_timeout_s, provenance=run.prov_path.name, ok=r.ok,
             stop_reason=run.stop_reason, deadline=run.deadline, pid=os.getpid(),
             training=None if run.trainer is None else run.trainer.summary(),
             cumulative={"sims_completed": sorted(provenance.completed_sims(run.run_dir)),
                         "samples": run.samples})  # every run of the campaign, not only this one
    return d
