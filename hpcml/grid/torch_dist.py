"""torch.distributed bootstrapped from MPI, without torchrun.

Rank and world size come from MPI. Rank 0 picks its address (on a chosen network
interface, e.g. Frontier's ``hsn0``) and a free port and broadcasts them by MPI; every rank
then joins the TCP rendezvous. Backend: gloo on CPU, nccl on NVIDIA (RCCL on ROCm builds),
xccl on Intel GPUs; the device is ``local_rank % device_count`` (or ``HPCML_GPU_MAP``) and is passed as
``device_id`` so NCCL binds eagerly (without it FSDP2 has deadlocked on Aurora).

Environment overrides: ``HPCML_MASTER_ADDR``, ``HPCML_MASTER_PORT``, ``HPCML_SOCKET_IFNAME``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpcml import env, log, waiting
from hpcml.errors import ConfigError, LaunchError
from hpcml.grid.layout import DENSE_AXES, EXPERT_AXES
from hpcml.net import interface_address

if TYPE_CHECKING:
    from hpcml.grid.mpi import ProcessGrid

logger = log.get_logger(__name__)

_MESHES: dict[tuple, DeviceMesh] = {}


@dataclass(kw_only=True)
class TorchDist:
    """What the bootstrap set up: backend, this rank's device, the mesh, every rank's device."""

    backend: str
    device: torch.device
    mesh: DeviceMesh
    """The dense mesh, axes ``pp, dp, cp, tp`` (of this rank's member of a population)."""
    expert_mesh: DeviceMesh | None
    """The expert mesh over the same ranks, axes ``pp, edp, ep, etp`` (None without MoE axes)."""
    group: Any = None
    """The process group of every rank of this member: None (the default group) without a population."""
    pop_group: Any = None
    """With a population: the ranks at this rank's place in every member (``ProcessGrid.pop_comm``)."""
    device_names: list[str]
    master_addr: str
    master_port: int


def default_backend() -> tuple[str, str]:
    """``(backend, device_type)`` for the accelerators torch sees here."""
    if torch.cuda.is_available():  # ROCm builds answer here too and map nccl onto RCCL
        return "nccl", "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xccl", "xpu"
    return "gloo", "cpu"


def _pick_address(grid: ProcessGrid, interface: str | None) -> tuple[str, int]:
    """Run on rank 0 only: address and port for the rendezvous (port 0: the store picks one)."""
    addr = os.environ.get("HPCML_MASTER_ADDR")
    if addr is None:
        if interface:
            addr = interface_address(interface)
        elif len(set(grid.world_node_names)) == 1:
            addr = "127.0.0.1"  # one node: stay on loopback
        else:
            addr = socket.gethostbyname(socket.gethostname())
    return addr, int(os.environ.get("HPCML_MASTER_PORT", 0))


def _store(addr: str, port: int, world_size: int, master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens before any rank is told the port (a port picked
    free, released and bound again later can be taken in between by another process on the
    node: EADDRINUSE, seen in CI), the others connect to it."""
    return dist.TCPStore(addr, port, world_size, is_master=master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True)


def available_backends() -> list[str]:
    """The torch.distributed backends this torch build has (nccl only on a CUDA build)."""
    return [b for b in ("gloo", "nccl", "mpi", "ucc", "xccl") if getattr(dist, f"is_{b}_available", lambda: False)()]


def check_backend(backend: str) -> None:
    """Raise ConfigError unless this torch build has ``backend`` (torch's own errors are an
    AssertionError or a RuntimeError traceback, on one rank while the others wait)."""
    have = available_backends()
    if backend not in have:
        raise ConfigError(f"backend {backend!r}: this torch build has {', '.join(have) or 'no backend'}"
                          + (" (nccl needs a CUDA build of torch and a GPU)" if backend == "nccl" else ""))


def _setup(grid: ProcessGrid, backend: str | None, interface: str | None) -> tuple[str, torch.device, tuple | None]:
    """This rank's backend, device and existing process group (rank, size), and rank 0's
    rendezvous address: local work only, any error raised here is told to every rank."""
    auto_backend, device_type = default_backend()
    backend = backend or auto_backend
    if not isinstance(backend, str):
        raise ConfigError(f"backend {backend!r}: expected a name such as gloo or nccl")
    check_backend(backend)
    if backend == "gloo":
        device_type = "cpu"
    if "OMP_NUM_THREADS" not in os.environ:  # the user's choice wins; else share this host's cores
        torch.set_num_threads(grid.threads_per_rank)
    if interface and backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        module = getattr(torch, device_type)
        device = torch.device(device_type, env.device_index(grid.local_rank, module.device_count(), env.gpu_map()))
        module.set_device(device)
    joined = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    return backend, device, joined


def _agree(grid: ProcessGrid, views: list[tuple]) -> None:
    """Raise the same one-line error on every rank unless every rank could start and chose
    the same backend and device type, and all or none had joined a process group already."""
    from hpcml.grid.mpi import agree

    problem = next((v[1] for v in views if v[1] is not None), None)
    error = ConfigError if problem is not None and problem[0] == "ConfigError" else LaunchError
    agree([None if v[1] is None else v[1][1] for v in views], [v[2] for v in views],
          where="torch.distributed", differ="torch.distributed set-ups", error=error, differ_error=ConfigError,
          what="every rank must pass the same backend and see the same kind of device")
    size = len(views)  # one a rank of the job
    for r, v in enumerate(views):
        if v[3] is not None and v[3] != (r, size):
            raise LaunchError(f"torch.distributed already initialised as rank {v[3][0]} of {v[3][1]} on MPI rank "
                              f"{r} of {size}")


def init(grid: ProcessGrid, *, backend: str | None = None, interface: str | None = None,
         timeout_s: float = 600.0, check: bool = True) -> TorchDist:
    """Initialise torch.distributed on ``grid`` and build a DeviceMesh with the same axes.

    ``interface`` (or ``HPCML_SOCKET_IFNAME``) picks the network interface whose address
    rank 0 advertises; with gloo it also becomes ``GLOO_SOCKET_IFNAME`` unless that is set.
    ``check`` verifies that every mesh axis holds the same ranks as the MPI sub-communicator
    and the layout (local work, no collective).

    One allgather comes before torch does anything collective: every rank's backend and
    device type (or the error it met), rank 0's rendezvous address, every rank's device.
    A backend unknown on one rank, or different on some, raises the same error on all
    (it once left the others in the rendezvous until ``timeout_s``).
    """
    interface = interface or os.environ.get("HPCML_SOCKET_IFNAME") or None
    device, joined, addr, port, problem, store = torch.device("cpu"), None, "", 0, None, None
    try:
        backend, device, joined = _setup(grid, backend, interface)
        if grid.world_comm.Get_rank() == 0 and joined is None:
            addr, port = _pick_address(grid, interface)
            store = _store(addr, port, grid.world_comm.Get_size(), True, timeout_s)
            port = store.port
    except Exception as e:  # whatever failed here, every rank must still reach the allgather
        problem = ("ConfigError" if isinstance(e, ConfigError) else "LaunchError", " ".join(str(e).split()))
    setup = f"gave backend {backend} on {device.type}, {'in' if joined else 'not in'} a process group"
    # every member's ranks (rank 0 started the store meanwhile)
    views = waiting.allgather(grid.world_comm, (str(device), problem, setup, joined, addr, port))
    _agree(grid, views)
    addr, port = views[0][4], views[0][5]
    world_rank, world_size = grid.world_comm.Get_rank(), grid.world_comm.Get_size()
    if joined is None:
        logger.info("torch.distributed: %s rendezvous at %s:%d, %d ranks", backend, addr, port, world_size)
        if store is None:
            store = _store(addr, port, world_size, False, timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=world_rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type != "cpu" else None)
    mesh, expert_mesh, group, pop_group = _meshes(grid, device.type)
    first = grid.global_rank(0)
    result = TorchDist(backend=backend, device=device, mesh=mesh, expert_mesh=expert_mesh, group=group,
                       pop_group=pop_group, device_names=[v[0] for v in views[first:first + grid.world_size]],
                       master_addr=addr if joined is None else "", master_port=port if joined is None else 0)
    if check:
        check_mesh(grid, mesh, expert_mesh)
    return result


def default_group_key() -> Any:
    """The default process group itself, for the caches of meshes built on it: held in the key,
    never its ``id()``, which a group made after ``destroy_process_group`` can reuse (a cached
    mesh's destroyed groups then fail to resolve in the next collective)."""
    return dist.distributed_c10d._get_default_group()


def _meshes(grid: ProcessGrid, device_type: str) -> tuple[DeviceMesh, DeviceMesh | None, Any, Any]:
    """The member's dense and expert meshes, its whole group and the population's group.

    A population is one more mesh axis, ``pop``, outermost: each member's meshes are slices
    of the job's, so torch builds every group on every rank in one order (``new_group`` is
    collective over the job). Each layout's meshes are built once per process group."""
    lay, pg, pop = grid.layout, default_group_key(), grid.pop
    if len(set(grid.member_layouts)) > 1:
        return _mixed_meshes(grid, device_type)
    key = (device_type, lay.mesh_shape, pop, pg)
    if key not in _MESHES:  # a mesh's sub-groups cost collectives
        if pop == 1:
            _MESHES[key] = (init_device_mesh(device_type, lay.mesh_shape, mesh_dim_names=DENSE_AXES), None, None)
        else:
            full = init_device_mesh(device_type, (pop, *lay.mesh_shape), mesh_dim_names=("pop", *DENSE_AXES))
            n = lay.world_size  # each member's whole group (its loop's own all-reduces), built on every rank
            members = [dist.new_group(list(range(m * n, (m + 1) * n))) for m in range(pop)]
            _MESHES[key] = (full[DENSE_AXES], members[grid.member], full.get_group("pop"))
    mesh, group, pop_group = _MESHES[key]
    expert_mesh = None
    if lay.moe:  # the same ranks in Megatron's expert order (pp, edp, ep, etp): experts' groups
        key = (device_type, "expert", lay.expert_mesh_shape, pop, pg)
        if key not in _MESHES:
            ranks = torch.arange(lay.world_size * pop).reshape((pop, *lay.expert_mesh_shape))
            _MESHES[key] = DeviceMesh(device_type, ranks, mesh_dim_names=("pop", *EXPERT_AXES))[EXPERT_AXES]
        expert_mesh = _MESHES[key]
    return mesh, expert_mesh, group, pop_group


def _mixed_meshes(grid: ProcessGrid, device_type: str) -> tuple[DeviceMesh, DeviceMesh | None, Any, Any]:
    """Members of different layouts: every group of every member built on every rank, in one
    order (``new_group`` is collective over the job), and this member's meshes made of its own
    (``DeviceMesh.from_group``): the dense mesh, the expert mesh where the member has experts,
    and FSDP's flattened dp x cp dimension where both are above one -- which torch would make
    on the member's ranks only, so every other rank makes the same number of groups beside it."""
    key = (device_type, "members", tuple(grid.member_layouts), default_group_key())
    if key not in _MESHES:
        n, mine, experts, whole, places = grid.world_size, None, None, None, []
        for m, lay in enumerate(grid.member_layouts):
            mesh = _member_mesh(grid, m, lay.mesh_shape, DENSE_AXES, device_type)
            group = dist.new_group(list(range(m * n, (m + 1) * n)))
            # the same ranks in Megatron's expert order
            expert = _member_mesh(grid, m, lay.expert_mesh_shape, EXPERT_AXES, device_type) if lay.moe else None
            if m == grid.member:
                mine, whole, experts = mesh, group, expert
        for m, lay in enumerate(grid.member_layouts):  # after every member's mesh, in member order
            if lay.dp > 1 and lay.cp > 1:
                if m == grid.member:
                    mine["dp", "cp"]._flatten("dp_cp")
                else:
                    _groups_beside(torch.arange(m * n, (m + 1) * n).reshape(lay.mesh_shape)
                                   .movedim((1, 2), (-2, -1)).reshape(-1, lay.dp * lay.cp).tolist())
        for r in range(n):  # the ranks at one place of every member
            places.append(dist.new_group([m * n + r for m in range(grid.pop)]))
        _MESHES[key] = (mine, experts, whole, places[grid.rank])
    return _MESHES[key]


def _member_mesh(grid: ProcessGrid, member: int, shape: tuple[int, ...], names: tuple[str, ...],
                 device_type: str) -> DeviceMesh | None:
    """Member ``member``'s mesh of ``shape`` over its ranks: every dimension's groups made here
    on every rank (collective over the job); the mesh on that member's ranks, None elsewhere."""
    n = grid.world_size
    ranks = member * n + torch.arange(n).reshape(shape)
    me, dims = grid.global_rank(grid.rank), []
    for d in range(ranks.dim()):
        for g in ranks.movedim(d, -1).reshape(-1, ranks.shape[d]).tolist():
            pg = dist.new_group(g)
            if member == grid.member and me in g:
                dims.append(pg)
    if member != grid.member:
        return None
    return DeviceMesh.from_group(dims, device_type, mesh=ranks, mesh_dim_names=names)


def _groups_beside(groups: list[list[int]]) -> None:
    """The groups another member's ``DeviceMesh._flatten`` makes, made here too on a rank
    outside them, by the call torch uses there (``split_group`` once where the default group
    is bound to a device, as with NCCL given ``device_id``; else ``new_group`` a group), so
    every rank has made as many groups in one order."""
    default = dist.distributed_c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is not None and torch.accelerator.is_available():
        dist.split_group(parent_pg=default, split_ranks=groups, group_desc="mesh_dp_cp")
        return
    for g in groups:
        dist.new_group(ranks=g, group_desc="mesh_dp_cp")


def check_mesh(grid: ProcessGrid, mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> None:
    """Raise unless each mesh axis, each MPI sub-communicator and the layout name the same ranks."""
    for axis in grid.layout.axis_names:
        want = grid.group(axis)
        on = mesh if axis in DENSE_AXES else expert_mesh
        if on is None:
            raise LaunchError(f"rank {grid.rank}: no expert mesh to check the {axis} group against")
        want = [grid.global_rank(r) for r in want]  # torch numbers the ranks of the whole job
        got_torch = dist.get_process_group_ranks(on.get_group(axis))
        got_mpi = [grid.global_rank(r) for r in grid.comm_ranks(axis)]
        if not (want == sorted(got_torch) == got_mpi):
            raise LaunchError(f"rank {grid.rank}: {axis} group disagrees: layout {want}, "
                              f"torch mesh {got_torch}, MPI {got_mpi}")
