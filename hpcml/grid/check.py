"""Prove a grid by communicating on it: every group of every axis, in MPI and in torch."""

from __future__ import annotations

from dataclasses import dataclass

from hpcml.errors import LaunchError
from hpcml.grid.mpi import ProcessGrid


@dataclass(frozen=True, kw_only=True)
class GroupCheck:
    axes: tuple[str, ...]
    expected: int
    """Sum of the world ranks of this rank's group, from the layout."""
    mpi: int
    torch: int | None

    @property
    def ok(self) -> bool:
        return self.mpi == self.expected and self.torch in (None, self.expected)


def check_grid(grid: ProcessGrid) -> list[GroupCheck]:
    """All-reduce the world rank over each group in MPI (and torch, once initialised).

    Each sum must equal the sum of the members the layout names, so a group that holds
    the wrong ranks, or cannot communicate, shows. Returns this rank's results; raises
    :class:`LaunchError` on every rank if any rank saw a mismatch.
    """
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    results = []
    for key in grid._comms:
        expected = sum(grid.group(key))
        mpi_sum = grid.comm_for(key).allreduce(grid.rank, op=MPI.SUM)
        torch_sum = None
        if grid.torch is not None and len(key) == 1:
            t = torch.tensor([grid.rank], dtype=torch.int64, device=grid.torch.device)
            mesh = grid.torch.mesh if key[0] in grid.torch.mesh.mesh_dim_names else grid.torch.expert_mesh
            dist.all_reduce(t, group=mesh.get_group(key[0]))
            torch_sum = int(t.item())
        results.append(GroupCheck(axes=key, expected=expected, mpi=mpi_sum, torch=torch_sum))
    if grid.pop > 1:  # the ranks at this place in every member, in world ranks
        me = grid.global_rank(grid.rank)
        torch_sum = None
        if grid.torch is not None:
            t = torch.tensor([me], dtype=torch.int64, device=grid.torch.device)
            dist.all_reduce(t, group=grid.torch.pop_group)
            torch_sum = int(t.item())
        results.append(GroupCheck(axes=("pop",), expected=sum(grid.torch_rank_of(m) for m in range(grid.pop)),
                                  mpi=grid.pop_comm.allreduce(me, op=MPI.SUM), torch=torch_sum))
    bad = [r for r in results if not r.ok]
    n_bad = grid.world_comm.allreduce(len(bad), op=MPI.SUM)
    if n_bad:
        detail = f"; here: {bad}" if bad else ""
        raise LaunchError(f"grid check failed: {n_bad} group(s) disagree with the layout{detail}")
    return results
