"""This machine's CPU as a planner device, measured: the matmul rate of one core against the
GEMM's row count (the efficiency curve the time model uses), memory bandwidth, and what ranks
sharing the cores get of them. Used to check the planner against real CPU runs
(``benchmarks/plan_validate.py``); GPUs take their figures from published runs instead."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hpcml.plan.devices import Device
from hpcml.plan.constants import Constants


@dataclass(frozen=True)
class CpuFacts:
    cores: int
    flops_core: float
    """Matmul FLOP/s of one thread on one core at large row counts."""
    flops_all: float
    """Matmul FLOP/s of one process using every core (torch's default threads)."""
    m_half: float
    """Rows at which one core's matmul reaches half of ``flops_core``."""
    copy_gbps: float
    """Bytes/s read plus written by a large copy, one thread."""
    memory_gib: float
    elementwise_passes: float = 40.0
    """What a block's forward and backward cost beyond its matmuls and its fixed dispatch, in
    hidden-state passes at ``copy_gbps`` (one thread, a block of width ``dim``, 512 tokens)."""
    elementwise_speedup: float = 1.0
    """How much faster one process does that work on every core than on one (torch's intra-op
    threads split the elementwise kernels as they split the matmuls)."""


def _gemm_rate(m: int, k: int, n: int, seconds: float = 0.3) -> float:
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2.0 * m * k * n * reps / (time.perf_counter() - t0)


def _copy_rate(seconds: float = 0.3) -> float:
    """Bytes/s read plus written by a 32 MiB copy."""
    import torch

    src = torch.empty(32 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        reps += 1
    return 2 * src.numel() * reps / (time.perf_counter() - t0)


def measure(dim: int = 256) -> CpuFacts:
    """Measure this machine (~15 s): GEMMs of width ``dim`` at several row counts, a copy, and a
    transformer block, on one core and on all."""
    import torch

    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    # each figure the best of three: a shared machine's noise only ever slows a measurement down
    try:
        flops_all = max(_gemm_rate(2048, dim, dim) for _ in range(3))
        torch.set_num_threads(1)
        big = max(_gemm_rate(4096, dim, dim) for _ in range(3))
        small = max(_gemm_rate(64, dim, dim) for _ in range(3))
        copy = max(_copy_rate() for _ in range(3))
        # a block of width dim on 512 tokens against one of width 32 on 8 (its dispatch alone)
        block = min(_block_s(dim, 4, 128) for _ in range(3))
        tiny = min(_block_s(32, 1, 8) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    block_all = min(_block_s(dim, 4, 128) for _ in range(3))  # the same on every core
    tiny_all = min(_block_s(32, 1, 8) for _ in range(3))
    # small / big = 64 / (64 + m_half)
    m_half = max(0.0, 64 * (big / small - 1)) if small > 0 else 0.0
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    tokens, hidden = 512, _HIDDEN * dim // 256
    gemm = 3 * tokens * 2 * (dim * dim * 2 + dim * dim // 2 * 2 + 3 * dim * hidden) / big \
        + 3 * tokens * 2 * 128 * dim / big  # projections (q, o; k, v half), MLP; attention scores and values
    rest = max(0.0, block - tiny - gemm)
    rest_all = block_all - tiny_all - gemm * big / flops_all
    passes = rest / (3 * tokens * dim * 4 / copy)
    speedup = min(float(cores), max(1.0, rest / rest_all)) if rest_all > 0 else float(cores)
    return CpuFacts(cores=cores, flops_core=big, flops_all=flops_all, m_half=m_half, copy_gbps=copy / 1e9,
                    memory_gib=mem, elementwise_passes=passes, elementwise_speedup=speedup)


_HIDDEN = 704


def _block_s(dim: int, batch: int, seq: int, seconds: float = 0.5) -> float:
    """Forward and backward of one transformer block of width ``dim`` (8 heads, 4 kv heads)."""
    import torch

    from hpcml.models.transformer.model import TransformerBlock, TransformerConfig
    from hpcml.models.transformer.rope import rope_tables

    heads = 8 if dim >= 64 else 4
    cfg = TransformerConfig(dim=dim, n_heads=heads, n_kv_heads=heads // 2, n_layers=1, max_seq_len=seq,
                            ffn_hidden=_HIDDEN * dim // 256)
    block = TransformerBlock(cfg)
    cos, sin = rope_tables(cfg.head_dim, seq, cfg.rope_theta, None)
    x = torch.randn(batch, seq, dim, requires_grad=True)
    block(x, cos, sin).sum().backward()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        block(x, cos, sin).sum().backward()
        reps += 1
    return (time.perf_counter() - t0) / reps


def cpu_device(facts: CpuFacts, ranks: int, probe: dict) -> tuple[Device, Constants]:
    """The device one of ``ranks`` training ranks is on this machine, with the constants to
    price it: one rank alone uses every core (its matmuls and its elementwise kernels); ranks
    beyond the cores share them evenly (hpcml pins them round-robin); the links are gloo over
    loopback, and the fixed costs per block of each parallelism come from ``probe`` (measured
    with the ranks in place on a model too small to compute: ``benchmarks/plan_validate.py --probe``;
    without them 0, as ``hpcml plan calibrate`` starts before it fits them on measured runs)."""
    share = min(1.0, facts.cores / ranks)
    flops = facts.flops_all if ranks == 1 else facts.flops_core * share
    elementwise = facts.copy_gbps * (facts.elementwise_speedup if ranks == 1 else share)
    bw = probe.get("busbw_gbps", 1.0)
    dev = Device(name=f"cpu-x{ranks}", memory_gib=facts.memory_gib / ranks, peak_tflops=flops / 1e12,
                 hbm_gbps=elementwise, gpus_per_node=ranks, intra_gbps=bw, inter_gbps=bw,
                 source="measured on this machine (hpcml.plan.cpu.measure)", family="cpu",
                 shared_cores=facts.cores if ranks > facts.cores else 0)
    base = probe["dp"]["block_s"] if "dp" in probe else 0.0

    def extra(name: str) -> float:
        return max(0.0, probe[name]["block_s"] - base) if name in probe else 0.0
    c = Constants(gemm_eff=1.0, m_half=facts.m_half, n_half=0.0, comm_eff=1.0, latency_s=probe.get("latency_s", 0.0),
                  elementwise_passes=facts.elementwise_passes,
                  dp_overlap=0.0, reserved_gib=0.0, block_s=base, tp_block_s=extra("tp"), sp_block_s=extra("sp"),
                  cp_block_s=extra("cp"), fsdp_unit_s=extra("fsdp"),
                  step_overhead_s=max(0.0, probe["dp"]["step_1block_s"] - base) if "dp" in probe else 0.0)
    return dev, c
