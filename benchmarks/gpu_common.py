"""What every section of ``benchmarks/gpu.py`` shares: the device (CUDA, ROCm or XPU, or the
CPU of a ``--cpu-smoke`` run), its dense bf16 peak from a table of datasheet figures, the
sizes of a full run and of a smoke run, and timing that synchronises the device.

Imports torch lazily: the driver reads the sizes without starting a device.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any, Callable

# Dense (no sparsity) bf16 matrix peak of ONE device as torch sees it, TFLOP/s, matched by
# substring of the device name (first match wins: GH200 before H200, H100 PCIe before H100). A name
# not listed gets peak None: the run reports achieved TFLOP/s and no MFU, never a guess.
# --peak-tflops overrides the table.
PEAKS: tuple[tuple[str, float, str], ...] = (
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 Tensor Core 1,979 TFLOPS
    # with sparsity for SXM, 1,513 for PCIe, 1,671 for NVL; dense is half.
    ("H100 PCIe", 756.5, "NVIDIA H100 datasheet: 1,513 TFLOPS bf16 with sparsity (PCIe), dense half"),
    ("H100 NVL", 835.5, "NVIDIA H100 datasheet: 1,671 TFLOPS bf16 with sparsity (NVL), dense half"),
    ("H100", 989.4, "NVIDIA H100 datasheet: 1,979 TFLOPS bf16 with sparsity (SXM), dense half"),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM 1,979 / NVL 1,671 with sparsity.
    ("GH200", 989.4, "NVIDIA GH200 datasheet: the H100/H200 SXM tensor cores, 1,979 TFLOPS with sparsity"),
    ("H200 NVL", 835.5, "NVIDIA H200 datasheet: 1,671 TFLOPS bf16 with sparsity (NVL), dense half"),
    ("H200", 989.4, "NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity (SXM), dense half"),
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 312 | 624 sparse.
    ("A100", 312.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense (624 with sparsity)"),
    # AMD: MI250X 383.0 bf16 per OAM module = 2 GCDs, each its own device (Frontier's "GPU").
    # ROCm may name the GCD "AMD Instinct MI250X/MI250", which does not say which: not matched.
    ("MI250X/MI250", math.nan, "name does not tell MI250X (191.5 per GCD) from MI250 (181.0): --peak-tflops"),
    ("MI250X", 191.5, "AMD Instinct MI250X spec: 383.0 TFLOPS bf16 per module of 2 GCDs"),
    ("MI300X", 1307.4, "AMD Instinct MI300X spec: 1,307.4 TFLOPS bf16 dense"),
    # Intel Max 1550 as Aurora exposes it, one tile per device: hpcml's site_configs/aurora.py.
    ("Max 1550", 367.0, "hpcml site_configs/aurora.py: 448 XMX engines x 512 flop/clock x 1.6 GHz per tile"),
)

NO_GPU = "benchmarks/gpu.py: no GPU: torch.cuda.is_available() is False (CUDA/ROCm/XPU device needed)"
"""The one line a CPU-only machine gets (exit status EX_UNAVAILABLE)."""
EX_UNAVAILABLE = 69
"""sysexits' "a service is unavailable": no device to measure on."""


def peak_tflops(name: str) -> tuple[float | None, str]:
    """(dense bf16 peak of one device in TFLOP/s or None, where the figure comes from)."""
    for pattern, tflops, source in PEAKS:
        if pattern.lower() in name.lower():
            return (None if math.isnan(tflops) else tflops), source
    return None, f"device {name!r} is not in benchmarks/gpu_common.py PEAKS: pass --peak-tflops"


def accelerator() -> str | None:
    """``cuda`` (NVIDIA or ROCm), ``xpu`` (Intel) or None: the device type this process sees."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return None


def device_count() -> int:
    import torch

    kind = accelerator()
    return getattr(torch, kind).device_count() if kind else 0


def device_name(device) -> str:
    import platform

    import torch

    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def sync(device) -> None:
    """Wait for the device's queued work (timings must not end before the kernels do)."""
    import torch

    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).synchronize(device)


def peak_mem_gib(device) -> float | None:
    import torch

    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).max_memory_allocated(device) / 2**30
    return None


def free_device_memory(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).empty_cache()
        getattr(torch, device.type).reset_peak_memory_stats(device)


def timed(fn: Callable[[], Any], device, *, warmup: int = 1, repeat: int = 5) -> dict[str, float]:
    """Median, mean, best and worst seconds of ``fn`` over ``repeat`` runs after ``warmup``
    runs, each bracketed by a device synchronisation."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "best_s": min(times),
            "worst_s": max(times)}


def gemm_tflops(device, dtype, n: int, repeat: int = 5) -> float:
    """Best matmul rate of an n x n x n product in ``dtype``: the device's reachable limit."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = timed(lambda: a @ b, device, warmup=2, repeat=repeat)["best_s"]
    return 2 * n**3 / t / 1e12


def transformer_config(size: str, seq_len: int):
    """``1b``: TinyLlama-1.1B's published shape (Zhang et al. 2024: 22 layers, dim 2048, 32
    heads, 4 kv heads, SwiGLU 5632, vocab 32000): 1.10 B parameters. Else an hpcml preset."""
    from hpcml.models.transformer import TransformerConfig

    if size == "1b":
        return TransformerConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                                 ffn_hidden=5632, max_seq_len=seq_len)
    return TransformerConfig.preset(size, max_seq_len=max(seq_len, 64))


FULL: dict[str, Any] = {
    "model_size": "1b", "seq_len": 2048, "batch": 8, "micro_batch": 2, "steps": 10, "warmup_steps": 2,
    "gemm_n": 8192, "dtype": "bf16",
    "moe_tokens": 16384, "moe_dim": 2048, "moe_experts": 8, "moe_top_k": 2, "moe_expert_hidden": 2816,
    "repeat": 10, "ckpt_state": "train", "d2h_probe_gib": 1.0,
    "field_nx": 128, "field_hidden": 1024, "field_batch": 64, "field_steps": 50,
}
"""A full run's sizes; ``--steps``, ``--model-size`` ... override them."""

SMOKE: dict[str, Any] = {
    "model_size": "tiny", "seq_len": 32, "batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1,
    "gemm_n": 128, "dtype": "bf16",
    "moe_tokens": 256, "moe_dim": 64, "moe_experts": 4, "moe_top_k": 2, "moe_expert_hidden": 64,
    "repeat": 2, "ckpt_state": "train", "d2h_probe_gib": 0.001,
    "field_nx": 8, "field_hidden": 32, "field_batch": 4, "field_steps": 3,
}
"""A ``--cpu-smoke`` run: every code path on CPU with tiny sizes, in seconds; not a measurement."""


def make_grid(spec: dict, *, cpu: bool = False, **degrees: int):
    """The ProcessGrid and torch.distributed of a worker: nccl (RCCL on ROCm) or xccl on the
    device hpcml binds (local rank mod device count), or gloo on the CPU in a smoke run (and
    for ``cpu``). A rank that raises aborts the job rather than leave the others waiting."""
    from hpcml.grid import ProcessGrid, install_abort_handler

    install_abort_handler()
    grid = ProcessGrid(**degrees)
    grid.init_torch(backend="gloo" if spec["smoke"] or cpu else None)
    return grid


def emit(rank: int, result: dict) -> None:
    """Rank 0 prints the section's one JSON line (the driver reads the last such line)."""
    if rank == 0:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
