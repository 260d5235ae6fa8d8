"""A facility's rules as data: queues and their limits, the account rule, and every module or
environment line a site adds to its jobs, each with the reason and the page it comes from.

Queue tables change (Aurora's did in 2025), so they are rows with a source URL and the date
it was read, not branches in code. :func:`pick_queue` chooses a row from nodes AND walltime,
and a user's ``--queue`` is checked against the same rows. Pure data: no Parsl, no I/O.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcml.ensemble.checks import walltime_seconds
from hpcml.errors import ConfigError
from hpcml.numeric import is_int

__all__ = ["ACCOUNT_ENV", "Account", "EnvVar", "Fact", "Queue", "Source", "account_for", "pick_queue"]

#: Environment variable read when no account is given (``hpcml job``, a Campaign's blocks).
ACCOUNT_ENV = "HPCML_ACCOUNT"

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_KINDS = ("partition", "qos", "queue")


@dataclass(frozen=True, kw_only=True)
class Source:
    """Where a fact comes from: the facility page and the date it was read."""

    url: str
    read: str
    """YYYY-MM-DD the page was read (or its last-updated date, when it shows one)."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not re.fullmatch(r"https?://\S+|[\w.-]+(/[\w.-]+)*", self.url):
            raise ConfigError(f"source url={self.url!r} must be an http(s) URL or a file of this repository")
        if not isinstance(self.read, str) or not _DATE.fullmatch(self.read):
            raise ConfigError(f"source read={self.read!r} must be a date YYYY-MM-DD")

    def __str__(self) -> str:
        return f"{self.url} (read {self.read})"


def _check_reason(what: str, why: object, source: object) -> None:
    if not isinstance(why, str) or not why.strip() or "\n" in why:
        raise ConfigError(f"{what}: why={why!r} must be one line saying why")
    if source is not None and not isinstance(source, Source):
        raise ConfigError(f"{what}: source={source!r} must be a Source or None (hpcml's own choice)")


@dataclass(frozen=True, kw_only=True)
class Fact:
    """Lines of a job script (a directive, ``module load ...``, a block of the run) with the
    reason for them and their source (None: hpcml's own choice). ``hpcml job --explain`` prints them."""

    text: str
    why: str
    source: Source | None = None
    unverified: str = ""
    """Not on the facility's pages where it was looked for: how to check it on the first login
    (``module avail nccl``). The script then runs the line as a try that warns in one line
    when it fails, and ``hpcml job --explain`` says what to check -- never a guess stated as fact."""

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise ConfigError(f"script line={self.text!r} must be non-empty")
        _check_reason(f"script line {self.text.splitlines()[0]!r}", self.why, self.source)
        if not isinstance(self.unverified, str) or "\n" in self.unverified or \
                (self.unverified and "\n" in self.text.strip()):
            raise ConfigError(f"script line {self.text!r}: unverified={self.unverified!r} must be one line saying "
                              f"how to check it, on a one-line fact")

    @property
    def script(self) -> str:
        """The line as the script runs it: an unverified one tried, with a warning when it fails."""
        if not self.unverified:
            return self.text
        note = f"hpcml-job: {self.text} failed, a line not on the facility pages: {self.unverified}"
        return f"{self.text} || echo {shlex.quote(note)} >&2"


@dataclass(frozen=True, kw_only=True)
class EnvVar:
    """An environment variable of every job and worker, with its reason."""

    name: str
    value: str
    why: str
    source: Source | None = None
    training_only: bool = False
    """Set for the collective library (NCCL, RCCL, oneCCL and their libfabric plugin): an MPI
    simulation is launched without it (``env -u NAME``), so its MPI keeps the site's defaults."""

    @property
    def line(self) -> str:
        """``export NAME=value``, the value shell-quoted."""
        return f"export {self.name}={shlex.quote(self.value)}"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise ConfigError(f"environment variable name={self.name!r} must be a shell identifier")
        if not isinstance(self.value, str):
            raise ConfigError(f"{self.name}={self.value!r} must be a string")
        _check_reason(f"variable {self.name}", self.why, self.source)


@dataclass(frozen=True, kw_only=True)
class Queue:
    """One row of a facility's queue table: a queue, partition or QOS over a range of nodes.

    A name may have several rows (Frontier's ``batch`` partition has a walltime per node bin).
    """

    name: str
    kind: str = "queue"
    """What the name selects: ``partition`` or ``qos`` on Slurm, ``queue`` on PBS and LSF."""
    min_nodes: int = 1
    max_nodes: int | None = None
    """None: no limit below the machine's size."""
    max_walltime: str
    """HH:MM:SS."""
    min_walltime: str = "00:00:00"
    """The shortest job the queue takes (ALCF's queues: 5 minutes)."""
    max_running: int | None = None
    """Jobs one user may have running in it at once (None: no such limit)."""
    max_queued: int | None = None
    """Jobs one user may have in it at once, running ones included (ALCF's "running/accruing/
    queued", NERSC's "submitted"; Frontier's "1 running and 1 eligible" is 2). None: no limit."""
    requeue: bool = True
    """A job may requeue or resubmit itself from inside (False where ``max_queued`` is 1: the
    running job holds the one place, so its successor is refused)."""
    auto: bool = True
    """Chosen by :func:`pick_queue` when no queue is named; False: only on request (``--queue``)."""
    note: str = ""
    source: Source

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[\w.-]+", self.name):
            raise ConfigError(f"queue name={self.name!r} must be a word")
        if self.kind not in _KINDS:
            raise ConfigError(f"queue {self.name}: kind={self.kind!r} must be one of {', '.join(_KINDS)}")
        if not is_int(self.min_nodes) or self.min_nodes < 1:
            raise ConfigError(f"queue {self.name}: min_nodes={self.min_nodes!r} must be an integer >= 1")
        if self.max_nodes is not None and (not is_int(self.max_nodes)
                                           or self.max_nodes < self.min_nodes):
            raise ConfigError(f"queue {self.name}: max_nodes={self.max_nodes!r} must be an integer >= "
                              f"min_nodes={self.min_nodes} or None")
        try:
            walltime_seconds(self.max_walltime)
        except ConfigError as e:
            raise ConfigError(f"queue {self.name}: max_{e}") from None
        try:
            low = walltime_seconds(self.min_walltime) if self.min_walltime != "00:00:00" else 0
        except ConfigError as e:
            raise ConfigError(f"queue {self.name}: min_{e}") from None
        if low > self.max_walltime_s:
            raise ConfigError(f"queue {self.name}: min_walltime={self.min_walltime} is over max_walltime="
                              f"{self.max_walltime}")
        for key in ("max_running", "max_queued"):
            v = getattr(self, key)
            if v is not None and (not is_int(v) or v < 1):
                raise ConfigError(f"queue {self.name}: {key}={v!r} must be an integer >= 1 or None")
        if self.max_running is not None and self.max_queued is not None and self.max_running > self.max_queued:
            raise ConfigError(f"queue {self.name}: max_running={self.max_running} is over max_queued="
                              f"{self.max_queued} (queued counts the running jobs too)")
        if self.max_queued == 1 and self.requeue:
            raise ConfigError(f"queue {self.name}: max_queued=1 leaves no place for a resubmitted job: requeue=False")
        if not isinstance(self.source, Source):
            raise ConfigError(f"queue {self.name}: source={self.source!r} must be a Source")

    @property
    def max_walltime_s(self) -> int:
        return walltime_seconds(self.max_walltime)

    @property
    def min_walltime_s(self) -> int:
        return 0 if self.min_walltime == "00:00:00" else walltime_seconds(self.min_walltime)

    def fits(self, nodes: int, walltime_s: int) -> bool:
        return (self.min_nodes <= nodes and (self.max_nodes is None or nodes <= self.max_nodes)
                and self.min_walltime_s <= walltime_s <= self.max_walltime_s)

    def per_user(self) -> str:
        """``1 running, 2 queued or running per user`` (empty: no per-user limit)."""
        parts = ([f"{self.max_running} running"] if self.max_running else []) + \
            ([f"{self.max_queued} queued or running"] if self.max_queued else [])
        return ", ".join(parts) + " per user" if parts else ""

    def limits(self) -> str:
        """``debug: 1-2 nodes, 00:05:00-01:00:00, 1 queued or running per user``: the row in words."""
        top = "" if self.max_nodes == self.min_nodes else f"-{self.max_nodes}" if self.max_nodes else "+"
        time = f"{self.min_walltime}-{self.max_walltime}" if self.min_walltime_s else f"<= {self.max_walltime}"
        jobs = f", {self.per_user()}" if self.per_user() else ""
        return f"{self.name}: {self.min_nodes}{top} nodes, {time}{jobs}"


@dataclass(frozen=True, kw_only=True)
class Account:
    """Whether jobs must name the allocation they charge, and the facility's words for it."""

    required: bool
    why: str
    source: Source | None = None

    def __post_init__(self) -> None:
        _check_reason("account rule", self.why, self.source)


def pick_queue(site: str, queues: Sequence[Queue], nodes: int, walltime: str, queue: str | None = None) -> Queue | None:
    """The row a job of ``nodes`` for ``walltime`` goes to: ``queue``'s if named, else the
    first automatic one that fits. None when the site has no table (the scheduler's default).

    A named queue that is not in the table is taken as the user's (their site's rules may be
    newer), unchecked; one that is, but does not fit, is refused naming its limits.
    """
    if not queues:
        return None
    seconds = walltime_seconds(walltime)
    rows = [q for q in queues if q.name == queue] if queue is not None else [q for q in queues if q.auto]
    if queue is not None and not rows:
        return None
    for row in rows:
        if row.fits(nodes, seconds):
            return row
    table = "; ".join(q.limits() for q in rows)
    holding = [q for q in rows if q.fits(nodes, q.min_walltime_s)]
    if holding and seconds < min(q.min_walltime_s for q in holding):
        hint = f"at least {_clock(min(q.min_walltime_s for q in holding))} for {nodes} node(s)"
    elif holding:
        hint = f"at most {_clock(max(q.max_walltime_s for q in holding))} for {nodes} node(s)"
    else:
        hint = f"no row holds {nodes} node(s)"
    asked = f"queue {queue} of {site} does not take" if queue else f"no queue of {site} takes"
    raise ConfigError(f"{asked} {nodes} node(s) for {walltime}: {hint} ({table}; source {rows[0].source.url})")


def _clock(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def account_for(site: str, rule: Account | None, account: str | None,
                environ: Mapping[str, str] | None = None) -> str | None:
    """``account``, else ``$HPCML_ACCOUNT``; a site that requires one and gets none refuses in one line."""
    environ = os.environ if environ is None else environ
    if account is None:
        account = environ.get(ACCOUNT_ENV, "").strip() or None
    if account is not None and (not re.fullmatch(r"[\w.-]+", account)):
        raise ConfigError(f"account={account!r} must be a project name (letters, digits, '_', '.', '-')")
    if account is None and rule is not None and rule.required:
        where = f" ({rule.source.url})" if rule.source else ""
        raise ConfigError(f"site {site} requires an account: pass --account PROJECT or set {ACCOUNT_ENV} "
                          f"({rule.why}){where}")
    return account
