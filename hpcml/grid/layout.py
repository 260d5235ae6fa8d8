"""Pure layout arithmetic of the process grid: no MPI, no torch, any world size.

Axes, outermost first: ``pp, dp, ep, cp, tp`` -- so ``tp`` is innermost (neighbouring
ranks, on one node) and ``pp`` outermost. This is Megatron-core's "tp-cp-ep-dp-pp" order
and the rank map of ``init_device_mesh(..., ("pp", "dp", "cp", "tp"))``: the rank is the
row-major index of its coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hpcml.errors import GridError

#: Every axis the grid knows, outermost first.
AXES: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")
#: Axes always shown (``ep`` appears only when its degree is not 1).
CORE_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")


def _check_axes(names: Iterable[str]) -> tuple[str, ...]:
    names = tuple(names)
    for name in names:
        if name not in AXES:
            raise GridError(f"unknown axis {name!r}: expected one of {', '.join(AXES)}")
    if len(set(names)) != len(names):
        raise GridError(f"axis named twice in {names}")
    return names


#: :func:`fitting_degrees` gives up (returns []) past this many candidate layouts, or on a
#: world size past 2^40 (its divisors take too long to list): a suggestion, never a hang.
MAX_FIT_OPTIONS = 4096
MAX_FIT_WORLD = 1 << 40


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def fitting_degrees(world_size: int, wanted: dict[str, int]) -> list[dict[str, int]]:
    """The largest model-parallel degrees (each dividing the wanted one, dp left to take the
    rest) whose product divides ``world_size``: what a job that lost ranks can still run.

    Only divisors of ``gcd(wanted, world_size)`` can fit, so a huge wanted degree costs
    nothing (``tp=10**20`` once looped 10^20 times); [] when the search would be too large."""
    axes = [a for a in reversed(AXES) if a != "dp" and wanted.get(a, 1) > 1]
    if not 1 <= world_size <= MAX_FIT_WORLD:
        return []
    options: list[dict[str, int]] = [{}]
    for a in axes:
        divisors, grown = _divisors(math.gcd(wanted[a], world_size)), []
        for o in options:
            known = math.prod(o.values(), start=1)
            grown += [{**o, a: d} for d in divisors if world_size % (known * d) == 0]
            if len(grown) > MAX_FIT_OPTIONS:
                return []
        options = grown
    # p dominates o (p >= o on every axis, p != o) only with a larger product: compare with the front so far
    best: list[dict[str, int]] = []
    for o in sorted(options, key=lambda o: (-math.prod(o.values(), start=1), [-o[a] for a in axes])):
        if not any(all(p[a] >= o[a] for a in axes) for p in best):
            best.append(o)
    return best


def _what_fits(world_size: int, given: dict[str, int | None]) -> str:
    """``; 2 ranks fit tp(2), or pp(2) (dp takes the rest), or run on a multiple of 4 ranks``."""
    wanted = {a: d for a, d in given.items() if a != "dp" and isinstance(d, int) and d > 1}
    need = math.prod(wanted.values(), start=1)
    if need == 1 or world_size < 1:
        return ""
    fits = [" * ".join(f"{a}({d})" for a, d in o.items() if d > 1) for o in fitting_degrees(world_size, wanted)]
    if not fits:  # too many to search: the multiple alone
        return f"; run on a multiple of {need} ranks"
    fit = f"only dp({world_size})" if fits == [""] else f"{', or '.join(fits)} (dp takes the rest)"
    return f"; {world_size} ranks fit {fit}, or run on a multiple of {need} ranks"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Degrees of the parallel axes over ``world_size`` ranks.

    ``dp`` defaults to whatever is left (``world_size / (pp*ep*cp*tp)``); any one degree may
    be ``-1`` to be inferred instead. ``repr()`` shows the resolved degrees and rebuilds
    the same layout.
    """

    world_size: int
    pp: int = 1
    """Pipeline-parallel stages."""
    dp: int | None = None
    """Data-parallel replicas (FSDP shards over this axis); None: inferred."""
    ep: int = 1
    """Expert-parallel degree (reserved for mixture-of-experts)."""
    cp: int = 1
    """Context (sequence) parallel degree, Ulysses."""
    tp: int = 1
    """Tensor-parallel degree."""
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise GridError(f"world size must be a positive integer, got {self.world_size!r}")
        given = {a: getattr(self, a) for a in AXES}
        inferred = [a for a, d in given.items() if d == -1]
        if len(inferred) > 1:
            raise GridError(f"only one axis degree may be -1 (inferred), got -1 for {' and '.join(inferred)}")
        if given["dp"] is None:
            given["dp"] = 1 if inferred else -1
            inferred = inferred or ["dp"]
        for axis, degree in given.items():
            if isinstance(degree, bool) or not isinstance(degree, int) or (degree < 1 and degree != -1):
                raise GridError(f"degree of {axis} must be a positive integer or -1 (inferred), got {degree!r}")
        known = math.prod(d for a, d in given.items() if a not in inferred)
        if inferred:
            if self.world_size % known:
                raise GridError(f"cannot infer {inferred[0]}: {self._product_str(given, skip=inferred[0])} = {known} "
                                f"does not divide world size {self.world_size}{_what_fits(self.world_size, given)}")
            given[inferred[0]] = self.world_size // known
        total = math.prod(given.values())
        if total != self.world_size:
            raise GridError(f"{self._product_str(given)} = {total} != world size {self.world_size}")
        for axis, degree in given.items():
            object.__setattr__(self, axis, degree)
        strides, s = [], 1
        for axis in reversed(AXES):
            strides.append(s)
            s *= given[axis]
        object.__setattr__(self, "_strides", tuple(reversed(strides)))

    @staticmethod
    def _product_str(degrees: dict[str, int], skip: str | None = None) -> str:
        """``tp(3) * dp(1) * pp(2)``: innermost first; cp and ep only when not 1."""
        names = [a for a in reversed(AXES) if a != skip and (a in ("tp", "dp", "pp") or degrees[a] != 1)]
        return " * ".join(f"{a}({degrees[a]})" for a in names)

    @classmethod
    def from_degrees(cls, world_size: int, degrees: dict[str, int]) -> Layout:
        """Build from a mapping such as ``{"tp": 2, "pp": 2}``, rejecting unknown axis names."""
        _check_axes(degrees)
        return cls(world_size=world_size, **degrees)

    # -- shape --------------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axes of this layout, outermost first (``ep`` only when its degree is not 1)."""
        return tuple(a for a in AXES if a in CORE_AXES or getattr(self, a) != 1)

    @property
    def degrees(self) -> dict[str, int]:
        """``{"pp": .., "dp": .., "cp": .., "tp": ..}`` in :attr:`axis_names` order."""
        return {a: getattr(self, a) for a in self.axis_names}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degrees.values())

    def describe_degrees(self) -> str:
        return " x ".join(f"{a}({d})" for a, d in self.degrees.items())

    # -- ranks and coordinates ----------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} outside world size {self.world_size}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis of :attr:`axis_names`."""
        self._check_rank(rank)
        return {a: (rank // self._strides[AXES.index(a)]) % getattr(self, a) for a in self.axis_names}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes are 0)."""
        _check_axes(coords)
        rank = 0
        for axis, c in coords.items():
            if not 0 <= c < getattr(self, axis):
                raise GridError(f"coordinate {axis}={c} outside degree {getattr(self, axis)}")
            rank += c * self._strides[AXES.index(axis)]
        return rank

    # -- groups -------------------------------------------------------------------------------
    def _normalise(self, axes: str | Sequence[str]) -> tuple[str, ...]:
        names = _check_axes((axes,) if isinstance(axes, str) else axes)
        if not names:
            raise GridError("a group needs at least one axis")
        return tuple(a for a in AXES if a in names)  # outermost first, whatever order was given

    def group_array(self, axes: str | Sequence[str]) -> np.ndarray:
        """All groups over ``axes`` as an int array ``[n_groups, group_size]``, members ascending.

        A group is the set of ranks that differ only in their coordinates on ``axes``;
        e.g. ``("dp", "cp")`` gives the gradient-reduction groups. Vectorised: 100,000
        ranks take milliseconds.
        """
        names = self._normalise(axes)
        full = np.arange(self.world_size, dtype=np.int64).reshape([getattr(self, a) for a in AXES])
        inner = [AXES.index(a) for a in names]
        outer = [i for i in range(len(AXES)) if i not in inner]
        size = math.prod(getattr(self, a) for a in names)
        return full.transpose(outer + inner).reshape(-1, size)

    def groups(self, axes: str | Sequence[str]) -> list[list[int]]:
        """All groups over ``axes`` as lists of ranks, e.g. TP ``[[0, 1], [2, 3], ...]``."""
        return self.group_array(axes).tolist()

    def group_index(self, rank: int, axes: str | Sequence[str]) -> int:
        """Which group over ``axes`` holds ``rank`` (its row in :meth:`group_array`)."""
        names = self._normalise(axes)
        c = self.coords(rank)
        index = 0
        for axis in AXES:
            if axis not in names:
                index = index * getattr(self, axis) + c.get(axis, 0)
        return index

    def group_of(self, rank: int, axes: str | Sequence[str]) -> list[int]:
        """Members of the group over ``axes`` that holds ``rank``, without building all groups."""
        names = self._normalise(axes)
        c = self.coords(rank)
        base = rank - sum(c.get(a, 0) * self._strides[AXES.index(a)] for a in names)
        members = np.array([base], dtype=np.int64)
        for axis in names:  # outermost first keeps members ascending
            offsets = np.arange(getattr(self, axis), dtype=np.int64) * self._strides[AXES.index(axis)]
            members = (members[:, None] + offsets[None, :]).reshape(-1)
        return members.tolist()

    def to_dict(self) -> dict:
        """The JSON form printed by ``hpcml grid --json``."""
        return {
            "world_size": self.world_size,
            "axes": self.degrees,
            "groups": {a: self.groups(a) for a in self.axis_names},
        }
