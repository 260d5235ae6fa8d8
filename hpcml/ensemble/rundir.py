"""A run directory holds one campaign, claimed by every entry point before anything is read.

The :class:`~hpcml.ensemble.Campaign` and the Parsl apps (:mod:`hpcml.ensemble.apps`) both
call :func:`claim` first. It

- locks the directory for this driver process (an ``flock`` on the directory): a second
  driver in the same directory at the same time is refused, whichever entry point it uses;
- records the campaign on first use (``campaign_id.json``: an id and the definition's
  digest) and refuses a directory that holds another campaign -- or this one, unless the
  caller resumes it -- in one line, before anything else happens;
- names this execution of the driver (a new ``run`` id, listed in ``campaign_id.json``)
  and removes the protocol files an earlier run left (``endpoints.json``, the trainer's
  lease; ``sims_done.json`` once this run has simulations), which carry their run and
  could only mislead;
- records, for a resumed directory, the attempts an earlier driver left without a
  provenance line (it was killed while they ran).

A simulation's definition is kept beside its attempts (``sims/sim_N/spec.json``): the
same id with other parameters or another program is refused, so a workflow that submits
simulations one by one cannot mix two designs in one directory either.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcml import safeio
from hpcml.contract import DONE_FILE, ENDPOINTS_FILE, LEASE_FILE
from hpcml.ensemble import attempts
from hpcml.ensemble.driver_lease import DriverLease
from hpcml.ensemble.members import Specs
from hpcml.ensemble.spec import SimSpec, TrainingJob
from hpcml.errors import ConfigError
from hpcml.log import get_logger

logger = get_logger(__name__)

#: The campaign a run directory holds: its id and definition, written on first use.
IDENTITY_FILE = "campaign_id.json"
#: What a campaign leaves in its run directory; without an identity file, an older version's run.
STATE = ("campaign.json", "training.json", "provenance.jsonl", "sims_done.json", "metrics.jsonl", "checkpoints")
#: The parts of a simulation's definition hashed apart, so a refused resume names what changed.
PARTS = ("ids", "params", "argv")
PART_NAMES = {"ids": "simulation ids", "params": "parameters", "argv": "argv"}
#: The first simulation's definition is kept in the record up to this many characters of JSON.
FIRST_MAX = 2048
#: Written by one run for the other side; never read by another run (they carry their run id).
#: The done record is also the simulations' record of a training-only run's campaign: it stays
#: until a run with simulations starts (:func:`clear_done`).
PROTOCOL_FILES = (ENDPOINTS_FILE, LEASE_FILE)

_held: dict[Path, int] = {}  # run_dir -> the locked directory's descriptor, held by this process
_leases: dict[Path, DriverLease] = {}  # run_dir -> its driver lease, renewed by this process


@dataclass(frozen=True)
class Claim:
    """This driver's hold on a run directory."""

    run_dir: Path
    campaign: str
    """The campaign the directory holds (the same in every run of it)."""
    run: str
    """This run (new at every claim)."""
    held: bool
    """The directory held this campaign before this claim (the run continues it)."""


def definition(sims: Sequence[SimSpec], training: TrainingJob | None, adaptive: dict | None = None) -> dict[str, Any]:
    """What makes two runs one campaign: the simulations' ids, parameters and argv -- not
    rank counts, environments, Campaign settings or the training argv, which a resumed job
    may change (more steps: the trainer's resume rule, docs/parallel.md). Only the parts
    given (a training-only run defines no simulations); the training argv is recorded."""
    d: dict[str, Any] = {}
    h = hashlib.sha256(json.dumps(adaptive, sort_keys=True).encode() if adaptive is not None else b"")
    parts, first = {name: hashlib.sha256() for name in PARTS}, None  # each part apart: a refusal names what changed
    if len(sims):  # the text json.dumps would give the sorted [id, params, argv] list, hashed a spec at a time
        ordered = sims.definitions() if isinstance(sims, Specs) else (
            (s.sim_id, dict(s.params), list(s.argv)) for s in sorted(sims, key=lambda s: s.sim_id))
        argv, argv_text = None, ""
        for k, one in enumerate(ordered):
            try:
                if one[2] != argv:  # members share theirs ([]): written once
                    argv, argv_text = one[2], json.dumps(one[2], allow_nan=False)
                texts = [json.dumps(one[0]), json.dumps(one[1], sort_keys=True, allow_nan=False), argv_text]
            except (TypeError, ValueError) as e:  # a Members rule's parameters, met here first
                raise ConfigError(f"simulation {one[0]}: params {one[1]!r} must be finite JSON values ({e})") from None
            h.update((", " if k else "[").encode() + ("[" + ", ".join(texts) + "]").encode())
            for name, text in zip(PARTS, texts):
                parts[name].update(text.encode() + b"\n")
            if k == 0 and sum(map(len, texts)) <= FIRST_MAX:
                first = list(one)
        h.update(b"]")
    if len(sims) or adaptive is not None:  # waves: the plan defines them (each one's spec.json pins it), and the fixed
        d["simulations"] = {**({"adaptive": True} if adaptive is not None else {}), "digest": h.hexdigest()[:16],
                            "count": len(sims) + (adaptive.get("budget") if adaptive is not None else 0),
                            "parts": {name: p.hexdigest()[:16] for name, p in parts.items()},
                            **({"first": first} if first is not None else {})}
    if training is not None:
        d["training"] = {"argv": list(training.argv)}
    return d


def claim(run_dir: Path, sims: Sequence[SimSpec] = (), training: TrainingJob | None = None, *, resume: bool,
          entry: str = "campaign", adaptive: dict | None = None) -> Claim:
    """Claim ``run_dir`` for one run of a campaign (see the module docstring); ConfigError,
    before anything is written, for a directory in use, holding another campaign, or
    holding these parts of this one without ``resume``. Release with :func:`release`."""
    run_dir = Path(run_dir).resolve()
    where = f"run directory {run_dir}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror}; expected a directory, or a path where one can be made") from None
    _lock(run_dir)
    try:
        return _take(run_dir, sims, training, resume=resume, entry=entry, adaptive=adaptive)
    except BaseException:  # refused (another campaign, a tampered record): the directory is free again
        release(run_dir)
        raise


def _take(run_dir: Path, sims, training, *, resume: bool, entry: str, adaptive: dict | None) -> Claim:
    where = f"run directory {run_dir}"
    cid, held, rec = _identity(run_dir, sims, training, resume=resume, adaptive=adaptive)
    run = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    rec.setdefault("runs", []).append({"run": run, "entry": entry, "started": attempts.iso(time.time()),
                                       "host": socket.gethostname(), "pid": os.getpid()})
    del rec["runs"][:-100]  # the last hundred runs: a record, bounded
    safeio.write_json(run_dir / IDENTITY_FILE, rec)
    for name in PROTOCOL_FILES:  # an earlier run's: they carry its run id, but a reader should not even look
        (run_dir / name).unlink(missing_ok=True)
    if held:
        n = attempts.record_orphans(run_dir)
        if n:
            logger.warning("%s: %d attempt(s) of an earlier run ended without a provenance line (its driver was "
                           "killed while they ran): recorded now", where, n)
    return Claim(run_dir, cid, run, held)


def _identity(run_dir: Path, sims: Sequence[SimSpec], training: TrainingJob | None, *,
              resume: bool, adaptive: dict | None = None) -> tuple[str, bool, dict]:
    path, now = run_dir / IDENTITY_FILE, definition(sims, training, adaptive)
    where = f"run directory {run_dir}"
    try:
        rec = safeio.read_json(path, 1 << 20)
        if rec is not None and not isinstance(rec.get("campaign_id"), str):
            raise ConfigError(f"{path}: no campaign_id")
        if rec is not None and not isinstance(rec.get("simulations", {}), dict):
            raise ConfigError(f"{path}: simulations={str(rec['simulations'])[:40]}, expected an object")
    except ConfigError as e:
        raise ConfigError(f"{where}: {path.name} is unreadable ({e}); expected the campaign's id and definition: "
                          f"use a new directory") from None
    if rec is None:
        old = [n for n in STATE if (run_dir / n).exists()]
        if old and not resume:
            raise ConfigError(f"{where} holds an earlier campaign ({', '.join(old)}) with no {IDENTITY_FILE}: resume "
                              f"it (resume=True) or use a new directory")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:40] or "campaign"
        rec = {"campaign_id": f"{name}-{uuid.uuid4().hex[:8]}", "created": attempts.iso(time.time()), **now}
        if old:
            logger.warning("%s holds an earlier campaign (%s) with no %s: resuming it as campaign %s", where,
                           ", ".join(old), IDENTITY_FILE, rec["campaign_id"])
        return rec["campaign_id"], bool(old), rec
    cid, both = rec["campaign_id"], [k for k in now if k in rec]
    if (both or not now) and not resume:
        raise ConfigError(f"{where} holds campaign {cid} (started {rec.get('created', '?')}): resume it "
                          f"(resume=True) or use a new directory")
    if "simulations" in both and _defined(rec["simulations"]) != _defined(now["simulations"]):
        was, got = (f"{v['simulations']['count']} {'adaptive ' if v['simulations'].get('adaptive') else ''}"
                    f"simulations, digest {v['simulations']['digest']}" for v in (rec, now))
        raise ConfigError(f"{where} holds campaign {cid}, defined with other simulations ({was}; given {got})"
                          f"{_changed(rec['simulations'], now['simulations'])}: resume it unchanged or use a new "
                          f"directory")
    return cid, True, {**rec, **now}  # a new part, or the training job's latest argv (e.g. more --steps)


def _defined(sims: dict) -> tuple:
    """What must match for two runs to be one campaign (a record written before ``parts`` existed too)."""
    return sims.get("count"), sims.get("digest"), bool(sims.get("adaptive"))


def _changed(was: dict, got: dict) -> str:
    """Which parts of the simulations' definition differ, with the first simulation's old and new
    values where they differ there ("" for a record without parts)."""
    old = was.get("parts")
    if not isinstance(old, dict):
        return ""
    what = [name for name in PARTS if old.get(name) != got["parts"][name]]
    text = ": other " + " and ".join(PART_NAMES[name] for name in what) if what else ""
    a, b = was.get("first"), got.get("first")
    if text and isinstance(a, list) and len(a) == 3 and b is not None and a[0] == b[0]:
        for i, name in ((1, "params"), (2, "argv")):
            if name in what and a[i] != b[i]:
                return f"{text} (simulation {b[0]}'s {PART_NAMES[name]} {_short(a[i])}, now {_short(b[i])})"
    return text


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 160 else r[:157] + "..."


def _lock(run_dir: Path) -> None:
    """One driver per run directory at a time: an ``flock`` on the directory itself (no file
    is made, so a refused claim leaves the directory as it was). A second claim in this
    process is refused too, as one in another process (an apps workflow and a Campaign, or
    two threads, would each mint a run and delete the other's files)."""
    if run_dir in _held:
        raise ConfigError(f"run directory {run_dir} is claimed by this process already (a Campaign run or an apps "
                          f"workflow that has not ended): one driver per directory")
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        runs = (_read_identity(run_dir) or {}).get("runs") or [{}]
        holder = f"pid {runs[-1].get('pid', '?')} on {runs[-1].get('host', '?')}"
        raise ConfigError(f"run directory {run_dir} is in use by a running driver ({holder}): wait for it to end, "
                          f"or use a new directory") from None
    except OSError as e:  # a file system without flock (some NFS, Lustre mounted without it): the lease decides
        logger.info("run directory %s: no flock here (%s): its driver lease guards it", run_dir, e.strerror)
    lease = DriverLease(run_dir)  # also with flock: Lustre's localflock keeps a lock per node only
    try:
        lease.take()
    except BaseException:
        os.close(fd)
        raise
    _held[run_dir] = fd
    _leases[run_dir] = lease


def release(run_dir: Path) -> None:
    """Give up the claim of ``run_dir`` (the lock goes with it)."""
    lease = _leases.pop(Path(run_dir).resolve(), None)
    if lease is not None:
        lease.release()
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def _read_identity(run_dir: Path) -> dict | None:
    try:
        return safeio.read_json(run_dir / IDENTITY_FILE, 1 << 20)
    except ConfigError:
        return None


def clear_done(run_dir: Path) -> None:
    """A run with simulations starts: an earlier run's done record goes."""
    (Path(run_dir) / DONE_FILE).unlink(missing_ok=True)


def record_spec(run_dir: Path, spec: SimSpec) -> None:
    """Keep ``spec``'s definition beside its attempts; ConfigError if that simulation was
    defined otherwise before in this directory."""
    d = attempts.sim_dir(run_dir, spec.sim_id)
    d.mkdir(parents=True, exist_ok=True)
    now = {"sim_id": spec.sim_id, "params": dict(spec.params), "argv": list(spec.argv)}
    path = d / "spec.json"
    try:
        before = safeio.read_json(path, 1 << 20)
    except ConfigError:
        before = None
    if before is not None and {k: before.get(k) for k in now} != json.loads(json.dumps(now)):
        raise ConfigError(f"simulation {spec.sim_id} of run directory {run_dir} was defined with params "
                          f"{before.get('params')} and argv {before.get('argv')}, now {now['params']} and "
                          f"{now['argv']}: one id is one simulation; use another id or a new directory")
    if before is None:
        safeio.write_json(path, now)
