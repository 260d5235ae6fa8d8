"""What this machine offers hpcml: MPI, parallel HDF5, torch backends, devices, launch env."""

from __future__ import annotations

import os
import platform
from typing import Any

from hpcml import __version__, env
from hpcml.errors import LaunchError

#: Scheduler and launcher variables worth showing when set.
RANK_VARS = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "LSB_JOBID", "JSM_NAMESPACE_RANK",
             "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PBS_JOBID", "PALS_RANKID", "PALS_LOCAL_RANKID",
             "PALS_LOCAL_SIZE", "PALS_NODEID", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE",
             "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_MPI_TYPE",
             "FLUX_JOB_ID", env.GPU_MAP_VAR) + env.DEVICE_VISIBILITY_VARS


def _mpi() -> dict[str, Any]:
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as e:
        return {"available": False, "error": str(e)}
    return {"available": True, "mpi4py": mpi4py.__version__, "standard": "%d.%d" % MPI.Get_version(),
            "library": " ".join(MPI.Get_library_version().split("\n")[0].split())}


def _hdf5() -> dict[str, Any]:
    try:
        import h5py
    except ImportError as e:
        return {"available": False, "error": str(e)}
    return {"available": True, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
            "parallel": bool(h5py.get_config().mpi)}


def _torch() -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return {"available": False, "error": str(e)}
    devices: list[str] = []
    if torch.cuda.is_available():
        kind = "rocm" if torch.version.hip else "cuda"
        devices = [f"{kind}:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        devices = [f"xpu:{i}" for i in range(torch.xpu.device_count())]
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available()),
                                ("xccl", getattr(dist, "is_xccl_available", lambda: False)())) if ok]
    return {"available": True, "torch": torch.__version__, "distributed": dist.is_available(),
            "backends": backends, "devices": devices or ["cpu"], "threads": torch.get_num_threads()}


def _gpu_map() -> dict[str, Any]:
    """The site's device order, or why it cannot be read: ``info`` reports, it does not stop."""
    try:
        devices = env.gpu_map()
    except LaunchError as e:
        return {"gpu_map": None, "gpu_map_error": str(e)}
    return {"gpu_map": None if devices is None else list(devices)}


def collect() -> dict[str, Any]:
    """Everything ``hpcml info`` prints, as a JSON-able dict."""
    launch = env.detect()
    return {
        "hpcml": __version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "mpi": _mpi(),
        "hdf5": _hdf5(),
        "torch": _torch(),
        "launch": {"scheduler": launch.scheduler, "launcher": launch.launcher, "rank": launch.rank,
                   "world_size": launch.world_size, "local_rank": launch.local_rank,
                   "local_size": launch.local_size, "node": launch.node, "node_id": launch.node_id,
                   "job_id": launch.job_id, "guessed": list(launch.guessed), **_gpu_map()},
        "variables": {v: os.environ[v] for v in RANK_VARS if v in os.environ},
    }


def _text(value: Any) -> str:
    """A value on one line: device indices as ``3,2,1,0``, other lists joined by ", ", [] as none."""
    if not isinstance(value, list):
        return str(value)
    if not value:
        return "none"
    return ("," if all(isinstance(v, int) for v in value) else ", ").join(map(str, value))


def format_text(info: dict[str, Any]) -> str:
    """``collect()`` as aligned ``key: value`` lines."""
    lines = [f"hpcml {info['hpcml']} on {info['host']}, Python {info['python']}"]
    for section in ("mpi", "hdf5", "torch", "launch", "variables"):
        values = info[section]
        body = ", ".join(f"{k}={_text(v)}" for k, v in values.items())
        lines.append(f"  {section + ':':<10} {body or '(none set)'}")
    return "\n".join(lines)
