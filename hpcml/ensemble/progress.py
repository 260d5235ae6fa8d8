"""One status line for a campaign: simulations done/running/failed/retried/cancelled and the trainer's step.

On a terminal the line is rewritten in place (a few times a second at most); into a log
file or a pipe it becomes a plain line every ``every_s`` seconds, so a batch job's output
stays readable and small.
"""

from __future__ import annotations

from hpcml import safeio
import sys
import time
from pathlib import Path
from typing import TextIO


def last_json_line(path: Path, *, max_bytes: int = 65536) -> dict | None:
    """The last complete JSON line of ``path`` (reading only its tail), or None.

    The trainer appends to ``metrics.jsonl`` while we read, so a partial last line is
    skipped in favour of the one before it.
    """
    tail = safeio.tail(path, max_bytes)
    for line in reversed(tail.split(b"\n")):
        line = line.strip()
        if not line:
            continue
        try:
            rec = safeio.parse_json(line, str(path))
        except ValueError:
            continue
        if isinstance(rec, dict):
            return rec
    return None


class ProgressLine:
    """Renders the campaign's state; does nothing when disabled."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None, every_s: float = 30.0,
                 tty: bool | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s if not self.tty else 0.2
        self.t0 = time.monotonic()
        self._last_emit = -1e9
        self._last_text = ""
        self._open = False

    def format(self, *, done: int, running: int, failed: int, retried: int, cancelled: int = 0,
               train: str | None = None) -> str:
        parts = [f"campaign {time.monotonic() - self.t0:6.1f}s"]
        if self.total:  # training alone (offline) has no simulations to count
            parts.append(f"sims {done}/{self.total} done, {running} running, {failed} failed, {retried} retried"
                         + (f", {cancelled} cancelled" if cancelled else ""))
        if train is not None:
            parts.append(train)
        return " | ".join(parts)

    def due(self, force: bool = False) -> bool:
        """Whether :meth:`update` would draw now (lets callers skip gathering the counts)."""
        return self.enabled and (force or time.monotonic() - self._last_emit >= self.every_s)

    def update(self, *, force: bool = False, **counts) -> None:
        if not self.due(force):
            return
        now = time.monotonic()
        text = self.format(**counts)
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self._open = True
        elif force and text.split(" | ", 1)[-1] == self._last_text.split(" | ", 1)[-1]:
            return  # a forced line that says nothing new (beyond the clock)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._last_emit, self._last_text = now, text

    def close(self) -> None:
        """End the in-place line so that later output starts on a fresh line."""
        if self.enabled and self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
