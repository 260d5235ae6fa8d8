"""Simulation ids held as sorted runs, and JSON records written a chunk at a time.

A campaign of 10^5 members completes them a bundle at a time, so its ids come in long
consecutive runs: a set of them is a few ``[start, stop)`` pairs, not 10^5 Python ints
(~36 bytes each, ~80 in a set). :class:`IdSet` is that set; it reads as the sorted list
of its ids (``len``, iteration, indexing, ``in``, ``==`` against a list), so code that
took the old lists keeps working. :func:`dump` writes a record holding such sets (or any
large list or mapping) as plain JSON, a chunk at a time, so writing ``campaign.json`` or
the done record at 10^5 never builds the whole text or list at once.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from itertools import islice
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any


class IdSet(Sequence[int]):
    """A set of non-negative ints as sorted, disjoint, non-adjacent ``[start, stop)`` runs."""

    __slots__ = ("_lo", "_hi", "_n")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._n = 0
        self.update(ids)

    @classmethod
    def span(cls, start: int, stop: int) -> IdSet:
        """Every id of ``range(start, stop)``."""
        out = cls()
        if stop > start:
            out._lo, out._hi, out._n = [start], [stop], stop - start
        return out

    def add(self, i: int) -> None:
        k = bisect_right(self._lo, i) - 1  # the run starting at or before i
        if k >= 0 and i < self._hi[k]:
            return
        self._n += 1
        joins_left = k >= 0 and self._hi[k] == i
        joins_right = k + 1 < len(self._lo) and self._lo[k + 1] == i + 1
        if joins_left and joins_right:
            self._hi[k] = self._hi.pop(k + 1)
            del self._lo[k + 1]
        elif joins_left:
            self._hi[k] = i + 1
        elif joins_right:
            self._lo[k + 1] = i
        else:
            self._lo.insert(k + 1, i)
            self._hi.insert(k + 1, i + 1)

    def update(self, ids: Iterable[int]) -> None:
        if isinstance(ids, IdSet) and not self._n:
            self._lo, self._hi, self._n = list(ids._lo), list(ids._hi), ids._n
            return
        for i in ids:
            self.add(i)

    def runs(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` runs, ascending."""
        return list(zip(self._lo, self._hi))

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int):
            return False
        k = bisect_right(self._lo, i) - 1
        return k >= 0 and i < self._hi[k]

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        for lo, hi in zip(self._lo, self._hi):
            yield from range(lo, hi)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(f"IdSet index {index} out of range for {self._n} ids")
        for lo, hi in zip(self._lo, self._hi):
            if index < hi - lo:
                return lo + index
            index -= hi - lo
        raise IndexError(index)  # pragma: no cover

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdSet):
            return self._lo == other._lo and self._hi == other._hi
        if isinstance(other, (list, tuple, range)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self._n <= SHOWN:  # printed as the list it reads as
            return repr(list(self))
        shown = ", ".join(f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}" for lo, hi in self.runs()[:8])
        return f"IdSet({shown}{', ...' if len(self._lo) > 8 else ''}; {self._n} ids)"

    def __deepcopy__(self, memo) -> list[int]:
        """A plain list: ``dataclasses.asdict`` (which copies what it does not know) then
        gives what ``json.dumps`` takes -- the ids made into a list only when asked for."""
        return list(self)


#: Up to this many ids an IdSet prints as a list.
SHOWN = 64


#: Ids (or items) per chunk of text when a large list or mapping is written.
CHUNK = 4096


def dump(record: Mapping[str, Any]) -> Iterator[str]:
    """``record`` as JSON text, a chunk at a time: one top-level key a line; a value that is a
    large sequence (an :class:`IdSet`, a list, anything with ``__len__`` and ``__iter__``
    but not a str) or a large mapping written in chunks of :data:`CHUNK` items, everything
    else with :func:`json.dumps`. The text parses to what ``json.dumps(record)`` would."""
    yield "{"
    for k, (key, value) in enumerate(record.items()):
        yield ("\n " if k == 0 else ",\n ") + json.dumps(str(key)) + ": "
        yield from _value(value)
    yield "\n}\n"


def _value(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping) and len(value) > CHUNK:  # a large one holds scalars (attempts per id)
        yield "{"
        items = iter(value.items())
        sep = ""
        while chunk := list(islice(items, CHUNK)):
            yield sep + ", ".join(f'"{k}": {v}' if type(k) is int and type(v) is int  # ints are their own JSON
                                  else f"{json.dumps(str(k))}: {json.dumps(v)}" for k, v in chunk)
            sep = ", "
        yield "}"
    elif isinstance(value, Mapping):  # a small one may hold an IdSet (campaign.json's cumulative record)
        yield "{"
        for k, (key, v) in enumerate(value.items()):
            yield ("" if k == 0 else ", ") + json.dumps(str(key)) + ": "
            yield from _value(v)
        yield "}"
    elif isinstance(value, IdSet) or (isinstance(value, (list, tuple)) and len(value) > CHUNK):
        yield "["
        ids = iter(value)
        sep = ""
        while chunk := list(islice(ids, CHUNK)):
            yield sep + ", ".join(str(x) if type(x) is int else json.dumps(x) for x in chunk)
            sep = ", "
        yield "]"
    else:
        yield json.dumps(value)
