"""One simulation attempt and its file protocol: what runs on the Parsl worker, and the
plain files it leaves that the submitting side turns into provenance records.

Attempts are numbered where they run: :func:`hpcml_sim` claims ``attempt_K.start`` in the
simulation's directory with an exclusive create, so the number is right on a retry, on a
re-run of the campaign in the same run directory, and whichever worker runs it. A small
bash wrapper (``run_dir/sims/attempt.sh``) runs the attempt in its own process group,
kills it on timeout or cancellation, and leaves ``attempt_K.end``. Nothing is pickled
except what Parsl itself serialises (the app's arguments: strings and numbers).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from hpcml import safeio
from hpcml.ensemble.attempt_text import exit_signal, note_ended_by, note_stderr, tail_text
from hpcml.ensemble.provenance import MAX_RECORD_LINE, append_provenance, iter_provenance
from hpcml.contract import CONFIG_ERROR
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int
from hpcml.outcome import failed_alike, read_final_error

RESULT_MARKER = "HPCML_SIM_RESULT"
"""Rank 0 of a simulation prints ``HPCML_SIM_RESULT {json}`` as its last stdout line."""
CANCEL_FILE = "CANCEL"
"""Created in ``run_dir/sims`` to stop every running attempt and every retry."""
_CANCELLED_RC = 125
logger = get_logger(__name__)


# --- the remote side: runs on the Parsl worker ----------------------------------------------

def hpcml_sim(sim_dir: str, sim_id: int, launch: str, argv: list[str], limit_s: int, grace_s: int,
              parsl_resource_specification: dict) -> str:
    """Parsl bash_app body: claim the next attempt number and return its command line.

    Parsl calls this again on every retry, on the worker, so the number is claimed here
    with an exclusive create rather than counted on the submitting side.
    """
    sims_dir = os.path.dirname(sim_dir)
    if os.path.exists(os.path.join(sims_dir, CANCEL_FILE)):
        return f"exit {_CANCELLED_RC}"  # a retry after cancellation: no attempt, no launch
    if read_final_error(sim_dir) is not None:  # a deterministic error: a retry would fail the same way
        return f"exit {CONFIG_ERROR}"
    if os.path.islink(sim_dir):  # the group may write the run directory: a link could lead anywhere
        return (f"echo {shlex.quote(f'{sim_dir} is a symbolic link, not a directory of the campaign: refused')} "
                f">&2; exit {CONFIG_ERROR}")
    os.makedirs(sim_dir, exist_ok=True)
    k = 0
    while os.path.exists(os.path.join(sim_dir, f"attempt_{k}.start")):
        k += 1
    if k and _interrupted(sim_dir, k - 1) and _cancelled_within(sims_dir, INTERRUPT_GRACE_S):
        return f"exit {_CANCELLED_RC}"  # the whole campaign was stopping: its signal reached this worker first
    same = failed_alike(sim_dir, k)  # the simulation's own exception twice: a third attempt would raise it again
    if same is not None:
        why = f"simulation {sim_id}: not retried: attempts {k - 2} and {k - 1} both raised {same[:300]}"
        return f"echo {shlex.quote(why)} >&2; exit 1"
    while True:
        try:
            fd = os.open(os.path.join(sim_dir, f"attempt_{k}.start"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            k += 1
    with os.fdopen(fd, "w") as f:
        json.dump({"start": time.time(), "host": socket.gethostname()}, f)
    for name in os.listdir(sim_dir):  # the attempt's files are its own: none planted before it was claimed
        if name.startswith(f"attempt_{k}.") and name != f"attempt_{k}.start":
            os.unlink(os.path.join(sim_dir, name))  # a name, never followed
    script = os.path.join(sims_dir, "attempt.sh")
    # `launch` stays unquoted: $PARSL_MPI_PREFIX must expand on the worker.
    return (f"exec /bin/bash {shlex.quote(script)} {shlex.quote(sim_dir)} {int(sim_id)} {k} {int(limit_s)} "
            f"{int(grace_s)} -- {launch} {shlex.join(argv)}")


#: A retry of an attempt its worker's signal interrupted waits this long for CANCEL: a stopped job's
#: signal reaches its workers with its driver, and Parsl retried before the driver wrote CANCEL.
INTERRUPT_GRACE_S = 2.0


def _interrupted(sim_dir: str, k: int) -> bool:
    """Attempt ``k`` ended because its worker was signalled (its wrapper's end record says so)."""
    rec = safeio.read_json(os.path.join(sim_dir, f"attempt_{k}.end"), MAX_RECORD_LINE, error=None)
    return bool(rec) and rec.get("reason") == "interrupted"


def _cancelled_within(sims_dir: str, wait_s: float) -> bool:
    """Whether the campaign's CANCEL appears in ``sims_dir`` within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(os.path.join(sims_dir, CANCEL_FILE)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


ATTEMPT_SH = r"""#!/bin/bash
# Written by hpcml.ensemble.attempts. Runs attempt K of one simulation in its own process
# group; TERM then KILL it on timeout, on run_dir/sims/CANCEL, when the campaign's driver
# is gone or when this script is signalled; leaves attempt_K.end = {"returncode", "end", "reason"}.
# usage: attempt.sh SIM_DIR SIM_ID K TIMEOUT_S GRACE_S -- COMMAND...
dir=$1 id=$2 k=$3 limit=$4 grace=$5
shift 6
here=$(cd "$(dirname "$0")" && pwd)
base=$dir/attempt_$k
[ -f "$here/env.sh" ] && . "$here/env.sh"
export HPCML_SIM_ID=$id HPCML_ATTEMPT=$k HPCML_STREAM_RECORD=$base.stream.json
set -C  # noclobber: a file or link put at one of this attempt's names is refused, never written through
exec >"$base.out" 2>"$base.err" </dev/null
printf '%q ' "$@" >"$base.cmd"  # the command as launched: $PARSL_MPI_PREFIX expanded
set -m
"$@" &
child=$!
reason=
# The driver that started the campaign died (kill -9, a lost login session): nothing may
# outlive it. Checked where the driver runs (a zombie counts as dead); elsewhere Parsl's own
# heartbeats end the workers.
driver_gone() {
    [ -n "$HPCML_DRIVER_PID" ] && [ "$HPCML_DRIVER_HOST" = "$(hostname)" ] || return 1
    local state
    state=$(awk '{print $3}' "/proc/$HPCML_DRIVER_PID/stat" 2>/dev/null) || return 0
    [ -z "$state" ] || [ "$state" = Z ]
}
stop() {
    kill -TERM -- -"$child" 2>/dev/null
    local g=0
    while [ "$g" -lt "$grace" ] && kill -0 "$child" 2>/dev/null; do sleep 1; g=$((g + 1)); done
    kill -KILL -- -"$child" 2>/dev/null
}
interrupted=0 killer=
note() { [ -e "$base.reason" ] || echo "$1" >"$base.reason"; }  # the first reason stands
# Signalled (e.g. a worker shutting down): TERM the attempt now, KILL it after the grace
# period from the background, so that the wait below reaps it as soon as it exits.
trap 'interrupted=1; note interrupted; kill -TERM -- -"$child" 2>/dev/null
      (sleep "$grace"; kill -KILL -- -"$child" 2>/dev/null) & killer=$!' TERM INT HUP
(
    n=0
    while sleep 1; do
        kill -0 "$child" 2>/dev/null || exit 0
        n=$((n + 1))
        if [ -e "$here/CANCEL" ]; then note cancelled
        elif [ "$limit" -gt 0 ] && [ "$n" -ge "$limit" ]; then note timeout
        elif driver_gone; then note driver_gone
        else continue; fi
        stop
        exit 0
    done
) &
watcher=$!
set +m  # the process groups stay; bash's job notices ("Terminated ...") would clutter the .err
wait "$child"; rc=$?
if [ "$interrupted" = 1 ]; then wait "$child"; rc=$?; kill "$killer" 2>/dev/null; fi
kill -- -"$watcher" 2>/dev/null
wait "$watcher" 2>/dev/null
[ -f "$base.reason" ] && [ ! -L "$base.reason" ] && reason=$(head -c 32 "$base.reason")
# MPICH's hydra exits 0 after forwarding SIGTERM: a stopped attempt must not look like a
# success -- unless it printed its result line, its last act: then it finished as the stop came.
if [ -n "$reason" ] && [ "$rc" = 0 ]; then
    if grep -q '^HPCML_SIM_RESULT ' "$base.out" 2>/dev/null; then reason=; rm -f "$base.reason"; else rc=143; fi
fi
printf '{"returncode": %d, "end": %s, "reason": "%s"}\n' "$rc" "$(date +%s.%N)" "$reason" >"$base.end.tmp"
mv "$base.end.tmp" "$base.end"
exit "$rc"
"""


def prepare(sims_dir: Path, env: Mapping[str, str]) -> None:
    """Write the attempt wrapper and the attempts' environment into ``sims_dir``.

    Atomically (rename) and only when the content changes: attempts of other simulations
    may be starting from these files at this moment, and bash runs a half-written script."""
    sims_dir.mkdir(parents=True, exist_ok=True)
    _write_if_changed(sims_dir / "attempt.sh", ATTEMPT_SH, 0o755)
    _write_if_changed(sims_dir / "env.sh", "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()),
                      0o600)  # may name secrets' files


def clear_cancel(sims_dir: Path) -> None:
    """Forget a cancellation left by an earlier run."""
    (sims_dir / CANCEL_FILE).unlink(missing_ok=True)


def _write_if_changed(path: Path, text: str, mode: int) -> None:
    try:
        if safeio.read_text(path, len(text.encode()) + 1) == text:
            return
    except (OSError, ConfigError):
        pass
    safeio.replace(path, text, mode=mode)


def sim_dir(run_dir: Path, sim_id: int) -> Path:
    return run_dir / "sims" / f"sim_{sim_id:05d}"


def attempt_record(run_dir: Path, directory: Path, *, sim_id: int, params: Mapping, argv: list[str], launch: str,
                   k: int, missing_end: bool = False, missing_end_rc: int | None = None) -> dict | None:
    """The provenance record of attempt ``k`` of the simulation in ``directory``, or None
    while it runs (``missing_end``: it is over but left no end record; its return code is
    ``missing_end_rc``)."""
    base, root = directory / f"attempt_{k}", run_dir  # every file read below the run directory, no link followed
    # a record that is not one of ours (a link, a FIFO, too large, not JSON) is as good as none: the attempt
    # then counts as not ended, or lost
    start = safeio.read_json(base.with_suffix(".start"), MAX_RECORD_LINE, root=root, error=None) or {}
    end = safeio.read_json(base.with_suffix(".end"), MAX_RECORD_LINE, root=root, error=None)
    if end is None and not missing_end:
        return None
    out, err = base.with_suffix(".out"), base.with_suffix(".err")
    result = parse_result(out, root=root)
    if end is not None:  # written by the wrapper, yet input: a field of the wrong type is as good as none
        rc, t_end, reason = _int(end.get("returncode")), _time(end.get("end")), end.get("reason") or None
    else:  # no end record: the wrapper itself was killed, the worker lost, or the file not yet visible
        rc, t_end, reason = missing_end_rc, None, None
    sig = exit_signal(rc, tail_text(out, root=root) + tail_text(err, root=root))
    if reason in ("timeout", "cancelled", "interrupted", "driver_gone"):
        status = reason
    elif rc == 0:
        status = "ok"
    elif sig is not None:
        status = "killed"
    else:
        status = "lost" if rc is None else "failed"
    t_start = _time(start.get("start"))
    host = start.get("host")
    command = safeio.read_text(base.with_suffix(".cmd"), MAX_RECORD_LINE, root=root, error=None)
    return {
        "sim_id": sim_id, "attempt": k, "params": dict(params), "status": status,
        "returncode": rc, "signal": sig,
        "samples_sent": result.get("samples_sent") if result else None, "result": result,
        "streamed": stream_record(directory, k, root=root),
        "start": t_start, "end": t_end,
        "duration_s": round(t_end - t_start, 3) if t_start is not None and t_end is not None else None,
        "host": host[:256] if isinstance(host, str) else None, "launch": launch, "argv": list(argv),
        "command": command.strip() if command is not None else None,
        "stdout": str(out.relative_to(run_dir)), "stderr": str(err.relative_to(run_dir)),
    }


def record_ended(run_dir: Path, directory: Path, *, sim_id: int, params: Mapping, argv: list[str], launch: str,
                 first: int, recorded: dict[int, dict], final: bool, exc: BaseException | None = None,
                 ok: bool = False) -> int:
    """Append a provenance record for every attempt from ``first`` on that has ended and is
    not in ``recorded`` (which gains them); when the task is over (``final``), also for
    attempts that left no end record -- the last one then takes its return code from the
    task: 0 if ``ok``, else ``exc``'s, and ``exc`` gains a note naming the last attempt's
    ``.err`` file, which :func:`describe` shows. Returns how many attempts were claimed."""
    k = first
    while (directory / f"attempt_{k}.start").exists():
        if k not in recorded:
            args = dict(sim_id=sim_id, params=params, argv=argv, launch=launch, k=k)
            rec = attempt_record(run_dir, directory, **args)
            if rec is None and final:
                last = not (directory / f"attempt_{k + 1}.start").exists()
                rc = (0 if ok else getattr(exc, "exitcode", None)) if last else None
                rec = attempt_record(run_dir, directory, **args, missing_end_rc=rc, missing_end=True)
            if rec is not None:
                recorded[k] = rec
                append_provenance(run_dir, [rec])
        k += 1
    if final and exc is not None and not ok and (k - 1) in recorded:
        note_ended_by(exc, recorded[k - 1])
        note_stderr(exc, run_dir / recorded[k - 1]["stderr"])
    return k - first


def record_orphans(run_dir: Path) -> int:
    """Provenance records for the attempts that have none: their driver was killed while they
    ran (the wrapper ended them, ``driver_gone``, or was killed itself: ``lost``). How many."""
    recorded = {(r.get("sim_id"), r.get("attempt")) for r in iter_provenance(run_dir)}
    n = 0
    sims = Path(run_dir) / "sims"
    if sims.is_symlink():
        raise ConfigError(f"{sims}: a symbolic link, not the campaign's directory of simulations: refused (it "
                          f"could lead anywhere); move it away and resume")
    for d in sorted(sims.glob("sim_*")):
        try:
            sim = int(d.name[4:])
        except ValueError:
            continue
        if d.is_symlink() or not d.is_dir():  # not a directory this campaign made: nothing of it is read
            logger.warning("%s is not a directory of this campaign (a link or a file): passed over", d)
            continue
        spec = safeio.read_json(d / "spec.json", MAX_RECORD_LINE, root=run_dir, error=None) or {}
        spec = {"params": spec.get("params") if isinstance(spec.get("params"), dict) else {},
                "argv": [str(a) for a in spec["argv"]] if isinstance(spec.get("argv"), list) else []}
        k = 0
        while (d / f"attempt_{k}.start").exists():
            if (sim, k) not in recorded:
                rec = attempt_record(Path(run_dir), d, sim_id=sim, params=spec["params"], argv=spec["argv"],
                                     launch="", k=k, missing_end=True)
                append_provenance(run_dir, [rec])
                n += 1
            k += 1
    from hpcml.ensemble.bundle import orphan_rows  # imports nothing of the driver's

    rows = orphan_rows(Path(run_dir), recorded)
    append_provenance(run_dir, rows)
    return n + len(rows)


def stream_record(directory: Path, k: int, *, root: Path | None = None) -> int | None:
    """Samples attempt ``k`` streamed (its Producer's record), or None: it created no Producer."""
    rec = safeio.read_json(directory / f"attempt_{k}.stream.json", MAX_RECORD_LINE, root=root, error=None)
    n = rec.get("n_sent") if rec else None
    return n if is_int(n) and n >= 0 else None


# --- helpers ---------------------------------------------------------------------------------

def next_attempt(sim_dir: Path) -> int:
    k = 0
    while (sim_dir / f"attempt_{k}.start").exists():
        k += 1
    return k


def _int(v) -> int | None:
    return v if type(v) is int and abs(v) < 1 << 31 else None


def _time(v) -> float | None:
    return float(v) if type(v) in (int, float) and 0 <= v < 1e11 else None


def parse_result(out: Path, *, root: Path | None = None) -> dict | None:
    """The last ``HPCML_SIM_RESULT {json}`` line of an attempt's stdout (its last MiB): the
    simulation's own output, so untrusted -- too deep or not JSON is no result."""
    for line in reversed(tail_text(out, 1 << 20, root=root).splitlines()):
        if line.startswith(RESULT_MARKER + " "):
            try:
                data = safeio.parse_json(line[len(RESULT_MARKER) + 1:], str(out), max_depth=16)
            except ConfigError:
                return None
            return data if isinstance(data, dict) else None
    return None


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")
