"""The one file layer: every file hpcml reads, appends or replaces for a user goes through here.

A campaign's run directory sits in a project directory the whole group can write, so any
name in it may have been put there by someone else: a symbolic link to a file outside, a
FIFO that blocks an ``open()`` for good, a file of a GiB, a sparse one that claims a TB, JSON
nested a million deep. Here every open is ``O_NOFOLLOW | O_NONBLOCK`` and takes regular
files only (:mod:`~hpcml.safeio.paths`); with ``root`` (the run directory) every directory
between it and the file is opened without following links too, so no path leads out of it.
Reads are bounded by the file's size *and* its allocated blocks before a byte is read
(:mod:`~hpcml.safeio.reading`); JSON is refused past :data:`MAX_DEPTH` levels before it is
parsed (:mod:`~hpcml.safeio.jsonio`); appends and replacements refuse a link, a non-regular
file and (appends) a file with other hard links (one could name a file outside); a
replacement is a new file renamed over the name, so what the old one linked to is untouched
(:mod:`~hpcml.safeio.writing`). Every refusal is a :class:`FileRefused` (a ``ConfigError``, so
a ``ValueError``) naming the file and what it is -- or the caller's own error class
(``error=``: a checkpoint's reader raises ``CheckpointError``), or a miss (``error=None``).
Imports nothing heavy.
"""

from hpcml.safeio.jsonio import MAX_DEPTH, finite, json_depth, parse_json, read_json, write_json
from hpcml.safeio.paths import FileRefused, kind, open_fd
from hpcml.safeio.reading import data_bytes, iter_lines, read_bytes, read_fd, read_text, tail
from hpcml.safeio.writing import append, ends_torn, replace

__all__ = ["MAX_DEPTH", "FileRefused", "append", "data_bytes", "ends_torn", "finite", "iter_lines", "json_depth",
           "kind", "open_fd", "parse_json", "read_bytes", "read_fd", "read_json", "read_text", "replace", "tail",
           "write_json"]
