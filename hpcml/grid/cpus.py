"""A rank's share of its host's CPUs: how many threads it takes, and whether to pin it.

Ranks that outnumber the CPUs they may all run on, unbound (``mpiexec -n 4`` on a 2-core
laptop or CI runner), lose whole seconds at a time: MPICH waits in a busy poll, each rank
sits in its own scheduler group (Hydra starts every rank in a session of its own, and Linux
autogroups by session), and gloo's per-group loop threads wake 100 times a second on any
CPU. The kernel then divides a rank's group weight across CPUs so that one spinning rank
holds a CPU while its runnable neighbour gets none -- an MPI_Comm_split took up to 37 s
instead of 20 ms (``benchmarks/oversubscribed.py``). A rank pinned to one CPU keeps its
whole weight there and the CPU is shared fairly, so such ranks are pinned round-robin
(``HPCML_CPU_BIND=none`` leaves them; binding at launch, ``mpiexec -bind-to core`` or
``srun --cpu-bind=cores``, makes this a no-op).

Only ranks in sessions of their own are pinned. Ranks that share a session are one group
and do not starve each other unpinned; pinned round-robin, a group split unevenly over the
CPUs does (srun starts a node's tasks in one session: two slurmd on one host, pinned, took
up to 250 s per checkpoint commit against 0.2-1.3 s unpinned, and 0.2 s pinned with a
session per rank). Pure functions: the grid gathers the views.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpcml.errors import GridError

POLICIES = ("auto", "none")


def bind_policy() -> str:
    """``HPCML_CPU_BIND``: ``auto`` (the default) pins oversubscribed unbound ranks, ``none`` never."""
    value = os.environ.get("HPCML_CPU_BIND", "auto").strip().lower() or "auto"
    if value not in POLICIES:
        raise GridError(f"HPCML_CPU_BIND={value!r}: expected one of {', '.join(POLICIES)}")
    return value


@dataclass(frozen=True, kw_only=True)
class CpuShare:
    cpus: tuple[int, ...]
    """The CPUs this rank runs on (its one CPU when pinned)."""
    sharers: int
    """Ranks of this host whose CPUs overlap this rank's, itself included."""
    pinned: bool
    """Whether this rank should be pinned to ``cpus``: it and its sharers were unbound and outnumber their CPUs."""


def share(me: int, views: list[tuple[str, list[int], int]], *, policy: str = "auto") -> CpuShare:
    """This rank's share, from every rank's ``(host name, CPUs, session id)`` of the same host
    communicator in rank order (``me`` indexes it). Every rank computes the same plan from the
    same views: no further communication. Pins only when all sharers have the same mask of
    several CPUs, outnumber it, and each is in a session of its own (a scheduler group of
    one); ranks bound at launch, partly overlapping, or sharing sessions are left as they are."""
    name, mine, _ = views[me]
    overlap = [r for r, (other, theirs, _) in enumerate(views) if other == name and set(mine) & set(theirs)]
    if (policy == "auto" and len(mine) > 1 and len(overlap) > len(mine)
            and all(sorted(views[r][1]) == sorted(mine) for r in overlap)
            and len({views[r][2] for r in overlap}) == len(overlap)):
        slot = overlap.index(me) % len(mine)
        return CpuShare(cpus=(sorted(mine)[slot],), pinned=True,
                        sharers=sum(1 for i in range(len(overlap)) if i % len(mine) == slot))
    return CpuShare(cpus=tuple(sorted(mine)), sharers=len(overlap), pinned=False)
