"""Many small simulations in one process: a bundle runs its members one after another, in-process.

At 10^5 ensemble members a process launch, a Parsl task and six files per member cost more
than the members (``benchmarks/campaign_scale.py``: 3.1 ms of driver CPU and 6 files a
simulation). A bundle is one task that imports the user's entry point once and calls it
for each member::

    python -m hpcml.ensemble.bundle BUNDLE_DIR

``BUNDLE_DIR/bundle.json`` (written by the driver): ``{"entry": "pkg.module:function",
"retries": R, "members": [{"sim_id": 7, "params": {...}, "first_attempt": 0}, ...]}``. The function is called
as ``function(sim_id=..., params=..., attempt=...)`` and returns a JSON object (its result)
or None; it may stream through ``Producer.from_campaign(comm=MPI.COMM_SELF, ...)``, which
finds its simulation id, attempt and stream record in the environment as a launched
simulation does. Each member keeps what a simulation of its own has:

- **its id and attempts**: a member's attempt numbers are ``first + k x (R + 1) + r`` for
  the first number the driver gives it (past its attempts of earlier runs), the bundle's
  attempt ``k`` (claimed by the attempt wrapper, ``HPCML_ATTEMPT``) and its own retry
  ``r``, so they grow across retries of the member and of the bundle and are never used
  twice, as the stream's exactly-once rules need;
- **its retries**: an exception is retried up to ``R`` times in-process, except a
  deterministic one (a ConfigError, or a final record its producer wrote): never retried;
  nor after two attempts in a row on the same exception of its own (:func:`hpcml.outcome.raised`);
- **its record**: one JSON line per ended attempt in ``BUNDLE_DIR/members.jsonl`` (status
  ``ok``, ``failed`` or ``final``, result, error, times, samples streamed), written and
  flushed as it ends -- no directory or file of its own;
- **exactly once**: a bundle run again (its task retried after a node died) skips the
  members that already ended ``ok`` or ``final``.

The bundle exits 0 once every member has ended (failed members are the driver's to count),
and prints ``HPCML_SIM_RESULT`` with the counts.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hpcml import safeio
from hpcml.contract import ENV_ATTEMPT, ENV_SIM_ID, ENV_STREAM_RECORD
from hpcml.outcome import FINAL_SUFFIX, raised, repeated
from hpcml.errors import ConfigError

SPEC_FILE = "bundle.json"
RECORDS_FILE = "members.jsonl"
#: The largest ``bundle.json`` read (10^4 members of a few parameters fit well inside).
MAX_SPEC_BYTES = 64 << 20
#: The largest ``members.jsonl`` read on a rerun.
MAX_RECORDS_BYTES = 256 << 20


def load_entry(entry: str) -> Callable:
    """The function ``pkg.module:function`` names; ConfigError naming it if it is not one."""
    mod, _, name = entry.partition(":")
    if not mod or not name.isidentifier():
        raise ConfigError(f"bundle entry {entry!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"bundle entry {entry!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"bundle entry {entry!r} is not callable")
    return fn


def write_spec(bundle_dir: Path, entry: str, members: list[dict], retries: int) -> None:
    """The driver's side: what the bundle runs (atomically: the task may start at once)."""
    bundle_dir.mkdir(parents=True, exist_ok=True)
    safeio.replace(bundle_dir / SPEC_FILE, json.dumps({"entry": entry, "retries": retries, "members": members},
                                                      separators=(",", ":")))


def read_records(bundle_dir: Path, *, root: Path | None = None) -> list[dict]:
    """Every member attempt's record so far (a line cut by a crash is skipped); ``root``: the
    run directory, below which no link is followed."""
    data = safeio.read_bytes(Path(bundle_dir) / RECORDS_FILE, MAX_RECORDS_BYTES, "the bundle's member records",
                             root=root)
    out = []
    for line in (data or b"").decode(errors="replace").splitlines():
        try:
            rec = safeio.parse_json(line, RECORDS_FILE, max_depth=16)
        except ConfigError:
            continue
        if (isinstance(rec, dict) and type(rec.get("sim_id")) is int and type(rec.get("attempt")) is int
                and 0 <= rec["sim_id"] < 1 << 53 and 0 <= rec["attempt"] < 1 << 31
                and rec.get("status") in ("ok", "failed", "final")):  # others' writes are input: checked
            out.append(rec)
    return out


def provenance_row(rec: dict, entry: str, launch: str, bundle_name: str) -> dict:
    """A member attempt's record as the campaign's provenance line (the fields a launched
    simulation's line has; ``status`` ok or failed, the cause in ``error``)."""
    return {"sim_id": rec["sim_id"], "attempt": rec.get("attempt"), "params": rec.get("params"),
            "status": "ok" if rec.get("status") == "ok" else "failed", "returncode": None, "signal": None,
            "samples_sent": (rec.get("result") or {}).get("samples_sent") if isinstance(rec.get("result"), dict)
            else None, "result": rec.get("result"), "streamed": rec.get("streamed"), "start": rec.get("start"),
            "end": rec.get("end"), "duration_s": rec.get("duration_s"), "host": None, "launch": launch,
            "argv": [f"entry:{entry}"], "error": rec.get("error"), "bundle": bundle_name}


def orphan_rows(run_dir: Path, recorded: set) -> list[dict]:
    """Provenance lines for member attempts that bundles of earlier runs recorded but no driver
    folded in (it was killed while they ran): a resume then neither runs them again nor
    reuses their attempt numbers."""
    rows = []
    for d in sorted((Path(run_dir) / "sims").glob("bundle_*")):
        if d.is_symlink() or not d.is_dir():  # not a bundle this campaign made: nothing of it is read
            continue
        try:
            entry = _read_spec(d, root=run_dir)["entry"]
        except ConfigError:
            continue
        for rec in read_records(d, root=run_dir):
            if (rec["sim_id"], rec.get("attempt")) not in recorded:
                rows.append(provenance_row(rec, entry, "", d.name))
                recorded.add((rec["sim_id"], rec.get("attempt")))
    return rows


def _read_spec(bundle_dir: Path, *, root: Path | None = None) -> dict:
    data = safeio.read_bytes(bundle_dir / SPEC_FILE, MAX_SPEC_BYTES, "a bundle's members (JSON)", root=root)
    if data is None:
        raise ConfigError(f"bundle {bundle_dir}: no {SPEC_FILE}")
    try:
        spec = safeio.parse_json(data, f"bundle {bundle_dir}/{SPEC_FILE}", max_depth=8)
        members = [(int(m["sim_id"]), dict(m["params"]), int(m.get("first_attempt", 0))) for m in spec["members"]]
        retries = int(spec.get("retries", 0))
        entry = str(spec["entry"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"bundle {bundle_dir}/{SPEC_FILE}: {type(e).__name__}: {e}; expected entry, retries and "
                          f"members of sim_id and params") from None
    return {"entry": entry, "retries": max(0, retries), "members": members}


def run_bundle(bundle_dir: str | os.PathLike, *, bundle_attempt: int = 0) -> dict[str, int]:
    """Run every member of the bundle in ``bundle_dir`` not ended before; the counts by status."""
    bundle_dir = Path(bundle_dir)
    spec = _read_spec(bundle_dir)
    fn = load_entry(spec["entry"])
    tries = spec["retries"] + 1
    records = read_records(bundle_dir)
    ended = {r["sim_id"] for r in records if r.get("status") in ("ok", "final")}
    seen: dict[int, list[str | None]] = {}  # each member's attempts so far: the exception a failed one raised
    for r in records:
        seen.setdefault(r["sim_id"], []).append(_raised(r))
    counts = {"ok": 0, "failed": 0, "final": 0, "skipped": len({m[0] for m in spec["members"]} & ended)}
    saved = {k: os.environ.get(k) for k in (ENV_SIM_ID, ENV_ATTEMPT, ENV_STREAM_RECORD)}
    fd = safeio.open_fd(bundle_dir / RECORDS_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a") as log:
        log.write(safeio.ends_torn(fd).decode())  # a record torn by a killed bundle stays a line of its own
        try:
            for sim_id, params, first in spec["members"]:
                if sim_id in ended:
                    continue
                past = seen.setdefault(sim_id, [])
                status = "failed" if _alike(sim_id, past) else None
                for r in range(tries if status is None else 0):
                    rec = _attempt(fn, bundle_dir, sim_id, params, first + bundle_attempt * tries + r)
                    log.write(json.dumps(rec, separators=(",", ":"), default=str) + "\n")
                    log.flush()
                    status = rec["status"]
                    past.append(_raised(rec))
                    if status != "failed" or _alike(sim_id, past):
                        break
                counts[status] += 1
                ended.add(sim_id)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return counts


def _raised(rec: dict) -> str | None:
    """The member's own exception a failed attempt ended on (None: not failed, or one a retry may cure)."""
    return raised(str(rec.get("error"))) if rec.get("status") == "failed" else None


def _alike(sim_id: int, past: list[str | None]) -> bool:
    """The member's last two attempts raised the same exception of its own: a third would raise it
    again (as for a launched simulation, :func:`hpcml.outcome.failed_alike`); says so on stderr."""
    same = repeated(past)
    if same is not None:
        print(f"hpcml bundle: member {sim_id}: not retried: its last two attempts both raised {same[:300]}",
              file=sys.stderr, flush=True)
    return same is not None


def _attempt(fn: Callable, bundle_dir: Path, sim_id: int, params: dict, attempt: int) -> dict:
    """One attempt of one member, in this process, its stream record and final error captured."""
    stream = bundle_dir / f".member_{sim_id}_{attempt}.stream.json"
    final = stream.with_name(stream.name.removesuffix(".stream.json") + FINAL_SUFFIX)
    os.environ.update({ENV_SIM_ID: str(sim_id), ENV_ATTEMPT: str(attempt), ENV_STREAM_RECORD: str(stream)})
    start = time.time()
    result, error, status = None, None, "ok"
    try:
        result = fn(sim_id=sim_id, params=dict(params), attempt=attempt)
        if result is not None and not isinstance(result, dict):
            raise ConfigError(f"the bundle entry returned {type(result).__name__}: expected a dict or None")
    except ConfigError as e:
        status, error = "final", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 -- a member's failure is recorded, the bundle goes on
        status, error = "failed", "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
    streamed = None
    for path, take in ((stream, "n_sent"), (final, "error")):
        try:
            data = safeio.read_bytes(path, 1 << 16, "a member's record")
        except (OSError, ConfigError):  # planted in the bundle's directory: no record of this member's
            data = None
        if data is not None:
            try:
                rec = safeio.parse_json(data, str(path), max_depth=8)
            except ConfigError:
                rec = {}
            rec = rec if isinstance(rec, dict) else {}
            if take == "n_sent":
                streamed = rec.get("n_sent")
            elif status != "final":  # its producer refused something deterministic, even if the entry caught it
                status, error = "final", str(rec.get("error"))
            path.unlink(missing_ok=True)
    return {"sim_id": sim_id, "attempt": attempt, "status": status, "params": params, "result": result,
            "error": error, "streamed": streamed, "start": start, "end": time.time(),
            "duration_s": round(time.time() - start, 6)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcml.ensemble.bundle BUNDLE_DIR", file=sys.stderr)
        return 2
    try:
        counts = run_bundle(args[0], bundle_attempt=int(os.environ.get(ENV_ATTEMPT, "0")))
    except ConfigError as e:
        print(f"hpcml bundle: {e}", file=sys.stderr)
        return 78
    print("HPCML_SIM_RESULT " + json.dumps(counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
