"""The process grid on an MPI communicator: sub-communicators per axis, node map, abort.

Every argument is validated (by :class:`~hpcml.grid.layout.Layout`) on every rank, and the
first collective is one allgather of every rank's resolved arguments (with its node name):
a bad layout on any rank, or arguments that differ between ranks, raise the same one-line
GridError everywhere -- no inconsistent groups, no Split that some rank never calls.

``pop=K`` (outermost) splits the ranks into K members of equal size, each a grid of its own
(LBANN's trainers of a tournament): ``grid.comm`` is then the member's communicator and
``grid.pop_comm`` joins the ranks at the same place in every member.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hpcml import env, log, waiting
from hpcml.errors import GridError
from hpcml.grid import cpus
from hpcml.grid.layout import AXES, Layout
from hpcml.numeric import is_int

if TYPE_CHECKING:
    from mpi4py import MPI

    from hpcml.grid.torch_dist import TorchDist

logger = log.get_logger(__name__)

#: Combined axes built by default: dp x cp is the gradient-reduction group.
DEFAULT_COMBOS: tuple[tuple[str, ...], ...] = (("dp", "cp"),)
_PIN_LOGGED = False  # the pinning is told once per process


def world_comm() -> MPI.Comm:
    from mpi4py import MPI

    return MPI.COMM_WORLD


def install_abort_handler(comm: MPI.Comm | None = None) -> None:
    """On an unhandled exception print it, then ``Abort`` the communicator.

    Without this a rank that raises exits alone while the others wait in their next
    collective for ever (mpi4py's ``python -m mpi4py`` does the same).
    """
    comm = comm if comm is not None else world_comm()
    previous = sys.excepthook

    def _hook(exc_type, exc, tb) -> None:
        if comm.Get_size() == 1:
            return previous(exc_type, exc, tb)
        # The real stderr, not sys.stderr: torch.distributed's excepthook (installed later by
        # init_process_group) points sys.stderr at a buffer it writes out only after this hook
        # returns -- and Abort never returns, so the traceback would be lost.
        out = sys.__stderr__ or sys.stderr
        lines = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n").split("\n")
        out.write("".join(f"[rank {comm.Get_rank()}] {line}\n" for line in lines))
        out.flush()
        time.sleep(0.5)  # let the launcher forward the traceback before Abort tears the job down
        comm.Abort(1)

    sys.excepthook = _hook


def _combo_key(axes: str | Sequence[str]) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for n in names:
        if n not in AXES:
            raise GridError(f"unknown axis {n!r}: expected one of {', '.join(AXES)}")
    if not names:
        raise GridError("an empty combination of axes in combos: expected one or more of " + ", ".join(AXES))
    return tuple(a for a in AXES if a in names)


def _ranks(ranks: list[int]) -> str:
    """``0``, ``1-3``, ``0, 2, 5``: a short rank list for a message."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def agree(problems: list[str | None], choices: list, *, where: str, differ: str, what: str,
          error: type[Exception] = GridError, differ_error: type[Exception] | None = None) -> None:
    """Raise the same one-line error on every rank (each holds every rank's view, gathered):
    a problem some rank found (the message itself when every rank found the same one), else
    ``choices`` that differ across ranks. ``where`` heads a problem ("X on rank 3: ..."),
    ``differ`` and ``what`` the differing message ("Y differ across ranks: ...; every rank must ...")."""
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if found and len(found) == len(problems) and len({p for _, p in found}) == 1:
        raise error(found[0][1])  # the same mistake everywhere: its own message
    if found:
        (r, p), others = found[0], [q for q, _ in found[1:]]
        raise error(f"{where} on rank {r}: {p}" + (f" (and on rank(s) {_ranks(others)})" if others else ""))
    groups: dict[object, list[int]] = {}
    for r, c in enumerate(choices):
        groups.setdefault(c, []).append(r)
    if len(groups) > 1:
        told = "; ".join(f"rank(s) {_ranks(rs)} {c}" for c, rs in groups.items())
        raise (differ_error or error)(f"{differ} differ across ranks: {told}; {what}")


def check_pop(pop: int, world_size: int) -> int:
    """The population size, checked against the ranks (no communication)."""
    if not is_int(pop) or pop < 1:
        raise GridError(f"pop {pop!r}: expected a positive whole number of population members")
    if world_size % pop:
        raise GridError(f"pop {pop} does not divide {world_size} ranks: every member needs as many ranks")
    return pop


def _not_degrees(m) -> Layout:
    raise GridError(f"members entry {m!r}: expected degrees such as {{'tp': 2}}")


def _agree(views: list[tuple[str | None, str | None]]) -> None:
    """Every rank's ``(arguments, problem)``: the same GridError on every rank unless all agree."""
    agree([p for _, p in views], [f"gave {m}" for m, _ in views], where="ProcessGrid arguments",
          differ="ProcessGrid arguments", what="every rank must pass the same degrees and combos")


class ProcessGrid:
    """Named parallel axes over the ranks of an MPI communicator.

    ``ProcessGrid(tp=2, pp=2)`` on 8 ranks gives dp 2 and one sub-communicator per axis
    (``grid.comm_for("tp")``) and per combination in ``combos``. A rank's node is the
    launcher's name for it (:func:`hpcml.env.detect`: Slurm's node, else the host name), so
    two Slurm nodes on one host are two nodes; ``node_name`` overrides it (tests).
    """

    def __init__(self, layout: Layout | None = None, *, comm: MPI.Comm | None = None,
                 combos: Iterable[Sequence[str]] = DEFAULT_COMBOS, node_name: str | None = None, pop: int = 1,
                 members: Sequence[Mapping[str, int]] | None = None, **degrees: int) -> None:
        from mpi4py import MPI

        self.world_comm = comm if comm is not None else MPI.COMM_WORLD
        """Every rank of the job; ``comm`` is this rank's member of the population (the same without ``pop``)."""
        world_rank, world_size = self.world_comm.Get_rank(), self.world_comm.Get_size()
        self.rank, self.world_size, self.pop = world_rank, world_size, 1
        log.configure(world_rank)
        try:
            self.pop = check_pop(len(members) if members is not None and pop == 1 else pop, world_size)
            self.world_size = world_size // self.pop  # a member's ranks: the layout's world
            self.rank = world_rank % self.world_size
            self.member_layouts = self._member_layouts(members, layout, degrees)
            layout, wanted = self._resolve(self.member_layouts[world_rank // self.world_size], combos, {})
            self._cpu_bind = cpus.bind_policy()
            shown = (f"members {[m.describe_degrees() for m in self.member_layouts]}" if members is not None
                     else layout.describe_degrees())
            mine, problem = f"{shown}, combos {[list(k) for k in wanted[len(layout.axis_names):]]}", None
            mine += f", pop {self.pop}" if self.pop > 1 else ""
        except Exception as e:  # any bad argument (a str for a Layout...): still reach the allgather
            text = " ".join(str(e).split())  # one line, whatever the exception said
            mine, problem = None, text if isinstance(e, GridError) else f"{type(e).__name__}: {text}"
        # -- the first collective: every rank's arguments and node, so that all raise the same
        # error or none does (one allgather; a rank-dependent argument would otherwise build
        # inconsistent groups or hang in a Split some rank never calls), waited for without
        # spinning: ranks import torch and friends at their own pace
        views = waiting.allgather(self.world_comm, (mine, problem, node_name or env.detect().node))
        _agree([(m, p) for m, p, _ in views])
        self.member = world_rank // self.world_size
        """This rank's member of the population (0 without ``pop``)."""
        self.world_node_names: list[str] = [n for _, _, n in views]
        first = self.member * self.world_size
        self.node_names: list[str] = self.world_node_names[first:first + self.world_size]
        self.comm = self.world_comm if self.pop == 1 else self.world_comm.Split(color=self.member, key=world_rank)
        self.pop_comm = MPI.COMM_SELF if self.pop == 1 else self.world_comm.Split(color=self.rank, key=world_rank)
        """The ranks at this rank's place in every member, ordered by member: a tournament's exchanges."""
        self.layout = layout
        self.coords = layout.coords(self.rank)
        #: CPUs this rank may run on, and how many ranks of this host share any of them.
        self.cpus, self.cpu_sharers = self._cpu_sharing()
        self._comms: dict[tuple[str, ...], MPI.Comm] = {}
        for key in dict.fromkeys(wanted):
            self._comms[key] = self.comm.Split(color=layout.group_index(self.rank, key), key=self.rank)
        self.torch: TorchDist | None = None
        self._warn_spanning_tp()

    def global_rank(self, rank: int) -> int:
        """The rank in ``world_comm`` (and in torch.distributed) of this member's ``rank``."""
        return self.member * self.world_size + rank

    def torch_rank_of(self, member: int) -> int:
        """The rank in ``world_comm`` (and torch.distributed) at this rank's place in ``member``."""
        return member * self.world_size + self.rank

    def _member_layouts(self, members, layout: Layout | None, degrees: dict[str, int]) -> list[Layout]:
        """Every member's layout (no communication): one per entry of ``members``, or this one for all."""
        if members is None:
            return [self._resolve(layout, (), degrees)[0]] * self.pop
        if layout is not None or degrees:
            raise GridError(f"give either members or a layout and degrees, not both (got members and "
                            f"{'a layout' if layout is not None else sorted(degrees)})")
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or len(members) != self.pop:
            raise GridError(f"members {members!r}: expected a list of {self.pop} degree mappings, one a member")
        return [Layout.from_degrees(self.world_size, dict(m)) if isinstance(m, Mapping) else _not_degrees(m)
                for m in members]

    def _resolve(self, layout: Layout | None, combos, degrees: dict[str, int]) -> tuple[Layout, list[tuple[str, ...]]]:
        """The layout and the groups to build, from this rank's arguments (no communication):
        the axes, then the other combinations in a canonical order (the same set given in any
        order, or with repeats, builds the same Splits in the same order on every rank)."""
        if layout is None:
            layout = Layout.from_degrees(self.world_size, degrees)
        elif degrees:
            raise GridError(f"give either a layout or degrees, not both (got {sorted(degrees)})")
        elif not isinstance(layout, Layout):
            raise GridError(f"layout {layout!r}: expected a Layout (hpcml.grid.Layout) or degrees such as tp=2")
        if layout.world_size != self.world_size:
            where = f"each of the {self.pop} population members has" if self.pop > 1 else "the communicator has"
            raise GridError(f"layout is for world size {layout.world_size} but {where} {self.world_size}")
        axes = [(a,) for a in layout.axis_names]
        extra = {_combo_key(c) for c in combos} - set(axes)
        for key in extra:
            layout.group_index(0, key)  # a combination mixing dense and expert axes fails here, on every rank
        return layout, axes + sorted(extra, key=lambda k: [AXES.index(a) for a in k])

    def _cpu_sharing(self) -> tuple[int, int]:
        """This rank's CPUs, and the ranks of its host whose CPUs overlap them; an unbound rank
        that, with its sharers, outnumbers its CPUs is pinned to one (:mod:`hpcml.grid.cpus`).
        Masks are exchanged within a host only, a few hundred ranks at most at any scale.

        The host is the kernel's host name, not MPI's shared-memory domain: under a launcher
        that reports several logical nodes on one machine (two slurmd on one host, srun's
        PMI node ids) MPI counts them apart, and each rank would take every core."""
        import zlib

        mask = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        name = socket.gethostname()
        host = self.world_comm.Split(color=zlib.crc32(name.encode()) & 0x7FFFFFFF, key=self.world_comm.Get_rank())
        try:  # a crc collision is not the same host: share() compares the names
            me, views = host.Get_rank(), host.allgather((name, mask, os.getsid(0)))
        finally:
            host.Free()
        # The session is the scheduler group (autogroup): ranks that share one (srun's tasks of
        # a node) are left unpinned, where pinning split their group unevenly over the CPUs.
        plan = cpus.share(me, views, policy=self._cpu_bind)
        if plan.pinned:
            try:
                os.sched_setaffinity(0, plan.cpus)  # this thread; threads started later (gloo's) inherit it
            except OSError as e:  # a sandbox that forbids it: run unpinned, as before
                logger.warning("could not pin rank %d to CPU %s (%s): it stays on CPUs %s",
                               self.rank, plan.cpus, e, mask)
                plan = cpus.share(me, views, policy="none")
            else:
                self._log_pinning(me, views)
        return len(plan.cpus), plan.sharers

    @staticmethod
    def _log_pinning(me: int, views: list[tuple[str, list[int], int]]) -> None:
        global _PIN_LOGGED
        name, mask, _ = views[me]
        if me == 0 and not _PIN_LOGGED:
            _PIN_LOGGED = True
            logger.info("%d unbound ranks share %d CPUs on %s: each pinned to one CPU, round-robin, so none "
                        "starves while another spins (HPCML_CPU_BIND=none leaves them; mpiexec -bind-to core "
                        "or srun --cpu-bind=cores binds at launch)",
                        sum(1 for n, m, _ in views if (n, m) == (name, mask)),
                        len(mask), name)

    # -- node map -----------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        """Distinct node names in order of first rank."""
        return list(dict.fromkeys(self.node_names))

    def node_of(self, rank: int) -> int:
        return self.nodes.index(self.node_names[rank])

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def local_ranks(self) -> list[int]:
        """Ranks on this rank's node."""
        return [r for r, n in enumerate(self.node_names) if n == self.node_names[self.rank]]

    @property
    def local_rank(self) -> int:
        return self.local_ranks().index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks())

    @property
    def threads_per_rank(self) -> int:
        """CPU threads a rank should use: its CPUs over the ranks of this host that share them.

        Slurm's ``srun`` tells a process nothing of its neighbours (MPICH's ``mpiexec`` sets
        ``MPI_LOCALNRANKS``, which torch's OpenMP reads), so without this every rank starts
        a thread per core and 4 ranks on 2 cores ran 5x slower. Counted by host, not by
        node name (two Slurm nodes may share a host), and by overlapping affinity (ranks
        bound to their own cores, ``srun -c7``, keep them all).
        """
        return max(1, self.cpus // max(1, self.cpu_sharers))

    def _warn_spanning_tp(self) -> None:
        spanning = [g for g in self.layout.groups("tp") if len({self.node_names[r] for r in g}) > 1]
        if spanning and self.rank == 0:
            logger.warning("%d of %d tp groups span nodes (e.g. ranks %s): tensor-parallel traffic will "
                           "cross the network; put tp within a node", len(spanning),
                           len(self.layout.groups("tp")), spanning[0])

    # -- groups -------------------------------------------------------------------------------
    def comm_for(self, axes: str | Sequence[str]) -> MPI.Comm:
        """The sub-communicator of this rank's group over ``axes`` (built at construction)."""
        key = _combo_key(axes)
        if key not in self._comms:
            raise GridError(f"no communicator for axes {key}: pass combos=[{key}] to ProcessGrid")
        return self._comms[key]

    def group(self, axes: str | Sequence[str]) -> list[int]:
        """World ranks of this rank's group over ``axes``."""
        return self.layout.group_of(self.rank, axes)

    def comm_ranks(self, axes: str | Sequence[str]) -> list[int]:
        """World ranks of the MPI sub-communicator, as MPI itself maps them."""
        sub = self.comm_for(axes)
        return list(sub.Get_group().Translate_ranks(list(range(sub.Get_size())), self.comm.Get_group()))

    def axis_size(self, axis: str) -> int:
        return getattr(self.layout, axis)

    # -- torch ----------------------------------------------------------------------------------
    def init_torch(self, **kwargs: Any) -> TorchDist:
        """Bootstrap torch.distributed from this grid (see :func:`hpcml.grid.torch_dist.init`)."""
        from hpcml.grid import torch_dist

        if self.torch is None:
            self.torch = torch_dist.init(self, **kwargs)
        return self.torch

    # -- display --------------------------------------------------------------------------------
    def describe(self, max_rows: int = 32) -> str:
        """A readable table: the layout, one row per rank (first ``max_rows``), the groups."""
        lay = self.layout
        device = self.torch.device_names if self.torch is not None else None
        backend = self.torch.backend if self.torch is not None else "none (MPI only)"
        lines = [f"ProcessGrid: {lay.world_size} ranks = {lay.describe_degrees()} on {len(self.nodes)} node(s); "
                 f"torch backend {backend}"]
        if self.pop > 1:
            lines.append(f"population: {self.pop} members of {lay.world_size} ranks (world ranks "
                         f"{self.global_rank(0)}-{self.global_rank(lay.world_size - 1)} are member {self.member}, "
                         f"shown below by their rank in it)")
        head = ["rank", "node", "local"] + list(lay.axis_names) + (["device"] if device else [])
        rows = []
        for r in range(min(lay.world_size, max_rows)):
            c = lay.coords(r)
            row = [str(r), self.node_names[r], str(self.node_names[:r].count(self.node_names[r]))]
            row += [str(c[a]) for a in lay.axis_names] + ([device[r]] if device else [])
            rows.append(row)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
        lines += [fmt(head)] + [fmt(row) for row in rows]
        if lay.world_size > max_rows:
            lines.append(f"... {lay.world_size - max_rows} more ranks")
        lines.append("groups:")
        for key in self._comms:
            groups = lay.groups(key)
            shown = str(groups if len(groups) <= 8 else groups[:8])[:-1] + (", ...]" if len(groups) > 8 else "]")
            lines.append(f"  {' x '.join(key)}: {shown}")
        return "\n".join(lines)

    def free(self) -> None:
        """Release the sub-communicators (collective)."""
        for sub in self._comms.values():
            sub.Free()
        self._comms.clear()
        if self.pop > 1:
            self.pop_comm.Free()
            self.comm.Free()

    def __repr__(self) -> str:
        member = f", member={self.member} of {self.pop}" if self.pop > 1 else ""
        return f"ProcessGrid({self.layout!r}, rank={self.rank}{member})"
