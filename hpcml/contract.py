"""What a campaign hands its training job and its simulations: one record, one module.

The driver -- :class:`hpcml.ensemble.Campaign`, or the Parsl apps of
:mod:`hpcml.ensemble.apps` in a workflow of one's own -- puts a :class:`Contract` into the
environment of the training job (:meth:`Contract.to_env`), and the attempt wrapper of
every simulation gets the part it needs. The other side reads it back with
:meth:`Contract.from_env`, which is what ``Producer.from_campaign``,
``StreamServer.from_campaign`` and ``OnlineConfig.from_campaign`` do: a trainer script
names no ``HPCML_*`` variable.

Identity. ``campaign`` is the campaign a run directory holds (``campaign_id.json``), the
same in every job that resumes it; ``run`` names one execution of the driver. The files the
two sides exchange through the run directory carry both -- ``endpoints.json`` (the
trainer's stream addresses), ``sims_done.json`` (the end of the campaign: which
simulations completed, failed, and how many samples each streamed) -- and a reader takes
only its own run's: a file an earlier run left behind is never read as this one's.

Exit codes of a training job, beside :data:`hpcml.env.NOT_FINISHED` (75, saved on a stop):
:data:`INCOMPLETE` (65) -- it trained, but samples of completed simulations never reached
it; :data:`CONFIG_ERROR` (78) -- a deterministic error (a model that does not fit the data):
neither is worth a relaunch. Imports nothing heavy.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hpcml import idset, safeio
from hpcml.errors import ConfigError, LaunchError
from hpcml.numeric import is_int

#: A training job that ran to its end but lacks samples its simulations sent (sysexits' EX_DATAERR).
INCOMPLETE = 65
#: A training job that failed on a deterministic error; relaunching it would fail the same way (EX_CONFIG).
CONFIG_ERROR = 78

#: Where each field of a :class:`Contract` travels: environment variables survive every launcher.
ENV: dict[str, str] = {
    "run_dir": "HPCML_RUN_DIR", "campaign": "HPCML_CAMPAIGN_ID", "run": "HPCML_RUN_ID", "resume": "HPCML_RESUME",
    "secret_file": "HPCML_STREAM_SECRET_FILE", "endpoints_file": "HPCML_STREAM_ENDPOINTS_FILE",
    "done_file": "HPCML_SIMS_DONE_FILE", "stream_host": "HPCML_STREAM_HOST",
    "stream_interface": "HPCML_STREAM_INTERFACE", "steps": "HPCML_TRAIN_STEPS", "batch": "HPCML_TRAIN_BATCH",
    "n_sims": "HPCML_N_SIMS", "deadline": "HPCML_JOB_DEADLINE", "driver_pid": "HPCML_DRIVER_PID",
    "driver_host": "HPCML_DRIVER_HOST", "launch": "HPCML_TRAINER_LAUNCH",
}
#: A simulation attempt's own variables (set by the attempt wrapper, not by the contract).
ENV_SIM_ID, ENV_ATTEMPT = "HPCML_SIM_ID", "HPCML_ATTEMPT"
#: Where rank 0 of a streaming simulation records what it sent (the attempt wrapper sets it).
ENV_STREAM_RECORD = "HPCML_STREAM_RECORD"

ENDPOINTS_FILE, DONE_FILE, SECRET_FILE, SUMMARY_FILE = ("endpoints.json", "sims_done.json", "stream.key",
                                                       "train_summary.json")
#: The trainer's per-simulation losses, counts and ages, replaced atomically at a cadence.
FEEDBACK_FILE = "feedback.json"
#: The training job's launch token, rewritten at each (re)launch: a job holding another is superseded.
LEASE_FILE = "trainer.lease"
#: A lease holds one launch token; anything larger is not the driver's.
MAX_LEASE_BYTES = 256
_INTS = ("steps", "batch", "n_sims", "driver_pid")
MAX_RECORD_BYTES = 64 << 20
"""A JSON file of the protocol larger than this is refused before parsing (a done record of
a million simulations is ~20 MB)."""


@dataclass(frozen=True, kw_only=True)
class Contract:
    """What the driver of a campaign hands its training job. ``repr()`` rebuilds it."""

    run_dir: str
    """The campaign's run directory: checkpoints, metrics, summaries, the protocol files."""
    campaign: str
    """The campaign's id: the same in every job of it; checkpoints of another are refused."""
    run: str = ""
    """This execution of the driver: protocol files of another run are stale."""
    resume: bool = False
    """Continue from the checkpoint in ``run_dir`` (a requeued job, a relaunch)."""
    secret_file: str | None = None
    """The stream's secret (``stream.key``, mode 0600); None: nothing streams."""
    endpoints_file: str | None = None
    """Where the trainer publishes its stream addresses; the simulations wait for it."""
    done_file: str | None = None
    """Where the driver writes the end of the campaign (:class:`DoneRecord`)."""
    stream_host: str | None = None
    """The address the trainer's stream servers bind (a high-speed interface's address)."""
    stream_interface: str | None = None
    """Or the interface whose address they bind (``hsn0``); neither: loopback."""
    steps: int | None = None
    """Gradient steps, when the driver sets them (``TrainingJob(steps=...)``); else the trainer's own."""
    batch: int | None = None
    """Samples per step and trainer rank, likewise."""
    n_sims: int | None = None
    deadline: float | None = None
    """Epoch seconds at which the walltime ends."""
    driver_pid: int | None = None
    """The driver's process: a trainer on its host exits once it is gone."""
    driver_host: str | None = None
    launch: str | None = None
    """This launch of the training job; ``run_dir/trainer.lease`` names the current one."""

    def __post_init__(self) -> None:
        if not self.run_dir or not self.campaign:
            raise ConfigError(f"Contract needs run_dir and campaign, got run_dir={self.run_dir!r}, "
                              f"campaign={self.campaign!r}")
        for name in ("steps", "batch", "n_sims"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < (0 if name == "n_sims" else 1)):
                raise ConfigError(f"Contract.{name}={v!r}: expected an integer >= {0 if name == 'n_sims' else 1}")

    # -- the two sides ------------------------------------------------------------------------
    def for_simulations(self) -> Contract:
        """The part a simulation gets: where it runs, its campaign and run, the stream (secret,
        endpoints) and the driver it outlives no longer; not the done record, resume, steps or batch."""
        return Contract(run_dir=self.run_dir, campaign=self.campaign, run=self.run, secret_file=self.secret_file,
                        endpoints_file=self.endpoints_file, driver_pid=self.driver_pid, driver_host=self.driver_host)

    def to_env(self) -> dict[str, str]:
        """The environment that carries it (fields that are None are left out)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            out[ENV[f.name]] = ("1" if v else "0") if isinstance(v, bool) else f"{v:.0f}" if f.name == "deadline" \
                else str(v)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Contract:
        """The contract the driver put in the environment; ConfigError, in one line naming the
        variable, when there is none (this process was not started by a campaign) or a value is bad."""
        environ = os.environ if environ is None else environ
        missing = [ENV[k] for k in ("run_dir", "campaign") if not environ.get(ENV[k])]
        if missing:
            raise ConfigError(f"{' and '.join(missing)} not set: this process was not started by a campaign "
                              f"(hpcml.ensemble.Campaign or hpcml.ensemble.apps set them)")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV[f.name])
            if raw is None or raw == "":
                continue
            if f.name == "resume":
                if raw not in ("0", "1"):
                    raise ConfigError(f"{ENV['resume']}={raw!r}: expected 0 or 1")
                kw[f.name] = raw == "1"
            elif f.name in _INTS or f.name == "deadline":
                try:
                    kw[f.name] = int(raw) if f.name in _INTS else float(raw)
                except ValueError:
                    raise ConfigError(f"{ENV[f.name]}={raw!r}: expected a number") from None
            else:
                kw[f.name] = raw
        return cls(**kw)

    def replace(self, **changes: Any) -> Contract:
        return Contract(**{**asdict(self), **changes})

    # -- places ---------------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return Path(self.run_dir) / "checkpoints"

    @property
    def feedback_file(self) -> Path:
        """The trainer's per-simulation statistics for the driver's sampler (:mod:`hpcml.train.feedback`)."""
        return Path(self.run_dir) / FEEDBACK_FILE

    @property
    def summary_file(self) -> Path:
        """The training job's summary: counts of the whole campaign (every job of it)."""
        return Path(self.run_dir) / SUMMARY_FILE

    @property
    def streams(self) -> bool:
        return self.secret_file is not None and self.endpoints_file is not None

    def stale(self, record: Mapping[str, Any]) -> str | None:
        """Why a protocol record (endpoints, done) is not this run's, or None."""
        got = (record.get("campaign"), record.get("run", ""))
        if got != (self.campaign, self.run):
            return f"it belongs to campaign {got[0]!r} run {got[1]!r}, not {self.campaign!r} run {self.run!r}"
        return None

    # -- liveness -------------------------------------------------------------------------------
    def driver_gone(self) -> bool:
        """The driver ran on this host and has exited (a zombie counts as gone); False
        where it cannot be told (another host, no pid)."""
        if self.driver_pid is None or self.driver_host != socket.gethostname():
            return False
        try:
            state = Path(f"/proc/{self.driver_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state == "Z"

    def superseded(self) -> bool:
        """Another launch of the training job holds the run directory's lease: this one must go."""
        if self.launch is None:
            return False
        try:
            holder = safeio.read_text(Path(self.run_dir) / LEASE_FILE, MAX_LEASE_BYTES, "a launch token")
        except (OSError, ConfigError):  # not this job's to judge: the driver's lease is a token, not a link or FIFO
            return False
        return bool(holder) and holder.strip() != self.launch


# --- the protocol's files ------------------------------------------------------------------------

def write_endpoints(path: str | os.PathLike, campaign: str, endpoints: list[str], run: str = "",
                    closed: str | None = None, max_connections: int | None = None) -> None:
    """Publish the trainer ranks' stream addresses (index = trainer rank) for ``campaign`` and
    ``run``, with the producer connections each rank holds at most; or, ``closed``, why a
    trainer that failed before it listened never will: the simulations waiting for it fail at
    once with that reason instead of after their wait."""
    rec = {"campaign": campaign, "run": run, "endpoints": list(endpoints), "time": time.time(),
           **({"max_connections": int(max_connections)} if max_connections else {})}
    safeio.write_json(path, {**rec, "closed": closed} if closed else rec)


def connections_needed(path: str | os.PathLike, max_concurrent: int, ranks: int,
                       contract: Contract | None = None) -> None:
    """ConfigError, naming the limit, when ``max_concurrent`` simulations of up to ``ranks``
    ranks streaming at once would need more connections of one trainer rank than it holds
    (``endpoints.json``'s ``max_connections``; nothing to check when it does not say)."""
    rec = safeio.read_json(path, MAX_RECORD_BYTES)
    if not rec or (contract is not None and contract.stale(rec) is not None):
        return
    cap, n = rec.get("max_connections"), len(rec.get("endpoints") or [])
    if not is_int(cap) or not n:
        return
    need = -(-max_concurrent * ranks // n)
    if need > cap:
        raise ConfigError(f"max_concurrent={max_concurrent} simulations of {ranks} ranks stream over {need} "
                          f"connections per trainer rank, but each of the {n} trainer rank(s) holds at most {cap} "
                          f"(its open-file limit less 128 kept for files and its pending connections): raise "
                          f"'ulimit -n' in the job script, add trainer ranks, or set max_concurrent <= "
                          f"{max(1, cap * n // ranks)}")


def read_endpoints(path: str | os.PathLike, timeout_s: float = 0.0, *, contract: Contract | None = None
                   ) -> tuple[str, list[str]]:
    """(campaign id, endpoints), waiting up to ``timeout_s`` for the file to appear -- with a
    ``contract``, for a file of its campaign and run (an earlier run's is waited past)."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    stale = None
    while True:
        rec = safeio.read_json(path, MAX_RECORD_BYTES)
        if rec is not None:
            stale = contract.stale(rec) if contract is not None else None
            if stale is None and rec.get("closed"):
                raise LaunchError(f"the training job of this run failed before it took a stream: {rec['closed']}"[:600])
            if stale is None:
                break
        if time.monotonic() >= deadline:
            if stale is not None:
                raise LaunchError(f"stream endpoints file {path} is an earlier run's ({stale}) and this run's trainer "
                                  f"did not publish its own within {timeout_s:g} s (is the training job up?)")
            raise LaunchError(f"stream endpoints file {path} does not exist (is the training job up?)")
        time.sleep(0.1)
    try:
        campaign, endpoints = str(rec["campaign"]), [str(e) for e in rec["endpoints"]]
    except (KeyError, TypeError) as e:
        raise ConfigError(f"stream endpoints file {path} is malformed: {e}") from None
    if not endpoints:
        raise ConfigError(f"stream endpoints file {path} lists no endpoints")
    bad = [e for e in endpoints if not _ENDPOINT.fullmatch(e)]
    if bad:
        raise ConfigError(f"stream endpoints file {path} lists {bad[0][:80]!r}: expected tcp://HOST:PORT (or "
                          f"zmtp+tcp://HOST:PORT) addresses")
    return campaign, endpoints


_ENDPOINT = re.compile(r"(?:zmtp\+)?tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}")


@dataclass(frozen=True, kw_only=True)
class DoneRecord:
    """The end of a campaign, as its driver writes it when no simulation is left."""

    completed: list[int]
    failed: list[int]
    streamed: dict[int, int] | None = None
    """Samples each completed streaming simulation sent (its Producer's count); simulations
    not in it stream nothing (e.g. held-out ones writing files). None: not known -- every
    completed simulation is waited for until its end markers are in."""
    silent: list[int] = field(default_factory=list)
    """Completed simulations that should have streamed and closed no Producer: run without
    their stream; nothing is waited for from them, and the training fails naming them."""
    campaign: str = ""
    run: str = ""

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # id sets stay sets: written in chunks
        if self.streamed is not None:
            d["streamed"] = {str(k): v for k, v in sorted(self.streamed.items())}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> DoneRecord:
        try:
            completed, failed = [_sim_id(x) for x in d["completed"]], [_sim_id(x) for x in d["failed"]]
            streamed = d.get("streamed")
            if streamed is not None:
                streamed = {_sim_id(int(k)): _count(v) for k, v in streamed.items()}
            silent = [_sim_id(x) for x in d.get("silent", [])]
            return cls(completed=completed, failed=failed, streamed=streamed, silent=silent,
                       campaign=str(d.get("campaign", "")), run=str(d.get("run", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: malformed done record ({type(e).__name__}: {e}); expected completed, failed "
                              f"(simulation ids) and streamed (id -> samples)") from None


def _sim_id(x: Any) -> int:
    if not is_int(x) or not 0 <= x <= 2**53 - 1:
        raise ValueError(f"simulation id {x!r}")
    return x


def _count(x: Any) -> int:
    if not is_int(x) or not 0 <= x <= 2**53 - 1:
        raise ValueError(f"sample count {x!r}")
    return x


def write_done(path: str | os.PathLike, record: DoneRecord) -> None:
    """Atomically and a chunk at a time: 10^5 ids are written, never built as one text."""
    safeio.replace(path, idset.dump(record.to_json()))


def read_done(path: str | os.PathLike, contract: Contract | None = None) -> DoneRecord | None:
    """The done record at ``path`` if it is there and (with a ``contract``) of this run; a
    stale one reads as None. ConfigError for a malformed one."""
    rec = safeio.read_json(path, MAX_RECORD_BYTES)
    if rec is None or (contract is not None and contract.stale(rec) is not None):
        return None
    return DoneRecord.from_json(rec, str(path))


__all__ = ["CONFIG_ERROR", "Contract", "DoneRecord", "ENV", "INCOMPLETE", "read_done", "read_endpoints",
           "write_done", "write_endpoints"]
