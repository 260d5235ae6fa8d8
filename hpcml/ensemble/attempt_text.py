"""An attempt's end in words, for the one line a failed simulation gets: the signal that ended
it, what stopped it (a timeout is not the exit code the wrapper leaves), its stderr's last
lines, the failed task as :func:`describe` says it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from hpcml import safeio


def tail_text(path: Path, max_bytes: int = 8192, *, root: Path | None = None) -> str:
    return safeio.tail(path, max_bytes, root=root).decode(errors="replace")


def tail_lines(path: Path, n: int) -> list[str]:
    return [line.strip() for line in tail_text(path).splitlines() if line.strip()][-n:]


_HYDRA_SIGNAL = re.compile(r"\(signal (\d+)\)")


def exit_signal(rc: int | None, output_tail: str) -> int | None:
    """The signal that ended an attempt: a negative return code, MPICH's "(signal N)" exit
    string (hydra returns N itself as the exit code), or the shell's 128 + N."""
    if rc is None or rc == 0:
        return None
    if rc < 0:
        return -rc
    m = _HYDRA_SIGNAL.findall(output_tail)
    if m:
        return int(m[-1])
    if 128 < rc <= 128 + 64:
        return rc - 128
    return None


def describe(exc: BaseException) -> str:
    """A failed task in one line: its exit code (or exception), then its notes -- the
    failed attempt's ``.err`` file, added by :func:`hpcml.ensemble.attempts.record_ended`."""
    code = getattr(exc, "exitcode", None)
    text = f"exit code {code}" if code is not None else f"{type(exc).__name__}: {exc}"
    return text + "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))


_ENDED_BY = {"timeout": "timed out: stopped by the campaign after {d} s (its sim_timeout_s)",
             "driver_gone": "stopped when the campaign's driver was gone",
             "cancelled": "cancelled by the campaign", "interrupted": "interrupted (its worker was signalled)"}


def note_ended_by(exc: BaseException, rec: Mapping) -> None:
    """What ended the last attempt when the wrapper did (a timeout is not the exit code it leaves)."""
    text = _ENDED_BY.get(rec.get("status"))
    note = text and f"attempt {rec.get('attempt')} " + text.format(d=f"{rec.get('duration_s') or 0:.0f}")
    if note and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def note_stderr(exc: BaseException, err: Path) -> None:
    """Where to look: the failed attempt's stderr file and its last lines, as a note on the
    task's exception (Parsl's says only the exit code)."""
    if any(n.startswith(f"see {err}") for n in getattr(exc, "__notes__", ())):
        return  # recorded again (a cancellation sweep)
    tail = [line[:200] for line in tail_lines(err, 2)]
    exc.add_note(f"see {err}" + (": " + " / ".join(tail) if tail else ""))
