"""What a campaign runs and what it reports: plain, validated records shared by the
Campaign and the Parsl apps (:mod:`hpcml.ensemble.apps`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcml.errors import ConfigError
from hpcml.numeric import is_int


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    """One simulation: ``argv`` is the program without the MPI prefix; the Campaign appends
    ``--sim-id N --params-json '{...}'``."""

    sim_id: int
    params: dict[str, float]
    argv: list[str] = field(default_factory=list)
    entry: str | None = None
    """Instead of ``argv``: ``package.module:function``, called in-process as
    ``function(sim_id=, params=, attempt=)`` by a bundle of members
    (``Campaign(bundle=N)``, :mod:`hpcml.ensemble.bundle`); one rank."""
    ranks: int = 2
    stream: bool | None = None
    """Whether it streams to the campaign's training job. None: when the training job takes
    a stream. False: it writes files (e.g. held-out simulations), and the trainer does not
    wait for its samples. A streaming simulation that completes without having streamed
    (no Producer: run without its stream flag) fails the campaign at once, naming it."""
    identity_args: bool = True
    """Append ``--sim-id N --params-json '{...}'`` to ``argv``. False: a program that takes
    its parameters in ``argv`` already (a search's trial, :mod:`hpcml.ensemble.search`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.identity_args, bool):
            raise ConfigError(f"sim {self.sim_id}: identity_args must be True or False, got {self.identity_args!r}")
        if self.stream is not None and not isinstance(self.stream, bool):
            raise ConfigError(f"sim {self.sim_id}: stream must be True, False or None, got {self.stream!r}")
        if not is_int(self.sim_id) or self.sim_id < 0:
            raise ConfigError(f"sim_id must be an int >= 0, got {self.sim_id!r}")
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"sim {self.sim_id}: ranks must be an int >= 1, got {self.ranks!r}")
        if self.entry is not None:
            mod, _, fn = str(self.entry).partition(":")
            if not isinstance(self.entry, str) or not mod or not fn.isidentifier() or self.argv:
                raise ConfigError(f"sim {self.sim_id}: entry={self.entry!r}: expected 'package.module:function' and no "
                                  f"argv (argv={self.argv!r})")
        elif isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"sim {self.sim_id}: argv must be a non-empty list of strings, got {self.argv!r}")
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"sim {self.sim_id}: params must be a dict, got {self.params!r}")
        try:
            json.dumps(dict(self.params), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sim {self.sim_id}: params must be finite JSON values ({e})") from None

    def command(self) -> list[str]:
        """The full program argv (still without the MPI prefix); an entry's: the entry."""
        if self.entry is not None:
            return [f"entry:{self.entry}"]
        if not self.identity_args:
            return list(self.argv)
        return [*self.argv, "--sim-id", str(self.sim_id), "--params-json", json.dumps(dict(self.params))]


@dataclass(frozen=True, kw_only=True)
class TrainingJob:
    """The MPI training job launched alongside the simulations."""

    argv: list[str]
    ranks: int | None = None
    """Training ranks; None: one per device of ``nodes`` (the site's ``train_ranks_per_node``)."""
    nodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    """Relaunch a training job that exits non-zero (a node died) this many times; it resumes
    from its checkpoint and its stream servers rebind the same addresses, so the simulations,
    which keep running, reconnect."""
    restart_argv: list[str] | None = None
    """The argv of a relaunch (default: ``argv``); a relaunch also gets ``HPCML_RESUME=1``."""
    stream: bool | None = None
    """Whether the simulations of the same ``run()`` stream into it, each to one rank
    (``hpcml.stream.route``): then every rank needs a simulation, which ``run()`` checks
    before anything starts, and the campaign makes the stream's secret and publishes its
    endpoints (the contract, :mod:`hpcml.contract`). None: streaming only when ``run()`` is
    given a ``ready_file``; False: it reads files (offline). A simulation whose training job
    takes no stream and that makes a Producer fails at once, not retried, naming this."""
    steps: int | None = None
    """Gradient steps, handed to the trainer in the contract (None: the trainer's own)."""
    batch: int | None = None
    """Samples per step and trainer rank, likewise."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ConfigError(f"training {name} must be an int >= 1 or None, got {v!r}")
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"training argv must be a non-empty list of strings, got {self.argv!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"training max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.stream is not None and not isinstance(self.stream, bool):
            raise ConfigError(f"training stream must be True, False or None, got {self.stream!r}")
        for name in ("ranks", "nodes"):
            value = getattr(self, name)
            if (value is not None or name == "nodes") and (not is_int(value)
                                                           or value < 1):
                raise ConfigError(f"training {name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class CampaignResult:
    """What a finished campaign did; also written to ``run_dir/campaign.json``."""

    run_dir: str
    total: int
    completed: list[int]
    failed: list[int]
    cancelled: list[int]
    attempts: dict[int, int]
    """Attempts made in this run, per simulation."""
    retried: list[int]
    samples_sent: int
    """Sum of samples_sent over the successful attempts."""
    wall_s: float
    parsl_load_s: float
    task_overhead_s: float | None
    """Median over simulations of (time in Parsl) minus (time running attempts)."""
    training_returncode: int | None
    error: str | None = None
    skipped: list[int] = field(default_factory=list)
    """Completed by an earlier run of this campaign in the same run directory (``resume``): not run again."""
    interrupted: bool = False
    """Stopped by the walltime warning (SIGUSR1/SIGTERM) after saving: run it again with ``resume``."""
    campaign_id: str | None = None
    """The campaign the run directory holds (``campaign_id.json``); the trainer's ``HPCML_CAMPAIGN_ID``."""
    run_id: str | None = None
    """This run of the campaign (the trainer's ``HPCML_RUN_ID``)."""
    samples: dict | None = None
    """The training job's exactly-once accounting, over every job of the campaign (its
    ``train_summary.json`` of this run): ``expected`` (what the completed simulations
    streamed), ``ingested``, ``missing``, ``duplicates``, ``untrained`` (never in a batch);
    None without a streaming trainer that reported."""

    @property
    def ok(self) -> bool:
        return (not self.failed and not self.cancelled and self.error is None and not self.interrupted
                and self.training_returncode in (None, 0) and not (self.samples or {}).get("missing"))

    @property
    def status(self) -> str:
        """``ok``, ``interrupted`` (resume it) or ``failed``."""
        return "ok" if self.ok else "interrupted" if self.interrupted and self.error is None else "failed"


def streaming(training: TrainingJob | None, ready_file) -> bool:
    """Whether the training job takes the simulations' stream: ``stream=True``, or (None) when
    ``run()`` waits for a ready file (the endpoints the trainer publishes)."""
    return training is not None and (training.stream if training.stream is not None else ready_file is not None)
