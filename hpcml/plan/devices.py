"""The devices a plan can be made for: memory, dense bf16 peak, memory bandwidth, and the links
a rank's collectives use, each figure from the vendor's or the facility's page (``source``).

A site (``--site frontier``) takes its own node facts from ``site_configs`` (devices per node,
memory, peak, node injection bandwidth) over the device's defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpcml.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device a training rank drives, and the node it sits in."""

    name: str
    memory_gib: float
    """What the framework can allocate (the device's memory as ``torch.cuda.mem_get_info`` reports it)."""
    peak_tflops: float
    """Dense bf16 (fp16 where the device has no bf16 units) peak in TFLOP/s: the MFU denominator."""
    hbm_gbps: float
    """Memory bandwidth in GB/s (the optimizer step is bound by it)."""
    gpus_per_node: int
    intra_gbps: float
    """Per device, one direction, to the other devices of its node (NVLink, Infinity Fabric)."""
    inter_gbps: float
    """Per device, one direction, off the node: the node's injection bandwidth / devices per node."""
    source: str
    """Where the figures come from (URL, read on the date given)."""
    sustained: float = 1.0
    """The share of ``peak_tflops`` the part can run at (below 1 where a power limit keeps it under
    the rating its peak is quoted for); the time model's matmuls run at it, MFU stays over the peak.
    Where ``sustained_range`` is given, the value used is fitted in it (``data/calibration.json``)."""
    sustained_range: tuple[float, float] | None = None
    """The bracket its source puts ``sustained`` in (a power-capped part: between the ratings of the
    parts either side of its limit); ``python -m hpcml.plan.fit`` fits it there on the device's own table."""
    family: str = ""
    """Calibration group (``nvidia-a100``, ...): devices of a family share fitted constants."""
    fp8_tflops: float | None = None
    """Dense FP8 peak in TFLOP/s, where the device has FP8 tensor cores (None: it has none, and a
    layout of ``precision`` fp8 is refused on it)."""
    shared_cores: int = 0
    """CPU cores the ranks of a node share (0: one device each, a GPU); with more ranks than
    cores the time model lets a waiting rank's core work for the others."""

    def __post_init__(self) -> None:
        for f in ("memory_gib", "peak_tflops", "hbm_gbps", "intra_gbps", "inter_gbps"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"device {self.name}: {f}={getattr(self, f)} must be > 0")
        if self.fp8_tflops is not None and not self.fp8_tflops > 0:
            raise ConfigError(f"device {self.name}: fp8_tflops={self.fp8_tflops} must be > 0 or None")
        if not 0 < self.sustained <= 1:
            raise ConfigError(f"device {self.name}: sustained={self.sustained} must be in (0, 1]")
        lo, hi = self.sustained_range or (self.sustained, self.sustained)
        if not 0 < lo <= self.sustained <= hi <= 1:
            raise ConfigError(f"device {self.name}: sustained={self.sustained} must lie in sustained_range="
                              f"{self.sustained_range}, within (0, 1]")
        if self.gpus_per_node < 1:
            raise ConfigError(f"device {self.name}: gpus_per_node={self.gpus_per_node} must be >= 1")


_A100 = ("NVIDIA A100 datasheet https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (BF16 312 TFLOPS dense, NVLink 600 GB/s, HBM2e "
         "2,039 GB/s for 80GB SXM, 1,555 GB/s for 40GB), DGX A100: 8 x 200 Gb/s HDR InfiniBand; read 2026-11-27")
_H100 = ("NVIDIA H100 datasheet https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet "
         "(SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, FP8 3,958 with sparsity = 1,979 dense, 3.35 TB/s, "
         "NVLink 900 GB/s), DGX H100: 8 x 400 Gb/s NDR; read 2026-11-27")
_TITAN_H100 = ("torchtitan benchmarks (pytorch/torchtitan docs/performance.md @d4c86e37): 'Each H100 GPU is equipped "
               "with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth', 'default 500W power limit', 400 Gb/s RDMA "
               "per GPU; 'the actual peak TFLOPs number is between SXM and NVL' (the SXM peak is the MFU "
               "denominator, as there; the matmuls run at a share of it fitted in that range: NVL's 835 dense BF16 "
               "TFLOPS, 1,671 with sparsity, https://www.nvidia.com/en-us/data-center/h100/, over SXM's 989, to 1); "
               "FP8 twice the BF16 peak, as on every H100 datasheet; read 2026-11-27")
_H200 = ("NVIDIA H200 https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS "
         "with sparsity, FP8 3,958 with sparsity, NVLink 900 GB/s); read 2026-11-27")
_MI250X = ("OLCF Frontier user guide https://docs.olcf.ornl.gov/systems/frontier_user_guide.html (64 GB HBM2e and "
           "1.6 TB/s per GCD, 50-100 GB/s Infinity Fabric between GCDs, 4 x 25 GB/s Slingshot per node), "
           "AMD MI250X 383 TFLOPS bf16 per card; read 2026-07-07")

DEVICES: dict[str, Device] = {d.name: d for d in (
    Device(name="a100-80gb", memory_gib=79.15, peak_tflops=312.0, hbm_gbps=2039.0, gpus_per_node=8, intra_gbps=300.0,
           inter_gbps=25.0, source=_A100, family="nvidia-a100"),
    Device(name="a100-40gb", memory_gib=39.39, peak_tflops=312.0, hbm_gbps=1555.0, gpus_per_node=4, intra_gbps=300.0,
           inter_gbps=25.0, source=_A100 + "; Perlmutter/Polaris: 4 per node", family="nvidia-a100"),
    Device(name="h100-80gb", memory_gib=79.11, peak_tflops=989.0, hbm_gbps=3350.0, gpus_per_node=8, intra_gbps=450.0,
           inter_gbps=50.0, source=_H100, family="nvidia-h100", fp8_tflops=1979.0),
    Device(name="h100-96gb-500w", memory_gib=95.0, peak_tflops=989.0, hbm_gbps=2400.0, gpus_per_node=8,
           intra_gbps=450.0, inter_gbps=50.0, sustained_range=(835.0 / 989.0, 1.0), source=_TITAN_H100,
           family="nvidia-h100", fp8_tflops=1979.0),
    Device(name="h200", memory_gib=139.8, peak_tflops=989.0, hbm_gbps=4800.0, gpus_per_node=8, intra_gbps=450.0,
           inter_gbps=50.0, source=_H200, family="nvidia-h100", fp8_tflops=1979.0),
    Device(name="mi250x-gcd", memory_gib=63.98, peak_tflops=191.5, hbm_gbps=1600.0, gpus_per_node=8, intra_gbps=50.0,
           inter_gbps=12.5, source=_MI250X, family="amd-mi250x"),
)}

#: The device each site's nodes hold (their node facts then come from the site file).
SITE_DEVICE = {"frontier": "mi250x-gcd", "perlmutter": "a100-40gb", "polaris": "a100-40gb"}


def device(name: str) -> Device:
    """The device called ``name``; a one-line error lists the known ones."""
    if name not in DEVICES:
        raise ConfigError(f"unknown device {name!r}: expected one of {', '.join(DEVICES)}")
    return DEVICES[name]


def site_device(site: str) -> Device:
    """The device of ``site``, with the node facts its site file states (GPUs per node, memory,
    peak, node injection bandwidth shared by the node's devices)."""
    from hpcml.ensemble.site import load_site

    if site not in SITE_DEVICE:
        load_site(site)  # a name no site has: "unknown site", the known ones listed
        raise ConfigError(f"site {site!r} has no device the planner knows: expected one of {', '.join(SITE_DEVICE)} "
                          f"(or give --gpu)")
    hw = load_site(site).hardware
    base = DEVICES[SITE_DEVICE[site]]
    return replace(base, name=f"{base.name}@{site}", gpus_per_node=hw.gpus_per_node,
                   memory_gib=min(base.memory_gib, hw.gpu_memory_gb), peak_tflops=hw.peak_tflops_bf16_per_gpu,
                   inter_gbps=hw.node_injection_gbps / hw.gpus_per_node,
                   source=f"{base.source}; node facts: site_configs/{site}.py")
