"""Ensemble members described, not listed: 10^5 simulations without 10^5 objects.

A Merlin-style study runs 10^5-10^8 parameter points of one function. As a list of
:class:`~hpcml.ensemble.spec.SimSpec` that is ~1.5 KiB of driver memory a member before
anything runs. :class:`Members` is the same list as a rule: ``count`` members of one
``entry`` with ids from ``first_id``, each one's parameters computed from its id (a
function) or read from columns (arrays, e.g. from a sample file). It is a lazy
``Sequence[SimSpec]``: the Campaign makes each member's spec when it hands the member to
a bundle, and holds a few bytes a member otherwise (:mod:`hpcml.ensemble.book`)::

    Campaign(run_dir=..., site="local", bundle=1000).run(
        Members(entry="mypkg.sim:run_point", count=100_000, params=lambda i: {"x": i / 1e5}))

:class:`Specs` is what a run works through: the simulations given (SimSpecs and Members
in any mix) as one sequence, with the waves an adaptive campaign adds appended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcml.ensemble.spec import SimSpec
from hpcml.errors import ConfigError
from hpcml.idset import IdSet
from hpcml.numeric import is_int, is_real


class _Lazy(Sequence[SimSpec]):
    """Indexing (negative, slices, bounds) over ``_at(k)``: the specs are made when asked for."""

    _what = "position"

    def _at(self, k: int) -> SimSpec:
        raise NotImplementedError

    def __getitem__(self, k):  # type: ignore[override]
        n = len(self)
        if isinstance(k, slice):
            return [self._at(i) for i in range(*k.indices(n))]
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"{self._what} {k} of {n}")
        return self._at(k)


@dataclass(frozen=True, kw_only=True, eq=False)
class Members(_Lazy):
    """``count`` bundled members of ``entry`` with ids ``first_id .. first_id + count - 1``.

    ``params``: a function of the member's id returning its parameters (a dict of finite
    numbers), or columns: a mapping of parameter name to a sequence of ``count`` values
    (a list, a NumPy array), member ``k`` taking the ``k``-th of each. ``stream`` as
    :attr:`SimSpec.stream`. Each member runs in-process in a bundle
    (``Campaign(bundle=N)``, :mod:`hpcml.ensemble.bundle`)."""

    entry: str
    count: int
    params: Callable[[int], Mapping[str, Any]] | Mapping[str, Sequence[float]]
    first_id: int = 0
    stream: bool | None = None

    def __post_init__(self) -> None:
        for name in ("count", "first_id"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ConfigError(f"Members {name} must be an int >= 0, got {v!r}")
        if self.first_id + self.count > 2**53:
            raise ConfigError(f"Members ids {self.first_id} to {self.first_id + self.count - 1} pass 2**53: expected "
                              f"ids a JSON reader keeps exact")
        mod, _, fn = str(self.entry).partition(":")
        if not isinstance(self.entry, str) or not mod or not fn.isidentifier():
            raise ConfigError(f"Members entry={self.entry!r}: expected 'package.module:function'")
        if self.stream is not None and not isinstance(self.stream, bool):
            raise ConfigError(f"Members stream must be True, False or None, got {self.stream!r}")
        if isinstance(self.params, Mapping):
            for name, col in self.params.items():
                if not isinstance(name, str) or not name:
                    raise ConfigError(f"Members params column name {name!r}: expected a non-empty str")
                if not hasattr(col, "__len__") or len(col) != self.count:
                    got = len(col) if hasattr(col, "__len__") else type(col).__name__
                    raise ConfigError(f"Members params column {name!r} has {got} values, expected count={self.count}")
        elif not callable(self.params):
            raise ConfigError(f"Members params must be a function of the member's id or a mapping of columns, got "
                              f"{type(self.params).__name__}")

    @property
    def ids(self) -> range:
        return range(self.first_id, self.first_id + self.count)

    def __len__(self) -> int:
        return self.count

    def params_of(self, k: int) -> dict[str, Any]:
        """The parameters of the ``k``-th member (position, not id)."""
        if isinstance(self.params, Mapping):
            return {name: _scalar(col[k], name, self.first_id + k) for name, col in self.params.items()}
        p = self.params(self.first_id + k)
        if not isinstance(p, Mapping) or not all(isinstance(name, str) for name in p):
            raise ConfigError(f"Members params({self.first_id + k}) returned {p!r}: expected a dict of parameter "
                              f"names to finite numbers")
        return dict(p)

    _what = "member"

    def _at(self, k: int) -> SimSpec:
        return SimSpec(sim_id=self.first_id + k, params=self.params_of(k), entry=self.entry, ranks=1,
                       stream=self.stream)

    def __iter__(self) -> Iterator[SimSpec]:
        return (self._at(k) for k in range(self.count))

    def __repr__(self) -> str:
        return (f"Members(entry={self.entry!r}, count={self.count}, "
                f"ids {self.first_id}..{self.first_id + self.count - 1})")


def _scalar(v: Any, name: str, sim_id: int) -> float | int:
    v = v.item() if hasattr(v, "item") else v  # a NumPy scalar
    if not is_real(v) or not math.isfinite(v):
        raise ConfigError(f"member {sim_id}: params column {name!r} holds {v!r}: expected a finite number")
    return v


class Specs(_Lazy):
    """The simulations of one run, by position: the given ones (SimSpecs and :class:`Members`
    in any mix, flattened in order) and the waves appended to them. A position's spec is
    made on demand for members; ``position(sim_id)`` finds one by id."""

    def __init__(self, sims: Sequence[SimSpec | Members] = ()) -> None:
        self._parts: list[Members | list[SimSpec]] = []
        self._starts: list[int] = []
        self._n = 0
        self._index: dict[int, int] | None = None  # sim_id -> position of the listed specs, made when asked
        for s in sims:
            self._append(s)

    def _append(self, s: SimSpec | Members) -> None:
        if isinstance(s, Members):
            if s.count:
                self._starts.append(self._n)
                self._parts.append(s)
                self._n += s.count
            return
        if not isinstance(s, SimSpec):
            raise ConfigError(f"a simulation must be a SimSpec or Members, got {type(s).__name__}")
        if not self._parts or isinstance(self._parts[-1], Members):
            self._starts.append(self._n)
            self._parts.append([])
        self._parts[-1].append(s)  # type: ignore[union-attr]
        if self._index is not None:
            self._index[s.sim_id] = self._n
        self._n += 1

    def extend(self, specs: Sequence[SimSpec]) -> range:
        """Append ``specs`` (a wave); the positions they took."""
        start = self._n
        for s in specs:
            self._append(s)
        return range(start, self._n)

    def __len__(self) -> int:
        return self._n

    def _part(self, pos: int) -> tuple[Members | list[SimSpec], int]:
        from bisect import bisect_right

        k = bisect_right(self._starts, pos) - 1
        return self._parts[k], pos - self._starts[k]

    _what = "simulation position"

    def _at(self, pos: int) -> SimSpec:
        part, k = self._part(pos)
        return part[k]

    def sim_id(self, pos: int) -> int:
        """The id at ``pos`` (no spec made)."""
        part, k = self._part(pos)
        return part.first_id + k if isinstance(part, Members) else part[k].sim_id

    def ids(self) -> Iterator[int]:
        for part in self._parts:
            yield from part.ids if isinstance(part, Members) else (s.sim_id for s in part)

    def position(self, sim_id: int) -> int | None:
        for part, start in zip(self._parts, self._starts):
            if isinstance(part, Members) and sim_id in part.ids:
                return start + sim_id - part.first_id
        if self._index is None:
            self._index = {s.sim_id: start + k for part, start in zip(self._parts, self._starts)
                           if not isinstance(part, Members) for k, s in enumerate(part)}
        return self._index.get(sim_id)

    def streams(self, pos: int) -> bool:
        """Whether the simulation at ``pos`` takes part in a stream (its ``stream`` is not False)."""
        part, k = self._part(pos)
        return (part.stream if isinstance(part, Members) else part[k].stream) is not False

    def is_member(self, pos: int) -> bool:
        """Whether the simulation at ``pos`` is a bundled member (an ``entry``, no launch of its own)."""
        part, k = self._part(pos)
        return isinstance(part, Members) or part[k].entry is not None

    def max_ranks(self) -> int:
        return max((1 if isinstance(p, Members) else max((s.ranks for s in p), default=1) for p in self._parts
                    if len(p)), default=1)

    def streaming_ids(self) -> IdSet:
        """The ids of the simulations that take part in a stream (``stream`` not False)."""
        return IdSet(i for p, i in enumerate(self.ids()) if self.streams(p))

    def check_unique(self) -> None:
        """ConfigError naming the ids given twice: within the listed specs, between two
        :class:`Members` ranges, or a listed id inside a range."""
        from collections import Counter

        listed = Counter(s.sim_id for p in self._parts if not isinstance(p, Members) for s in p)
        dup = sorted(i for i, n in listed.items() if n > 1)
        ranges = sorted((p.ids for p in self._parts if isinstance(p, Members) and p.count), key=lambda r: r.start)
        for a, b in zip(ranges, ranges[1:]):
            if b.start < a.stop:
                dup.append(b.start)
        dup += sorted(i for i in listed if any(i in r for r in ranges))
        if dup:
            raise ConfigError(f"sim_id values must be unique, repeated: {sorted(set(dup))[:20]}")

    def definitions(self) -> Iterator[tuple[int, dict, list[str]]]:
        """Every simulation's ``(sim_id, params, argv)`` in ascending id order (the campaign's
        definition digest), one at a time where the parts allow: listed specs are sorted,
        members' parameters computed as they are read (no SimSpec made)."""
        import heapq

        def of(part):
            if isinstance(part, Members):
                return ((part.first_id + k, part.params_of(k), []) for k in range(part.count))
            return ((s.sim_id, dict(s.params), list(s.argv)) for s in sorted(part, key=lambda s: s.sim_id))

        iters = [of(p) for p in self._parts]
        heap = [(d[0], j, d) for j, it in enumerate(iters) if (d := next(it, None)) is not None]
        heapq.heapify(heap)
        while heap:
            _, j, d = heapq.heappop(heap)
            yield d
            if (nxt := next(iters[j], None)) is not None:
                heapq.heappush(heap, (nxt[0], j, nxt))
