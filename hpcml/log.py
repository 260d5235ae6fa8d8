"""Rank-aware logging: one logger per module, every line prefixed with the rank.

Rank 0 logs at INFO; other ranks log warnings and errors only, so a 1,000-rank job does
not print 1,000 copies of every message. ``HPCML_LOG_ALL_RANKS=1`` lets every rank log at
the chosen level; ``HPCML_LOG_LEVEL`` (DEBUG, INFO, ...) sets that level.
"""

from __future__ import annotations

import logging
import os
import sys

from hpcml import env

_ROOT = "hpcml"
_configured = False


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, level: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.level, self.all_ranks = rank, level, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        if self.rank == 0 or self.all_ranks:
            return record.levelno >= self.level
        return record.levelno >= max(self.level, logging.WARNING)


def configure(rank: int | None = None) -> None:
    """(Re)attach the rank-prefixed handler to the ``hpcml`` logger.

    Called lazily on first use with the rank read from the launch environment; the grid
    calls it again with the MPI rank once that is known.
    """
    global _configured
    if rank is None:
        rank = env.detect().rank
    level = logging.getLevelName(os.environ.get("HPCML_LOG_LEVEL", "INFO").upper())
    if not isinstance(level, int):
        level = logging.INFO
    all_ranks = os.environ.get("HPCML_LOG_ALL_RANKS", "0") not in ("", "0", "false", "no")
    root = logging.getLogger(_ROOT)
    for h in list(root.handlers):
        if getattr(h, "_hpcml", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._hpcml = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RankFilter(rank, level, all_ranks))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    root.propagate = False
    _configured = True


def get_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (pass ``__name__``)."""
    if not _configured:
        configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
