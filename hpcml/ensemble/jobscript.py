"""The outer batch job a user would otherwise write by hand, for any site: ``hpcml job``.

One script per scheduler (Slurm, PBS Pro, LSF) with the same run protocol:

- directives: nodes (a range ``1-2`` on Slurm, so a requeued job restarts on the nodes that
  are left), walltime, account, queue, the site's own lines; the job is rerunnable;
- the site's modules and environment, this Python environment, ``HPCML_JOB_DEADLINE``
  (epoch seconds of the walltime's end: every timeout inside follows from it);
- the command, under the site's training launch line (or as is with ``driver``: a
  campaign driver launches its own steps);
- the walltime warning arrives as SIGUSR1 (``--signal=B:USR1@S`` on Slurm, ``-wa/-wt`` on
  LSF, a timer on PBS, which sends none) and is forwarded to the command, which saves
  and exits with :data:`NOT_FINISHED` (75, EX_TEMPFAIL);
- on exit 75 the job requeues itself (``scontrol requeue``; on PBS and LSF it submits its
  own script again, counting) and the next run resumes from ``latest``.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcml import safeio
from hpcml.ensemble.checks import check_count, walltime_seconds, warning_seconds
from hpcml.ensemble.rules import Fact, Queue
from hpcml.ensemble.site import Site, load_site, python_env_line
from hpcml.env import NOT_FINISHED
from hpcml.errors import ConfigError
from hpcml.numeric import is_int

_NODES = re.compile(r"(\d+)(?:-(\d+))?")


def parse_nodes(value: object) -> tuple[int, int]:
    """``2`` or ``"2"`` -> (2, 2); ``"1-2"`` -> (1, 2): a node count or a Slurm node range."""
    if is_int(value):
        return check_count("nodes", value), value
    m = _NODES.fullmatch(value) if isinstance(value, str) else None
    lo, hi = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    if not m or lo < 1 or hi < lo:
        raise ConfigError(f"nodes={value!r} must be a count N >= 1 or a range MIN-MAX with 1 <= MIN <= MAX")
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One batch job, checked against the site's rules. ``repr()`` names everything the script depends on."""

    site: Site
    command: tuple[str, ...]
    """The program and its arguments (a training script, or a campaign driver with ``driver``)."""
    nodes: tuple[int, int]
    """(min, max) nodes; min < max only on Slurm: the job restarts on fewer after losing one."""
    walltime: str
    account: str | None = None
    """Allocation charged; None: ``$HPCML_ACCOUNT``, else none (refused where the site requires one)."""
    queue: str | None = None
    """Queue, partition or QOS; None: the site's table picks one from nodes and walltime."""
    name: str = "hpcml"
    driver: bool = False
    """Run ``command`` as is on the job's first node: it launches its own steps (a Campaign)."""
    ranks: int | None = None
    """Training ranks (default: one per device of every node); not with a node range."""
    warn_s: int | None = None
    """Seconds before the walltime that SIGUSR1 arrives (default :func:`warning_seconds`)."""
    requeue: bool = True
    max_requeues: int = 10
    workdir: str | None = None
    """Where the job runs (default: where it was submitted)."""
    script_path: str | None = None
    """Where this script is saved: PBS resubmits it from there (it has no requeue of its own)."""
    queue_row: Queue | None = field(default=None, init=False)
    """The row of the site's queue table the job goes to (None: no table, or a queue it lacks)."""
    notes: tuple[str, ...] = field(default=(), init=False)
    """What the user must know about this script (a queue that cannot requeue, a retired site)."""

    def __post_init__(self) -> None:
        if isinstance(self.command, str) or not self.command or not all(isinstance(a, str) for a in self.command):
            raise ConfigError(f"command={self.command!r} must be a non-empty list of strings (after --)")
        object.__setattr__(self, "command", tuple(self.command))
        lo, hi = parse_nodes(f"{self.nodes[0]}-{self.nodes[1]}" if isinstance(self.nodes, tuple) else self.nodes)
        object.__setattr__(self, "nodes", (lo, hi))
        s = self.site
        if s.scheduler == "local":
            raise ConfigError(f"site {s.name} has no batch system: run the command directly, or pick a "
                              f"batch site (hpcml job --site slurm-local)")
        if lo != hi and not s.batch.node_range:
            raise ConfigError(f"nodes={lo}-{hi}: a node range needs Slurm; {s.name} ({s.scheduler}) takes a "
                              f"fixed count")
        if self.ranks is not None:
            check_count("ranks", self.ranks)
            if lo != hi:
                raise ConfigError(f"ranks={self.ranks} with nodes={lo}-{hi}: the rank count follows the nodes "
                                  f"({s.train_ranks_per_node} per node)")
        total = walltime_seconds(self.walltime)
        warn = self.warn_s if self.warn_s is not None else warning_seconds(self.walltime)
        if not is_int(warn) or not 0 < warn < total:
            raise ConfigError(f"warn_s={warn!r} must be an integer of seconds in 1..{total - 1} (walltime "
                              f"{self.walltime})")
        object.__setattr__(self, "warn_s", warn)
        check_count("max_requeues", self.max_requeues, minimum=0)
        if self.queue is not None and (not isinstance(self.queue, str) or not re.fullmatch(r"[\w.-]+", self.queue)):
            raise ConfigError(f"queue={self.queue!r} must be a queue, partition or QOS name")
        object.__setattr__(self, "queue_row", s.pick_queue(hi, self.walltime, self.queue))
        object.__setattr__(self, "account", s.account_for(self.account))
        self.launch_line(s.batch.nodes_var)  # ranks that do not fit the nodes fail here, not in the job
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ConfigError(f"name={self.name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        notes = []
        if s.retired:
            notes.append(f"site {s.name} is retired ({s.retired}): this script is for reference only")
        if self.requeue and not self.requeue_allowed:
            notes.append(f"queue {self.queue_row.name} cannot requeue this job: {self.no_requeue_reason}; on exit "
                         f"{NOT_FINISHED} (not finished) submit the script again once it has ended, or choose a "
                         f"queue without that limit")
        if self.queue is not None and self.queue_row is None and s.queues:
            notes.append(f"queue {self.queue} is not in {s.name}'s table "
                         f"({', '.join(dict.fromkeys(q.name for q in s.queues))}): its limits are not checked")
        object.__setattr__(self, "notes", tuple(notes))

    @property
    def walltime_s(self) -> int:
        return walltime_seconds(self.walltime)

    @property
    def requeue_allowed(self) -> bool:
        """The job requeues (resubmits) itself on exit 75: asked for, and its queue allows it."""
        return self.requeue and (self.queue_row is None or self.queue_row.requeue)

    @property
    def no_requeue_reason(self) -> str:
        """Why the queue cannot take this job back (its row's note)."""
        row = self.queue_row
        return (row.note or f"it allows {row.per_user()}") if row is not None else ""

    def launch_line(self, nodes_var: str) -> str:
        """The command under the site's launch line; node count from ``nodes_var`` when it varies."""
        if self.driver:
            return shlex.join(self.command)
        lo, hi = self.nodes
        if lo == hi:
            return self.site.train_line(self.command, nodes=lo, ranks=self.ranks)
        per = self.site.train_ranks_per_node
        line = self.site.train_launch.format(nodes=f"${nodes_var}", ranks=f"$(({per} * {nodes_var}))",
                                             ranks_per_node=per)
        return f"{line} {shlex.join(self.command)}"


# ----------------------------------------------------------------------------- rendering

_RUN = """\
# Run. The walltime warning arrives here as SIGUSR1 and goes on to the job, which saves a
# checkpoint and exits {nf} ("not finished"); {then}.
{launch} &
hpcml_pid=$!
trap 'echo "hpcml-job: walltime warning: the job saves and stops" >&2; kill -USR1 "$hpcml_pid" 2>/dev/null' USR1
{timer}while :; do
    wait "$hpcml_pid"; rc=$?
    kill -0 "$hpcml_pid" 2>/dev/null || break  # wait ended by the trap: the job still runs
done
{untimer}"""


def facts(spec: JobSpec) -> list[Fact]:
    """Every part of the script in order, each with why it is there and its source."""
    s, batch = spec.site, spec.site.batch
    workdir = batch.workdir(spec)
    out = [Fact(text="#!/bin/bash", why="the batch system runs the script with bash"),
           *batch.header(spec, spec.queue_row), *s.job_directives]
    out.append(Fact(text=f"\n# Written by `hpcml job --site {s.name}`: the site's environment, then the run.\n"
                         f"cd {_quote_path(workdir)}", why="run where the job was submitted (relative paths)"))
    out += [*s.modules, *(Fact(text=v.line, why=v.why, source=v.source) for v in s.environment)]
    out.append(Fact(text=python_env_line(), why="the Python environment hpcml job ran in: the same interpreter "
                                                 "and packages on the compute nodes"))
    out.append(Fact(text=f"export HPCML_SITE={s.name} HPCML_JOB_DEADLINE=$(( $(date +%s) + {spec.walltime_s} ))",
                    why="the site, and the walltime's end in epoch seconds: every timeout inside follows from it"))
    timer = untimer = ""
    if not batch.sends_warning:  # PBS sends no warning: a timer does, warn_s before the end
        timer = (f"(sleep {spec.walltime_s - spec.warn_s} && kill -USR1 $$) &  # the walltime warning\n"
                 "hpcml_timer=$!\n")
        untimer = 'kill "$hpcml_timer" 2>/dev/null\n'
    then = "the job is then requeued and resumes" if spec.requeue_allowed else "it is not requeued"
    launch = spec.launch_line(batch.nodes_var)
    why = ("the campaign driver, as is: it launches its own steps" if spec.driver else s.train_launch_why)
    out.append(Fact(text=_RUN.format(nf=NOT_FINISHED, launch=launch, timer=timer, untimer=untimer,
                                     then=then).rstrip("\n"),
                    why=f"{why}; SIGUSR1 is forwarded so the job saves and exits {NOT_FINISHED}",
                    source=None if spec.driver else s.train_launch_source))
    if spec.requeue_allowed:
        block = batch.requeue_block(spec, _quote_path(batch.script_path(spec)))
        out.append(Fact(text=block.rstrip("\n"), why=f"exit {NOT_FINISHED}: requeue (or resubmit) at most "
                                                      f"{spec.max_requeues} times; the next run resumes from latest"))
    out.append(Fact(text='exit "$rc"', why="the job's exit status is the command's"))
    return out


def render(spec: JobSpec) -> str:
    """The whole batch script of ``spec``."""
    return "\n".join(f.script for f in facts(spec)) + "\n"


def explain(spec: JobSpec) -> str:
    """The script with, after each part, why it is there and where that rule comes from."""
    parts = []
    for f in facts(spec):
        lines = [f.script, f"    ^ why: {f.why}"]
        lines += [f"    ^ source: {f.source}"] if f.source is not None else []
        lines += [f"    ^ unverified: check on the first login: {f.unverified}"] if f.unverified else []
        parts.append("\n".join(lines))
    return "\n".join(parts) + "\n" + "".join(f"note: {n}\n" for n in spec.notes)


def _quote_path(path: str) -> str:
    """Shell-quote ``path`` but let a leading ``$VAR`` expand."""
    m = re.fullmatch(r"(\$\w+)(/.*)?", path)
    if m:
        return f'"{m[1]}"' + (shlex.quote(m[2]) if m[2] else "")
    return shlex.quote(path)


# ----------------------------------------------------------------------------- submitting

def submit(spec: JobSpec, path: str | Path) -> str:
    """Write the script to ``path`` and submit it; the job id (a failure raises
    :class:`~hpcml.ensemble.schedulers.SubmitError` with the command, exit code and outputs)."""
    path = Path(path).resolve()
    if spec.script_path is None and spec.site.batch.resubmits:  # the script submits itself again from there
        spec = dataclasses.replace(spec, script_path=str(path))
    safeio.replace(path, render(spec), mode=0o755)
    return spec.site.batch.submit(path, spec.site.name)


def allocate_line(site: Site, line: str, *, walltime: str, account: str | None, queue: str | None, nodes: int,
                  run_dir: Path, argv: Sequence[str], ranks: int | None) -> str:
    """A training launch line that gets its own allocation from a login node (pilot mode):
    the scheduler's own way (``srun`` with the job's options; a batch script submitted and
    waited for on PBS and LSF)."""
    account = site.account_for(account)
    return site.batch.allocate_line(site, line, walltime=walltime, account=account, queue=queue, nodes=nodes,
                                    run_dir=run_dir, argv=argv, ranks=ranks)


def job_spec(*, site: str | Site, command: Sequence[str], nodes: int | str, walltime: str, **options) -> JobSpec:
    """A :class:`JobSpec` from a site name and plain values (what ``hpcml job`` calls)."""
    return JobSpec(site=load_site(site), command=tuple(command), nodes=parse_nodes(nodes), walltime=walltime,
                   **options)
