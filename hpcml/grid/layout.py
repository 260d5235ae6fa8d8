"""Pure layout arithmetic of the process grid: no MPI, no torch, any world size.

Two arrangements over the same ranks, Megatron-core's (``parallel_state.py``) "MoE parallel
folding":

* dense, outermost first ``pp, dp, cp, tp`` (Megatron's "tp-cp-dp-pp", first innermost):
  attention, embeddings, dense MLPs. ``dp = world / (pp*cp*tp)`` *includes* the ranks of
  ``ep``: expert parallelism does not shrink dense data parallelism.
* expert, outermost first ``pp, edp, ep, etp`` (Megatron's "tp-ep-dp-pp" of its expert
  rank generator): the experts of a MoE layer. ``etp`` (expert tensor parallel) defaults to
  ``tp`` and ``edp = world / (pp*ep*etp)``, so ``ep`` spans cp x dp.

The rank is the row-major index of its coordinates in either arrangement, so ``tp`` (and
``etp``) is innermost (neighbouring ranks, on one node) and ``pp`` outermost, with the same
``pp`` groups in both. The dense arrangement is ``init_device_mesh(..., ("pp", "dp", "cp", "tp"))``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpcml.errors import GridError
from hpcml.numeric import is_int

if TYPE_CHECKING:
    import numpy as np

#: Axes of the dense arrangement, outermost first.
DENSE_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
#: Axes of the expert arrangement, outermost first (``pp`` is shared).
EXPERT_AXES: tuple[str, ...] = ("pp", "edp", "ep", "etp")
#: Every axis the grid knows, in a canonical order (dense, then expert-only).
AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp", "edp", "ep", "etp")
#: Degrees a layout is built from (``edp`` is always derived).
DEGREE_AXES: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp", "etp")
#: Axes always shown (``ep``/``edp`` appear when ep is not 1, ``etp`` when it differs from tp).
CORE_AXES: tuple[str, ...] = DENSE_AXES


def _check_axes(names: Iterable[str], known: tuple[str, ...] = AXES) -> tuple[str, ...]:
    names = tuple(names)
    for name in names:
        if name not in known:
            raise GridError(f"unknown axis {name!r}: expected one of {', '.join(known)}")
    if len(set(names)) != len(names):
        raise GridError(f"axis named twice in {names}")
    return names


#: :func:`fitting_degrees` gives up (returns []) past this many candidate layouts, or on a
#: world size past 2^40 (its divisors take too long to list): a suggestion, never a hang.
MAX_FIT_OPTIONS = 4096
MAX_FIT_WORLD = 1 << 40


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (in O(sqrt n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def fitting_degrees(world_size: int, wanted: dict[str, int]) -> list[dict[str, int]]:
    """The largest model-parallel degrees (tp, cp, pp; each dividing the wanted one, dp left
    to take the rest) whose product divides ``world_size``: what a job that lost ranks can still run.

    Only divisors of ``gcd(wanted, world_size)`` can fit, so a huge wanted degree costs
    nothing (``tp=10**20`` once looped 10^20 times); [] when the search would be too large."""
    axes = [a for a in reversed(DENSE_AXES) if a != "dp" and wanted.get(a, 1) > 1]
    if not 1 <= world_size <= MAX_FIT_WORLD:
        return []
    options: list[dict[str, int]] = [{}]
    for a in axes:
        ds, grown = divisors(math.gcd(wanted[a], world_size)), []
        for o in options:
            known = math.prod(o.values(), start=1)
            grown += [{**o, a: d} for d in ds if world_size % (known * d) == 0]
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
    wanted = {a: d for a, d in given.items() if a in ("tp", "cp", "pp") and isinstance(d, int) and d > 1}
    need = math.prod(wanted.values(), start=1)
    if need == 1 or world_size < 1:
        return ""
    fits = [" * ".join(f"{a}({d})" for a, d in o.items() if d > 1) for o in fitting_degrees(world_size, wanted)]
    if not fits:  # too many to search: the multiple alone
        return f"; run on a multiple of {need} ranks"
    fit = f"only dp({world_size})" if fits == [""] else f"{', or '.join(fits)} (dp takes the rest)"
    return f"; {world_size} ranks fit {fit}, or run on a multiple of {need} ranks"


def _positive(axis: str, degree, allow_inferred: bool) -> None:
    if not is_int(degree) or (degree < 1 and not (allow_inferred and degree == -1)):
        raise GridError(f"degree of {axis} must be a positive integer" + (" or -1 (inferred)" if allow_inferred else "")
                        + f", got {degree!r}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Degrees of the parallel axes over ``world_size`` ranks.

    ``dp`` defaults to whatever is left (``world_size / (pp*cp*tp)``); any one of pp, dp,
    cp, tp may be ``-1`` to be inferred instead. ``ep`` folds over cp x dp (see the module
    docstring); ``etp`` defaults to ``tp``. ``repr()`` shows the resolved degrees and
    rebuilds the same layout.
    """

    world_size: int
    pp: int = 1
    """Pipeline-parallel stages."""
    dp: int | None = None
    """Data-parallel replicas of the dense weights (FSDP shards over this axis); None: inferred."""
    ep: int = 1
    """Expert-parallel degree: the experts of a MoE layer are split over ep ranks of cp x dp."""
    cp: int = 1
    """Context (sequence) parallel degree, Ulysses."""
    tp: int = 1
    """Tensor-parallel degree."""
    etp: int | None = None
    """Expert tensor-parallel degree; None: as tp (Megatron's default)."""
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or self.world_size < 1:
            raise GridError(f"world size must be a positive integer, got {self.world_size!r}")
        given = {a: getattr(self, a) for a in DENSE_AXES}
        inferred = [a for a, d in given.items() if d == -1]
        if len(inferred) > 1:
            raise GridError(f"only one axis degree may be -1 (inferred), got -1 for {' and '.join(inferred)}")
        if given["dp"] is None:
            given["dp"] = 1 if inferred else -1
            inferred = inferred or ["dp"]
        for axis, degree in given.items():
            _positive(axis, degree, allow_inferred=True)
        _positive("ep", self.ep, allow_inferred=False)
        if self.etp is not None:
            _positive("etp", self.etp, allow_inferred=False)
        known = math.prod(d for a, d in given.items() if a not in inferred)
        if inferred:
            if self.world_size % known:
                raise GridError(f"cannot infer {inferred[0]}: {self._product_str(given, skip=inferred[0])} = {known} "
                                f"does not divide world size {self.world_size}{_what_fits(self.world_size, given)}")
            given[inferred[0]] = self.world_size // known
        total = math.prod(given.values())
        if total != self.world_size:
            raise GridError(f"{self._product_str(given)} = {total} != world size {self.world_size}")
        etp = given["tp"] if self.etp is None else self.etp
        per_stage = self.world_size // given["pp"]
        if per_stage % (self.ep * etp):
            hint = (f"; ep must divide dp * cp = {given['dp'] * given['cp']}" if etp == given["tp"] else "")
            raise GridError(f"ep({self.ep}) * etp({etp}) = {self.ep * etp} does not divide the {per_stage} ranks of "
                            f"a pipeline stage (world size {self.world_size} / pp({given['pp']})){hint}")
        for axis, degree in given.items():
            object.__setattr__(self, axis, degree)
        object.__setattr__(self, "etp", etp)
        strides: dict[str, int] = {}
        for names in (DENSE_AXES, EXPERT_AXES):
            s = 1
            for axis in reversed(names):
                strides[axis] = s
                s *= getattr(self, axis)
        object.__setattr__(self, "_strides", strides)

    @staticmethod
    def _product_str(degrees: dict[str, int], skip: str | None = None) -> str:
        """``tp(3) * dp(1) * pp(2)``: innermost first; cp only when not 1."""
        names = [a for a in reversed(DENSE_AXES) if a != skip and (a != "cp" or degrees[a] != 1)]
        return " * ".join(f"{a}({degrees[a]})" for a in names)

    @classmethod
    def from_degrees(cls, world_size: int, degrees: dict[str, int]) -> Layout:
        """Build from a mapping such as ``{"tp": 2, "pp": 2}``, rejecting unknown axis names."""
        _check_axes(degrees, DEGREE_AXES)
        return cls(world_size=world_size, **degrees)

    # -- shape --------------------------------------------------------------------------------
    @property
    def edp(self) -> int:
        """Expert data parallel: replicas of each expert, ``world / (pp*ep*etp)``."""
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def moe(self) -> bool:
        """Whether the expert arrangement differs from the dense one (ep > 1 or etp != tp)."""
        return self.ep > 1 or self.etp != self.tp

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axes of this layout: the dense ones, then ``ep, edp`` (and ``etp`` when not tp) for MoE."""
        if not self.moe:
            return DENSE_AXES
        return DENSE_AXES + ("ep", "edp") + (("etp",) if self.etp != self.tp else ())

    @property
    def degrees(self) -> dict[str, int]:
        """``{"pp": .., "dp": .., "cp": .., "tp": ..}`` (plus ep, edp, etp for MoE) in :attr:`axis_names` order."""
        return {a: getattr(self, a) for a in self.axis_names}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of the dense DeviceMesh over :data:`DENSE_AXES`."""
        return tuple(getattr(self, a) for a in DENSE_AXES)

    @property
    def expert_mesh_shape(self) -> tuple[int, ...]:
        """Shape of the expert DeviceMesh over :data:`EXPERT_AXES` (the same ranks, row-major)."""
        return tuple(getattr(self, a) for a in EXPERT_AXES)

    def describe_degrees(self) -> str:
        return " x ".join(f"{a}({d})" for a, d in self.degrees.items())

    # -- ranks and coordinates ----------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} outside world size {self.world_size}")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis of :attr:`axis_names`."""
        self._check_rank(rank)
        return {a: (rank // self._strides[a]) % getattr(self, a) for a in self.axis_names}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates of one arrangement (missing axes are 0)."""
        self._arrangement(_check_axes(coords))  # one arrangement's coordinates
        rank = 0
        for axis, c in coords.items():
            if not 0 <= c < getattr(self, axis):
                raise GridError(f"coordinate {axis}={c} outside degree {getattr(self, axis)}")
            rank += c * self._strides[axis]
        return rank

    # -- groups -------------------------------------------------------------------------------
    @staticmethod
    def _arrangement(names: tuple[str, ...]) -> tuple[str, ...]:
        if all(a in DENSE_AXES for a in names):
            return DENSE_AXES
        if all(a in EXPERT_AXES for a in names):
            return EXPERT_AXES
        raise GridError(f"axes {', '.join(names)} mix the dense arrangement ({', '.join(DENSE_AXES)}) and the "
                        f"expert one ({', '.join(EXPERT_AXES)}): a group lies in one of them")

    def _normalise(self, axes: str | Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        names = _check_axes((axes,) if isinstance(axes, str) else axes)
        if not names:
            raise GridError("a group needs at least one axis")
        arrangement = self._arrangement(names)
        return tuple(a for a in arrangement if a in names), arrangement  # outermost first, whatever order was given

    def group_array(self, axes: str | Sequence[str]) -> np.ndarray:
        """All groups over ``axes`` as an int array ``[n_groups, group_size]``, members ascending.

        A group is the set of ranks that differ only in their coordinates on ``axes`` (of
        one arrangement); e.g. ``("dp", "cp")`` gives the gradient-reduction groups of the
        dense weights, ``"edp"`` those of the experts. Vectorised: 100,000 ranks take milliseconds.
        """
        import numpy as np  # (here: numpy took 0.4 s of every `hpcml plan` that only reads the degrees)

        names, arrangement = self._normalise(axes)
        full = np.arange(self.world_size, dtype=np.int64).reshape([getattr(self, a) for a in arrangement])
        inner = [arrangement.index(a) for a in names]
        outer = [i for i in range(len(arrangement)) if i not in inner]
        size = math.prod(getattr(self, a) for a in names)
        return full.transpose(outer + inner).reshape(-1, size)

    def groups(self, axes: str | Sequence[str]) -> list[list[int]]:
        """All groups over ``axes`` as lists of ranks, e.g. TP ``[[0, 1], [2, 3], ...]``."""
        return self.group_array(axes).tolist()

    def group_index(self, rank: int, axes: str | Sequence[str]) -> int:
        """Which group over ``axes`` holds ``rank`` (its row in :meth:`group_array`)."""
        names, arrangement = self._normalise(axes)
        self._check_rank(rank)
        index = 0
        for axis in arrangement:
            if axis not in names:
                index = index * getattr(self, axis) + (rank // self._strides[axis]) % getattr(self, axis)
        return index

    def group_of(self, rank: int, axes: str | Sequence[str]) -> list[int]:
        """Members of the group over ``axes`` that holds ``rank``, without building all groups."""
        import numpy as np

        names, _ = self._normalise(axes)
        self._check_rank(rank)
        base = rank - sum(((rank // self._strides[a]) % getattr(self, a)) * self._strides[a] for a in names)
        members = np.array([base], dtype=np.int64)
        for axis in names:  # outermost first keeps members ascending
            offsets = np.arange(getattr(self, axis), dtype=np.int64) * self._strides[axis]
            members = (members[:, None] + offsets[None, :]).reshape(-1)
        return members.tolist()

    def to_dict(self) -> dict:
        """The JSON form printed by ``hpcml grid --json``."""
        return {
            "world_size": self.world_size,
            "axes": self.degrees,
            "groups": {a: self.groups(a) for a in self.axis_names},
        }
