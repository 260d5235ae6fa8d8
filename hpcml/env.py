"""The launch environment, read from the variables that schedulers and MPI launchers set.

No MPI or torch import happens here: this runs before MPI is initialised (to bind a GPU
before the first CUDA call) and inside ``hpcml info`` on a login node.

Precedence follows who started *this* process. A per-process launcher variable (PALS,
jsrun, Open MPI, MPICH's Hydra) wins over Slurm's, because ``mpiexec`` inside an
``sbatch`` script inherits the batch step's ``SLURM_PROCID=0`` on every rank.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcml.errors import LaunchError

#: Exit status of a run that saved and stopped before its end (EX_TEMPFAIL): "not finished,
#: resume me". Batch scripts of ``hpcml job`` requeue a job that exits with it.
NOT_FINISHED = 75

#: Environment variables that restrict the devices a process sees, by vendor.
DEVICE_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")

# (launcher, rank, size, local rank, local size, node id); None where that launcher sets none.
_LAUNCHERS: tuple[tuple[str, str, str | None, str | None, str | None, str | None], ...] = (
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE", "PALS_NODEID"),
    ("jsrun", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE", None),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None, "SLURM_NODEID"),
)

_SCHEDULERS = (("slurm", "SLURM_JOB_ID"), ("lsf", "LSB_JOBID"), ("pbs", "PBS_JOBID"), ("flux", "FLUX_JOB_ID"))


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher told it."""

    scheduler: str = "none"
    """Batch system of the job: slurm, lsf, pbs, flux or none."""
    launcher: str = "none"
    """Program that started this process: srun, jsrun, pals, mpich, openmpi or none."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node: str = field(default_factory=socket.gethostname)
    """This process's node: the launcher's name for it where it gives one (Slurm), else the
    host name. Two Slurm nodes may share a host (``slurm-local``): the name tells them apart."""
    job_id: str | None = None
    visible_devices: dict[str, str] = field(default_factory=dict)
    """Device-visibility variables that are set, e.g. {"CUDA_VISIBLE_DEVICES": "0"}."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(f"rank {self.rank} outside world size {self.world_size} (launcher {self.launcher})")
        if not 0 <= self.local_rank < self.local_size:
            raise LaunchError(f"local rank {self.local_rank} outside local size {self.local_size} "
                              f"(launcher {self.launcher})")


def _int(environ: Mapping[str, str], name: str | None) -> int | None:
    if name is None or name not in environ:
        return None
    value = environ[name].strip()
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _slurm_local_size(environ: Mapping[str, str]) -> int | None:
    """Tasks on this node from ``SLURM_STEP_TASKS_PER_NODE``, e.g. ``8(x2),4`` and node id 2 -> 4."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node_id = _int(environ, "SLURM_NODEID") or 0
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not of the form '8(x2),4'")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[node_id] if node_id < len(counts) else None


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list in full: ``nid[001-003,007],login1`` -> 4 names, in order."""
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(hostlist + ","):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise LaunchError(f"host list {hostlist!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            if i > start:
                names += _expand_one(hostlist, hostlist[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"host list {hostlist!r} has an unmatched '['")
    return names


def _expand_one(hostlist: str, item: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item)
    if m is None:
        if "[" in item or "]" in item:
            raise LaunchError(f"host list {hostlist!r}: cannot read {item!r}")
        return [item]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        r = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if r is None or (r[2] is not None and int(r[2]) < int(r[1])):
            raise LaunchError(f"host list {hostlist!r}: bad range {part!r}")
        width = len(r[1])
        for n in range(int(r[1]), int(r[2] or r[1]) + 1):
            out += [f"{prefix}{n:0{width}d}{tail}" for tail in _expand_one(hostlist, rest)]
    return out


def _slurm_node(environ: Mapping[str, str]) -> str | None:
    """This process's Slurm node name, or None outside a Slurm job.

    ``SLURMD_NODENAME`` is wrong under MPICH's ``mpiexec`` in a batch job: Hydra copies the
    batch shell's value to every rank, while ``SLURM_NODEID`` and ``SLURM_STEP_NODELIST``
    stay those of the step that runs each node's proxy. So the node list indexed by the node
    id comes first.
    """
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    node_id = _int(environ, "SLURM_NODEID")
    if nodelist and node_id is not None:
        names = expand_hostlist(nodelist)
        if 0 <= node_id < len(names):
            return names[node_id]
    return environ.get("SLURMD_NODENAME") or None


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launch environment (``os.environ`` unless another mapping is given)."""
    environ = os.environ if environ is None else environ
    scheduler = next((name for name, var in _SCHEDULERS if var in environ), "none")
    job_id = next((environ[var] for _, var in _SCHEDULERS if var in environ), None)
    visible = {v: environ[v] for v in DEVICE_VISIBILITY_VARS if v in environ}
    node = (_slurm_node(environ) if scheduler == "slurm" else None) or socket.gethostname()
    for launcher, rank_v, size_v, lrank_v, lsize_v, _node_v in _LAUNCHERS:
        rank = _int(environ, rank_v)
        if rank is None:
            continue
        if launcher == "srun" and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ:
            continue  # the batch script itself, not a task of an srun step
        size = _int(environ, size_v)
        local_rank = _int(environ, lrank_v)
        local_size = _int(environ, lsize_v)
        if launcher == "srun":
            local_size = _slurm_local_size(environ)
        if launcher == "mpich" and local_rank is None and scheduler == "slurm":
            local_rank = _int(environ, "SLURM_LOCALID")  # srun --mpi=pmi2 sets PMI_RANK too
        for fallback in ("PMI_SIZE", "SLURM_NTASKS"):
            size = _int(environ, fallback) if size is None else size
        size = rank + 1 if size is None else size  # no launcher said: at least this many
        local_rank = 0 if local_rank is None else local_rank
        local_size = max(local_rank + 1, local_size or 1)
        return LaunchEnv(scheduler=scheduler, launcher=launcher, rank=rank, world_size=size,
                         local_rank=local_rank, local_size=local_size, node=node, job_id=job_id,
                         visible_devices=visible)
    return LaunchEnv(scheduler=scheduler, node=node, job_id=job_id, visible_devices=visible)


def job_deadline(environ: Mapping[str, str] | None = None) -> float | None:
    """Epoch seconds at which this batch job's walltime ends, when the job says:
    ``HPCML_JOB_DEADLINE`` (set by ``hpcml job`` scripts) or ``SLURM_JOB_END_TIME`` (Slurm >= 23.02)."""
    environ = os.environ if environ is None else environ
    for name in ("HPCML_JOB_DEADLINE", "SLURM_JOB_END_TIME"):
        value = environ.get(name, "").strip()
        if value:
            try:
                return float(value)
            except ValueError:
                raise LaunchError(f"{name}={value!r} is not epoch seconds") from None
    return None


def device_index(local_rank: int, device_count: int) -> int:
    """The device a rank binds to: ``local_rank mod device_count``.

    Frontier's ``--gpu-bind=closest`` and Summit's ``jsrun -g1`` show each rank a single
    device (count 1, so index 0); a node where every rank sees all 4 or 8 devices spreads
    ranks over them round-robin.
    """
    if device_count < 1:
        raise LaunchError(f"device_count must be >= 1 to bind a device, got {device_count}")
    if local_rank < 0:
        raise LaunchError(f"local_rank must be >= 0, got {local_rank}")
    return local_rank % device_count
