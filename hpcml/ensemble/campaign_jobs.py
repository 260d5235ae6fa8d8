"""What a campaign submits, planned against the queue's per-user limits before anything is.

A pilot campaign needs two jobs running at once -- the simulations' block and the trainer's
own allocation -- and facilities cap the jobs one user may run or queue in a queue: ALCF's
``debug`` takes 1 running/accruing/queued, Polaris' ``capacity`` 1 running, Frontier's
``extended`` 1 running and 1 eligible. Two jobs in such a queue stall (the second waits for
the first, which waits for it) or are refused at ``qsub``. A one-allocation campaign is one
job, but a PBS requeue chain holds a second (the successor is queued while the job runs).

:func:`plan` counts the jobs per queue at once and picks: the pilot when it fits, else one
allocation (trainer and simulations in the same job, ``hpcml job --driver``), else the
pilot with the trainer in another queue that has room; when nothing fits it raises
ConfigError naming the limit and its source. Pure data: no Parsl, no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hpcml.ensemble.checks import check_count, walltime_seconds
from hpcml.ensemble.rules import Queue, pick_queue
from hpcml.errors import ConfigError

MODES = ("auto", "pilot", "one-allocation")


@dataclass(frozen=True, kw_only=True)
class PlannedJob:
    """One batch job of the campaign: its role (``sims``, ``trainer`` or ``driver``), queue row and size."""

    role: str
    nodes: int
    walltime: str
    row: Queue | None
    queue: str | None = None
    """The queue it names (the row's, else the user's)."""

    def to_dict(self) -> dict:
        r = self.row
        return {"role": self.role, "queue": self.queue, "nodes": self.nodes, "walltime": self.walltime,
                "limits": {"running": r.max_running if r else None, "queued": r.max_queued if r else None}}


@dataclass(frozen=True, kw_only=True)
class CampaignJobs:
    """The plan: ``mode`` (``pilot`` or ``one-allocation``), the jobs, and how many run and
    wait at once per queue, against the queues' limits; ``why`` says why this mode."""

    mode: str
    jobs: tuple[PlannedJob, ...]
    running: dict[str, int]
    """Jobs running at once, per queue name."""
    queued: dict[str, int]
    """Jobs in the queue at once (running included), per queue name."""
    why: str
    considered: tuple[str, ...] = field(default=())
    """Why the modes before it did not fit."""

    @property
    def max_running_at_once(self) -> int:
        return sum(self.running.values())

    @property
    def max_queued_at_once(self) -> int:
        return sum(self.queued.values())

    def to_dict(self) -> dict:
        rows = {j.queue: j.row for j in self.jobs if j.row is not None}
        first = self.jobs[0].row
        return {"mode": self.mode, "jobs": [j.to_dict() for j in self.jobs],
                "max_running_at_once": self.max_running_at_once, "max_queued_at_once": self.max_queued_at_once,
                "limits": {"running": first.max_running if first else None,
                           "queued": first.max_queued if first else None},
                "per_queue": {q: {"running": self.running[q], "queued": self.queued[q],
                                  "limits": {"running": r.max_running, "queued": r.max_queued}}
                              for q, r in rows.items()},
                "why": self.why, "considered": list(self.considered)}

    def explain(self) -> str:
        lines = [f"campaign jobs: {self.mode} -- {self.why}"]
        lines += [f"  {j.role}: {j.nodes} node(s) x {j.walltime} in {j.queue or 'the default queue'}"
                  + (f" ({j.row.limits()})" if j.row else "") for j in self.jobs]
        lines += [f"  not {c}" for c in self.considered]
        return "\n".join(lines)


def _counts(jobs: list[PlannedJob], chain: bool = False) -> tuple[dict[str, int], dict[str, int]]:
    """Jobs running, and in the queue (running included), at once per queue name; ``chain``: the
    one job's successor waits in its queue while it runs (a PBS/LSF job resubmitting itself)."""
    running = dict(Counter(j.queue or "default" for j in jobs))
    return running, {q: n + int(chain) for q, n in running.items()}


def _over(jobs: list[PlannedJob], running: dict[str, int], queued: dict[str, int]) -> str | None:
    """Why ``jobs`` do not fit their queues' per-user limits (``running``/``queued``: :func:`_counts`), or None."""
    for r in {j.row.name: j.row for j in jobs if j.row is not None}.values():
        for limit, n, what in ((r.max_running, running[r.name], "running"),
                               (r.max_queued, queued[r.name], "queued or running")):
            if limit is not None and n > limit:
                return (f"{n} jobs at once in {r.name}, which allows {limit} {what} per user ({r.note or r.limits()}; "
                        f"source {r.source})")
    return None


def plan(site, *, nodes: int, walltime: str, train_nodes: int = 1, queue: str | None = None, mode: str = "auto",
         requeue: bool = True) -> CampaignJobs:
    """The jobs a campaign of ``nodes`` in all (``train_nodes`` of them the trainer's) for
    ``walltime`` submits on ``site`` (a :class:`~hpcml.ensemble.site.Site`), within the
    per-user limits of the queues they go to (``queue``: the user's, for every job).
    ``requeue``: a one-allocation job resubmits itself on exit 75 where its queue allows."""
    check_count("nodes", nodes)
    check_count("train_nodes", train_nodes)
    walltime_seconds(walltime)
    if mode not in MODES:
        raise ConfigError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if nodes <= train_nodes:
        raise ConfigError(f"nodes={nodes} leaves no node for the simulations beside train_nodes={train_nodes}: "
                          f"expected nodes > train_nodes")
    considered: list[str] = []
    table: list[str] = []
    order = {"auto": ("pilot", "one-allocation", "pilot-elsewhere"), "pilot": ("pilot", "pilot-elsewhere"),
             "one-allocation": ("one-allocation",)}[mode]
    for how in order:
        try:
            got = _try(site, how, nodes, walltime, train_nodes, queue, requeue)
        except ConfigError as e:  # no row for these nodes and walltime: the table is named once, below
            considered.append(f"{how}: {str(e).split(' (', 1)[0]}")
            table = str(e).split(" (", 1)[1:] or table
            continue
        if isinstance(got, str):
            considered.append(f"{how}: {got}")
            continue
        why = {"pilot": "the simulations' block and the trainer's allocation fit the queues' per-user limits",
               "one-allocation": "the trainer and the simulations share one job" +
                                 (": a pilot's two jobs would not fit" if considered else
                                  f", within {got[0][0].queue or 'the default queue'}'s per-user limits"),
               "pilot-elsewhere": "the trainer goes to another queue with room: neither one job nor two in the "
                                  "first queue fit"}[how]
        return CampaignJobs(mode="one-allocation" if how == "one-allocation" else "pilot", jobs=tuple(got[0]),
                            running=got[1], queued=got[2], why=why, considered=tuple(considered))
    raise ConfigError(f"no way to run a campaign of {nodes} node(s) for {walltime} on {site.name} within its "
                      f"queues and per-user limits: " + "; ".join(considered) + (f" ({table[0]}" if table else ""))


def _job(site, role: str, nodes: int, walltime: str, queue: str | None, row: Queue | None = None) -> PlannedJob:
    row = row if row is not None else pick_queue(site.name, site.queues, nodes, walltime, queue)
    return PlannedJob(role=role, nodes=nodes, walltime=walltime, row=row, queue=row.name if row else queue)


def _try(site, how: str, nodes: int, walltime: str, train_nodes: int, queue: str | None, requeue: bool):
    """``(jobs, running, queued)`` of one way to run the campaign, or why it does not fit."""
    if how == "one-allocation":
        jobs = [_job(site, "driver", nodes, walltime, queue)]
        row = jobs[0].row
        counts = _counts(jobs, chain=requeue and site.batch.resubmits and (row is None or row.requeue))
    else:
        sims = _job(site, "sims", nodes - train_nodes, walltime, queue)
        rows = [None] if how == "pilot" else [r for r in site.queues if queue is None and r.auto
                                              and r.name != sims.queue
                                              and r.fits(train_nodes, walltime_seconds(walltime))]
        for row in rows:  # pilot: the trainer beside the simulations; pilot-elsewhere: in another automatic row
            jobs = [sims, _job(site, "trainer", train_nodes, walltime, queue, row)]
            counts = _counts(jobs)
            if how == "pilot" or _over(jobs, *counts) is None:
                break
        else:
            return f"no other queue takes the trainer's {train_nodes} node(s) for {walltime} with room"
    why = _over(jobs, *counts)
    return why if why else (jobs, *counts)
