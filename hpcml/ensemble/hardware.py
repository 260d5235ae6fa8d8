"""One compute node of a machine, as its facility documents it: the facts hpcml plans with
(devices per node, peaks for MFU, memory, links). Pure data, cheap to import."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.numeric import is_int

#: Batch systems a site may declare.
SCHEDULERS: tuple[str, ...] = ("slurm", "lsf", "pbs", "local")


@dataclass(frozen=True, kw_only=True)
class SiteHardware:
    """One compute node of a machine, as the facility documents it (sources: docs/sites/).

    A "GPU" is the device one training rank drives: a GCD of an MI250X on Frontier, a
    tile (stack) of a Max 1550 on Aurora, a whole GPU elsewhere.
    """

    name: str
    """Site name as users type it (``slurm-local``); the module is ``site_configs/slurm_local.py``."""
    gpus_per_node: int
    """Devices one node offers to training ranks (0 on a CPU-only machine)."""
    gpu_model: str
    """Device model in words, e.g. "AMD MI250X (one GCD)"; "none" without GPUs."""
    cpu_cores_per_node: int
    """Physical CPU cores a job can use per node, after the cores the site keeps for the OS."""
    memory_gb_per_node: float
    """Host memory per node in GiB."""
    gpu_memory_gb: float
    """Memory of one device in GiB (0 without GPUs)."""
    peak_tflops_bf16_per_gpu: float
    """Dense bf16 peak of one device in TFLOP/s (matrix units, no sparsity); the MFU denominator."""
    peak_tflops_fp32_per_gpu: float
    """Dense FP32 peak of one device in TFLOP/s without TF32: matrix units where the hardware
    has FP32 ones (MI250X), vector units otherwise."""
    node_injection_gbps: float
    """Network bandwidth into one node in GB/s, all NICs together, one direction (0: one node)."""
    intra_node_link: str
    """How devices talk inside a node, with bandwidths, e.g. "NVLink 3: 100 GB/s per pair"."""
    scheduler: str
    """Batch system: one of ``SCHEDULERS``."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*", self.name or ""):
            raise ConfigError(f"site name {self.name!r} must be lower-case letters and digits, words joined by "
                              f"'-' or '_' (it names site_configs/<name>.py, '-' as '_')")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"site {self.name}: scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        for field_name in ("gpus_per_node", "cpu_cores_per_node"):
            value = getattr(self, field_name)
            if not is_int(value) or value < 0:
                raise ConfigError(f"site {self.name}: {field_name}={value!r} must be an integer >= 0")
        if self.cpu_cores_per_node < 1:
            raise ConfigError(f"site {self.name}: cpu_cores_per_node={self.cpu_cores_per_node} must be >= 1")
        if not self.memory_gb_per_node > 0:
            raise ConfigError(f"site {self.name}: memory_gb_per_node={self.memory_gb_per_node} must be > 0")
        if self.node_injection_gbps < 0:
            raise ConfigError(f"site {self.name}: node_injection_gbps={self.node_injection_gbps} must be >= 0")
        per_gpu = ("gpu_memory_gb", "peak_tflops_bf16_per_gpu", "peak_tflops_fp32_per_gpu")
        for field_name in per_gpu:
            value = getattr(self, field_name)
            if self.gpus_per_node > 0 and not value > 0:
                raise ConfigError(f"site {self.name}: {field_name}={value} must be > 0 "
                                  f"with gpus_per_node={self.gpus_per_node}")
            if self.gpus_per_node == 0 and value != 0:
                raise ConfigError(f"site {self.name}: {field_name}={value} must be 0 with gpus_per_node=0")

    @property
    def peak_tflops_bf16_per_node(self) -> float:
        """Dense bf16 peak of all devices of one node in TFLOP/s."""
        return self.gpus_per_node * self.peak_tflops_bf16_per_gpu
