"""The launch environment, read from the variables that schedulers and MPI launchers set.

No MPI or torch import happens here: this runs before MPI is initialised (to bind a GPU
before the first CUDA call) and inside ``hpcml info`` on a login node.

Precedence follows who started *this* process. A per-process launcher variable (PALS,
jsrun, Open MPI, MPICH's Hydra) wins over Slurm's, because ``mpiexec`` inside an
``sbatch`` script inherits the batch step's ``SLURM_PROCID=0`` on every rank. What the
first launcher leaves out comes from another one only when that one names the same rank.
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

# Per launcher, the variables it sets on every process it starts: (launcher, rank, world size, local rank,
# local size, node index), each a tuple of names tried in order, () where it sets none. Where they come from:
# - pals: HPE PALS ``mpiexec`` under PBS (Polaris, Aurora) and Slurm's cray_shasta plugin (``srun
#   --mpi=cray_shasta``, the default on Frontier and Perlmutter). SchedMD/slurm
#   src/plugins/mpi/cray_shasta/mpi_cray_shasta.c, mpi_p_slurmstepd_task(): PALS_RANKID, PALS_NODEID, PALS_APID,
#   PALS_APINFO, PALS_SPOOL_DIR; since Slurm 23.02 (commit 0dbdbf9399) also PALS_LOCAL_RANKID, PMI_RANK, PMI_SIZE,
#   PMI_LOCAL_RANK, PMI_LOCAL_SIZE, PMI_JOBID, PMI_UNIVERSE_SIZE; never PALS_LOCAL_SIZE. PALS under PBS also
#   sets PALS_LOCAL_SIZE and PALS_DEPTH (among the PALS variables unset_pals_env() clears in
#   flux-framework/flux-coral2 src/shell/plugins/cray_pals.c); ALCF's guide has ranks read PMI_LOCAL_RANK,
#   PMI_LOCAL_SIZE, PALS_LOCAL_RANKID (https://docs.alcf.anl.gov/polaris/running-jobs/using-gpus/).
# - jsrun: IBM JSM's JSM_NAMESPACE_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (as Lightning's LSFEnvironment reads them,
#   Lightning-AI/pytorch-lightning src/lightning/fabric/plugins/environments/lsf.py); Spectrum MPI adds
#   OMPI_COMM_WORLD_* (https://docs.olcf.ornl.gov/systems/summit_user_guide.html, nsys per-rank example).
# - openmpi: https://docs.open-mpi.org/en/v5.0.x/tuning-apps/environment-var.html. OMPI_COMM_WORLD_NODE_RANK is
#   a rank among this node's processes of all jobs, not a node index.
# - mpich: Hydra's proxy, pmodels/mpich src/pm/hydra/proxy/pmip_cb.c: PMI_RANK, PMI_SIZE, PMI_FD, MPI_LOCALRANKID,
#   MPI_LOCALNRANKS. Slurm's pmi2 plugin (src/plugins/mpi/pmi2/mpi_pmi2.c) sets PMI_RANK and PMI_SIZE only.
# - srun: srun(1) OUTPUT ENVIRONMENT VARIABLES, https://slurm.schedmd.com/srun.html (src/common/env.c).
#   SLURM_STEP_TASKS_PER_NODE is a per-node list ('8(x2),4') read at SLURM_NODEID.
_Row = tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]
_LAUNCHERS: tuple[_Row, ...] = (
    ("pals", ("PALS_RANKID",), ("PMI_SIZE",), ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
     ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"), ("PALS_NODEID",)),
    ("jsrun", ("JSM_NAMESPACE_RANK",), ("JSM_NAMESPACE_SIZE",), ("JSM_NAMESPACE_LOCAL_RANK",),
     ("JSM_NAMESPACE_LOCAL_SIZE",), ()),
    ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",), ()),
    ("mpich", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",), ()),
    ("srun", ("SLURM_PROCID",), ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_LOCALID",),
     ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), ("SLURM_NODEID",)),
)
_FIELDS = ("rank", "world_size", "local_rank", "local_size", "node_id")
_PER_NODE_LISTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")

#: Variable holding the site's device order by local rank, e.g. "3,2,1,0" (see :func:`gpu_map`).
GPU_MAP_VAR = "HPCML_GPU_MAP"

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
    node_id: int | None = None
    """Index of this node in the launch (PALS_NODEID, SLURM_NODEID); None where no launcher of
    this process gives one (Hydra, Open MPI, jsrun)."""
    guessed: tuple[str, ...] = ()
    """Fields no launcher variable gave, set to the least value the others allow (world size
    rank + 1, local size local rank + 1), so ``hpcml info`` can tell a guess from a count."""
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


def _per_node(environ: Mapping[str, str], name: str) -> int | None:
    """This node's entry of a Slurm per-node list: ``8(x2),4`` at SLURM_NODEID 2 -> 4."""
    spec = environ.get(name, "").strip()
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"{name}={spec!r} is not of the form '8(x2),4'")
        counts += [int(m[1])] * int(m[2] or 1)
    node_id = _int(environ, "SLURM_NODEID") or 0
    return counts[node_id] if node_id < len(counts) else None


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that is set, as an integer."""
    for name in names:
        value = _per_node(environ, name) if name in _PER_NODE_LISTS else _int(environ, name)
        if value is not None:
            return value
    return None


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


def _started(environ: Mapping[str, str]) -> list[_Row]:
    """The rows of ``_LAUNCHERS`` whose rank variable is set, in the table's order."""
    rows = []
    for row in _LAUNCHERS:
        if row[0] == "srun" and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ:
            continue  # the batch script itself, not a task of an srun step
        if any(name in environ for name in row[1]):
            rows.append(row)
    return rows


def _read(environ: Mapping[str, str], rows: list[_Row]) -> dict[str, int | None]:
    """What the first launcher says, each gap filled from another launcher that is also set
    and describes this same process (same rank, same world size where both say): cray_shasta
    sets no local size, Slurm's SLURM_STEP_TASKS_PER_NODE does. Never from one that differs:
    under Hydra or Open MPI in a batch job the SLURM_* variables are the batch shell's or
    those of the step that started the node's proxy, not this rank's."""
    first, *others = rows
    got = {f: _first(environ, names) for f, names in zip(_FIELDS, first[1:])}
    for other in others:
        if _first(environ, other[1]) != got["rank"]:
            continue
        size = _first(environ, other[2])
        if None not in (size, got["world_size"]) and size != got["world_size"]:
            continue
        for i, f in enumerate(_FIELDS):
            if got[f] is None:
                got[f] = _first(environ, other[1 + i])
    return got


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launch environment (``os.environ`` unless another mapping is given)."""
    environ = os.environ if environ is None else environ
    scheduler = next((name for name, var in _SCHEDULERS if var in environ), "none")
    job_id = next((environ[var] for _, var in _SCHEDULERS if var in environ), None)
    visible = {v: environ[v] for v in DEVICE_VISIBILITY_VARS if v in environ}
    node = (_slurm_node(environ) if scheduler == "slurm" else None) or socket.gethostname()
    rows = _started(environ)
    if not rows:
        return LaunchEnv(scheduler=scheduler, node=node, job_id=job_id, visible_devices=visible)
    got = _read(environ, rows)
    rank = got["rank"]
    assert rank is not None  # _started kept only rows whose rank variable is set
    guessed = tuple(f for f in ("world_size", "local_rank", "local_size") if got[f] is None)
    local_rank = 0 if got["local_rank"] is None else got["local_rank"]
    return LaunchEnv(scheduler=scheduler, launcher=rows[0][0], rank=rank,
                     world_size=rank + 1 if got["world_size"] is None else got["world_size"],
                     local_rank=local_rank,
                     local_size=local_rank + 1 if got["local_size"] is None else got["local_size"],
                     node=node, node_id=got["node_id"], job_id=job_id, visible_devices=visible, guessed=guessed)


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


def gpu_map(environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """The site's device for each local rank from ``HPCML_GPU_MAP`` ("3,2,1,0"), or None when unset.

    A site file sets it where the devices are numbered against the CPU NUMA domains: on
    Polaris and Perlmutter GPU 3 sits on the domain of CPUs 0-7, GPU 0 on the last, so local
    rank 0, pinned to CPUs 0-7, must take GPU 3 (ALCF's set_affinity_gpu_polaris.sh).
    """
    environ = os.environ if environ is None else environ
    value = environ.get(GPU_MAP_VAR, "").strip()
    if not value:
        return None
    try:
        devices = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise LaunchError(f"{GPU_MAP_VAR}={value!r}: expected device indices separated by commas, "
                          f"e.g. '3,2,1,0'") from None
    if min(devices) < 0 or len(set(devices)) != len(devices):
        raise LaunchError(f"{GPU_MAP_VAR}={value!r}: expected distinct device indices >= 0, e.g. '3,2,1,0'")
    return devices


def device_index(local_rank: int, device_count: int, gpu_map: tuple[int, ...] | None = None) -> int:
    """The device a rank binds to: ``gpu_map[local_rank % len(gpu_map)]`` with a map, else
    ``local_rank % device_count``.

    A process that sees one device (count 1) takes index 0 and the map is ignored: the
    launcher or a wrapper already chose its device (Frontier's ``--gpu-bind=closest``,
    Summit's ``jsrun -g1``, a CUDA_VISIBLE_DEVICES narrowed to one), and the map numbers
    the node's devices, which this process cannot see. A map naming a device this process
    does not see is refused rather than wrapped round onto a device of the wrong domain.
    """
    if device_count < 1:
        raise LaunchError(f"device_count must be >= 1 to bind a device, got {device_count}")
    if local_rank < 0:
        raise LaunchError(f"local_rank must be >= 0, got {local_rank}")
    if gpu_map is None or device_count == 1:
        return local_rank % device_count
    text = ",".join(map(str, gpu_map))
    if not gpu_map:
        raise LaunchError("GPU map is empty: expected device indices such as 3,2,1,0")
    twice = next((d for i, d in enumerate(gpu_map) if d in gpu_map[:i]), None)
    if twice is not None:
        raise LaunchError(f"GPU map {text} lists device {twice} twice: expected each device once")
    outside = next((d for d in gpu_map if not 0 <= d < device_count), None)
    if outside is not None:
        raise LaunchError(f"GPU map {text} names device {outside}, but this process sees {device_count} "
                          f"(0-{device_count - 1}): expected indices < {device_count}, or unset {GPU_MAP_VAR}")
    return gpu_map[local_rank % len(gpu_map)]
