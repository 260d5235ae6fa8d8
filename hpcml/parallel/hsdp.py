"""Data parallelism that knows the nodes: hybrid sharding (HSDP), ZeRO++'s hpZ, and the bytes
FSDP's collectives send inside and across nodes.

At the node counts of Frontier or Aurora, FSDP over every data rank all-gathers each block's
weights across the slow inter-node network twice a micro-batch and reduce-scatters its
gradients once a micro-batch (once a step with ``grad_sync="step"``). HSDP (torch's, FSDP2 on a
2-D mesh) shards inside a replica -- consecutive data ranks, a node's when the node map allows --
and all-reduces gradients across replicas: one crossing a gradient reduction. hpZ keeps FSDP's one
shard over every rank but, after forward, a second copy of the weights sharded over the node's
ranks only (``reshard_after_forward=`` the node's data ranks), so backward gathers inside the node.

:class:`CommBytes` wraps FSDP2's all-gather and reduce-scatter (its custom-collective hooks) and
counts the bytes this rank sends to ranks of its own node and of other nodes, as each
collective's direct algorithm sends them: an all-gather of ``b`` bytes a rank sends ``b`` to
every other rank of the group, a reduce-scatter to ``b``-byte shards sends every other rank
its shard, an all-reduce of ``B`` bytes over ``n`` ranks sends ``2 B / n`` to each (reduce-scatter
then all-gather). HSDP's all-reduce across replicas is FSDP's own; it is counted by FSDP's hook
after it (``set_all_reduce_hook``), from the tensor it reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.grid.torch_dist import default_group_key

if TYPE_CHECKING:
    from hpcml.grid.mpi import ProcessGrid
    from hpcml.parallel.config import ParallelConfig

logger = log.get_logger(__name__)

_MESHES: dict[tuple, HybridMeshes] = {}


def data_group(grid: ProcessGrid) -> list[int]:
    """This rank's data-parallel group (dp x cp, dp outer) as member-local ranks, in mesh order."""
    return grid.layout.group_of(grid.rank, ("dp", "cp"))


def _blocks_on_nodes(grid: ProcessGrid, ranks: list[int], size: int) -> bool:
    """Whether every block of ``size`` consecutive ``ranks`` lies on one node."""
    return all(len({grid.node_names[r] for r in ranks[i:i + size]}) == 1 for i in range(0, len(ranks), size))


def node_blocks(grid: ProcessGrid, what: str) -> int:
    """The data ranks a node holds of every data group, when every group lies in equal
    consecutive blocks, one per node; else a ConfigError naming ``what`` and the first group
    that does not. Every group is looked at, so every rank decides alike."""
    size = None
    for ranks in grid.layout.groups(("dp", "cp")):
        per = sum(grid.node_names[r] == grid.node_names[ranks[0]] for r in ranks)
        blocks = [ranks[i:i + per] for i in range(0, len(ranks), per)]
        if len(ranks) % per or not _blocks_on_nodes(grid, ranks, per) or size not in (None, per) \
                or len({grid.node_names[b[0]] for b in blocks}) != len(blocks):
            raise ConfigError(f"{what}: the data ranks {ranks} lie on nodes {[grid.node_names[r] for r in ranks]}, "
                              f"not in equal consecutive blocks, one per node (as every data group's); launch the "
                              f"same ranks per node")
        size = per
    return size


def one_layout(grid: ProcessGrid, what: str) -> None:
    """Refuse ``what`` for a population whose members differ in layout (its groups are made per layout)."""
    if len(set(grid.member_layouts)) > 1:
        raise ConfigError(f"{what} with members of different layouts: give every member one layout")


def replicas(grid: ProcessGrid, config: ParallelConfig) -> int:
    """HSDP's number of replicas for ``config.dp_replicate`` on this grid (1: plain FSDP).
    Pure arithmetic on the node map every rank holds alike: raised before any collective."""
    lay, want = grid.layout, config.dp_replicate
    if want == 1 or not config.fsdp:
        return 1
    one_layout(grid, f"dp_replicate {want!r}")
    ranks = data_group(grid)
    if want == "node":
        want = len(ranks) // node_blocks(grid, "dp_replicate 'node'")
        if want == 1:
            logger.info("dp_replicate 'node': every data rank on one node, so one replica: plain FSDP")
    if lay.dp % want:
        raise ConfigError(f"dp_replicate {want} does not divide dp {lay.dp}: each replica takes dp / dp_replicate "
                          f"of the data ranks (cp stays inside the replica)")
    if lay.moe and want > 1:
        raise ConfigError(f"dp_replicate {want} with expert parallelism (ep {lay.ep}): the experts' FSDP over edp "
                          f"has no hybrid form yet; use dp_replicate 1 or ep 1")
    if want > 1 and not _blocks_on_nodes(grid, ranks, len(ranks) // want):
        logger.warning("dp_replicate %d: a replica's %d data ranks span nodes; its shard collectives cross the "
                       "network", want, len(ranks) // want)
    return want


def hpz_size(grid: ProcessGrid, config: ParallelConfig) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for ``config``: the data ranks of a node under hpZ."""
    if not config.hpz:
        return config.reshard_after_forward
    lay = grid.layout
    if lay.tp * lay.pp * grid.pop > 1:
        raise ConfigError(f"hpz with tp {lay.tp}, pp {lay.pp}, pop {grid.pop}: torch's hpZ (FSDP2's "
                          f"reshard_after_forward=N) makes each data group's node groups on that group's ranks "
                          f"alone, and with {lay.tp * lay.pp * grid.pop} data groups the ranks' group calls "
                          f"disagree (a hang); use hpz with tp 1, pp 1 and one member, or dp_replicate (HSDP), "
                          f"or qwz/qgz without hpz")
    ranks = data_group(grid)
    here = node_blocks(grid, "hpz")
    if here == len(ranks):
        logger.info("hpz: every data rank on one node; the secondary shard is FSDP's own")
        return True
    if here == 1:
        raise ConfigError(f"hpz with one data rank per node ({len(ranks)} nodes): its secondary shard would be the "
                          f"whole model on every rank; use FSDP without hpz, or more ranks per node")
    return here


@dataclass(frozen=True)
class HybridMeshes:
    """HSDP's meshes, slices of one root (FSDP2 composes tp with its 2-D mesh only on one root)."""

    fsdp: DeviceMesh
    """(dp_replicate, dp_shard): replicas outer, each sharding over its consecutive dp x cp ranks."""
    data: DeviceMesh
    """The same ranks flattened: every data rank (dp x cp), as :func:`hpcml.parallel.api.dp_mesh`."""
    tp: DeviceMesh


def hybrid_meshes(grid: ProcessGrid, n_replicas: int) -> HybridMeshes:
    """The dense ranks as ``pp, dp_replicate, dp_shard, tp`` (``dp_shard`` spans the replica's
    dp ranks and cp, which lie consecutive between them). Built on every rank in one order,
    once per layout (a mesh's groups cost collectives)."""
    lay, pop, device_type = grid.layout, grid.pop, grid.torch.device.type
    key = (device_type, lay.mesh_shape, pop, n_replicas, default_group_key())
    if key not in _MESHES:
        pp, dp, cp, tp = lay.mesh_shape
        names = ("pp", "dp_replicate", "dp_shard", "tp")
        ranks = torch.arange(pop * lay.world_size).reshape(pop, pp, n_replicas, dp // n_replicas * cp, tp)
        root = DeviceMesh(device_type, ranks, mesh_dim_names=("pop", *names))[names]
        fsdp = root["dp_replicate", "dp_shard"]
        _MESHES[key] = HybridMeshes(fsdp=fsdp, data=fsdp._flatten("dp_cp_hsdp"), tp=root["tp"])
    return _MESHES[key]


class CommBytes:
    """Bytes this rank's FSDP collectives sent, to ranks of its node and of other nodes."""

    def __init__(self, grid: ProcessGrid) -> None:
        self._node = {grid.global_rank(r): n for r, n in enumerate(grid.node_names)}
        self._mine = grid.node_names[grid.rank]
        self._split: dict[int, tuple[int, int]] = {}
        self.intra = self.inter = 0
        self.replicate_group = None
        """HSDP's group across replicas, over which FSDP all-reduces each reduce-scatter's output."""

    def _peers(self, group) -> tuple[int, int]:
        """(other ranks of ``group`` on this node, ranks on other nodes)."""
        key = id(group)
        if key not in self._split:
            nodes = [self._node[r] for r in dist.get_process_group_ranks(group)]
            same = sum(n == self._mine for n in nodes)
            self._split[key] = (same - 1, len(nodes) - same)
        return self._split[key]

    def count(self, group, per_peer: int) -> None:
        """``per_peer`` bytes sent to every other rank of ``group``."""
        same, other = self._peers(group)
        self.intra += per_peer * same
        self.inter += per_peer * other

    def all_reduced(self, t: torch.Tensor) -> None:
        """FSDP's all-reduce hook under HSDP: ``t`` was just all-reduced over the replicas."""
        n = dist.get_world_size(self.replicate_group)
        self.count(self.replicate_group, 2 * t.numel() * t.element_size() // n)

    def take(self) -> dict[str, int]:
        """The counts since the last call (a step's)."""
        out = {"dp_bytes_intra_node": self.intra, "dp_bytes_inter_node": self.inter}
        self.intra = self.inter = 0
        return out


class _Counted:
    """What both counted collectives share: the counter, and buffers from torch's allocator."""

    def __init__(self, counter: CommBytes) -> None:
        self.counter = counter

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountingAllGather(_Counted, AllGather):
    """FSDP2's all-gather, counted."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.count(group, input_tensor.numel() * input_tensor.element_size())
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(_Counted, ReduceScatter):
    """FSDP2's reduce-scatter, counted."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.count(group, output_tensor.numel() * output_tensor.element_size())
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def install(modules: list[torch.nn.Module], gather: AllGather, scatter: ReduceScatter, counter: CommBytes,
            replicate_group=None) -> None:
    """Every FSDP2 module in ``modules`` all-gathers and reduce-scatters through ``gather`` and
    ``scatter`` (counted); under HSDP ``counter`` counts the all-reduce across replicas too."""
    counter.replicate_group = replicate_group
    for part in modules:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
                if replicate_group is not None:
                    m.set_all_reduce_hook(counter.all_reduced)
