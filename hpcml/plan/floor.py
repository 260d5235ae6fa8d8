"""A floor under a layout's predicted step, cheap enough to compute for every candidate of a
search: the search sorts by it and leaves unpriced whatever cannot beat the best it has priced
(:func:`step_floor`; :mod:`hpcml.plan.search`)."""

from __future__ import annotations

from functools import lru_cache

from hpcml.models.transformer.config import TransformerConfig
from hpcml.models.transformer.footprint import block_recompute
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.constants import Constants, elementwise_passes
from hpcml.plan.devices import Device
from hpcml.plan.memory import saved_how
from hpcml.plan.placement import moe_layers, rank_classes, rank_state
from hpcml.plan.timing import comm_mb, dp_comm, layer_flops


def step_floor(cfg: TransformerConfig, dev: Device, c: Constants, lay: PlanLayout, *, comm: bool = False,
               least_dp: float | None = None) -> float:
    """Seconds no step of ``lay`` takes less than (0 on ranks sharing cores), what :func:`step_time`
    counts for a micro-batch on a rank holding the pipeline ranks' average share of the blocks and
    ends: the linear layers' matmuls at the rate of the layout's rows and width, attention's core at
    the kernel's rate (its scores again in a flash backward), the elementwise passes at HBM speed,
    three times (backward) and once more for the blocks recomputed whole, and each block's fixed
    cost; times the micro-batches and the bubble. The slowest rank does at least the average.
    ``comm``: and the traffic no step overlaps (tensor-, context-, expert- and pipeline-parallel,
    :func:`~hpcml.plan.timing.comm_mb`) -- tighter, ~3x the arithmetic: the search sorts by the
    first and skips a layout by the second. And FSDP's fixed cost a unit, the step's overhead. Left
    out, all >= 0: data-parallel traffic beyond what hides, the optimizer, what selective modes
    recompute. ``least_dp``: :func:`least_dp_s` of ``lay`` (the same for every recompute mode), where
    the caller has it."""
    if dev.shared_cores:
        return 0.0
    tokens, width, pp, n = lay.micro_batch * lay.seq_len / lay.cp, cfg.dim / lay.tp, lay.pp, cfg.n_layers
    eff = c.gemm_eff * tokens / (tokens + c.m_half) * width / (width + c.n_half)
    peak = dev.peak_tflops * dev.sustained * 1e12
    lin = dev.fp8_tflops * dev.sustained * 1e12 * c.fp8_eff if lay.precision == "fp8" else peak
    hbm, act = dev.hbm_gbps * 1e9, 4 if lay.precision == "fp32" else 2
    flash = lay.attention != "eager"
    fused = c.attn_eff_fused if lay.framework == "megatron" and lay.attention == "flash" and c.attn_eff_fused > 0 \
        else c.attn_eff
    a_eff = fused if flash and fused > 0 else eff
    dense = 2.0 if lay.cp > 1 and lay.cp_kind == "allgather" and lay.framework == "hpcml" else 1.0
    core = dense * tokens * 2 * lay.seq_len * cfg.n_heads * cfg.head_dim / lay.tp / (peak * a_eff)  # a block's
    ew = tokens * elementwise_passes(c, lay.compile) * cfg.dim * act / lay.tp / hbm
    sm = tokens * c.softmax_passes * cfg.n_heads / lay.tp * lay.seq_len * act / hbm if not flash else 0.0
    linear, linear_full, full = _linear_flops(cfg, lay.seq_len, lay.recompute)  # all blocks', those recomputed
    head = 2 * tokens * cfg.dim * cfg.padded_vocab / lay.tp / (peak * eff)
    compute = (tokens / lay.tp * (3 * linear + linear_full) / (lin * eff) + (3 * n + full) * (core + ew + sm)
               + (n * core / 2 if flash else 0.0) + 3 * head + c.block_s * (n + full / 3)) / pp
    m = lay.microbatches
    # FSDP's fixed cost per unit and micro-batch, whatever its traffic hides behind; the step's own
    fixed = c.step_overhead_s + (m * (n / pp + 1) * c.fsdp_unit_s * (1.0 if lay.zero == 3 else 0.5)
                                 if lay.zero >= 2 else 0.0)
    if not comm:
        return (m + (pp - 1) / lay.v) * compute + fixed
    moe, moe_full = _moe_blocks(cfg, lay.recompute)
    pipe = (m + (pp - 1) / lay.v) * (compute + sum(comm_mb(cfg, lay, dev, c, tokens, saved_how(lay).stream_bytes,
                                                            n / pp, full / pp, 2 / pp, moe / pp, moe_full / pp,
                                                            lay.v)))
    if lay.dp_replicate > 1 or lay.hpz or lay.qwz or lay.qgz or not 0 <= c.dp_overlap <= 1:
        return pipe + fixed
    # data-parallel traffic beyond what the micro-batches' compute hides (at most all of it): a rank's
    # pipe + that is increasing and convex in its compute, other traffic and its data-parallel seconds,
    # so over the ranks at least that of their averages -- and of the least data-parallel traffic
    least = least_dp_s(cfg, dev, c, lay) if least_dp is None else least_dp
    return pipe + max(0.0, least - c.dp_overlap * m * compute) + fixed


def least_dp_s(cfg: TransformerConfig, dev: Device, c: Constants, lay: PlanLayout) -> float:
    """The least data-parallel traffic of a step on any pipeline rank of ``lay``, in seconds, before
    any of it hides (:func:`~hpcml.plan.timing.dp_comm`): a term of :func:`step_floor`."""
    return min(dp_comm(lay, dev, c, rank_state(cfg, lay, r))[0]
               for r in rank_classes(cfg.n_layers, lay.pp, lay.v, lay.split, moe_layers(cfg)))


@lru_cache(maxsize=1024)
def _linear_flops(cfg: TransformerConfig, seq_len: int, recompute: str = "none") -> tuple[float, float, int]:
    """Forward FLOPs a token spends in the blocks' linear layers (:func:`layer_flops` less attention's
    core), those of the blocks ``recompute`` runs again whole, and how many blocks those are."""
    core = 2 * seq_len * cfg.n_heads * cfg.head_dim
    per = [layer_flops(cfg, i, seq_len, 1) - core for i in range(cfg.n_layers)]
    full = [i for i in range(cfg.n_layers) if block_recompute(recompute, i) == "full"]
    return sum(per), sum(per[i] for i in full), len(full)


@lru_cache(maxsize=256)
def _moe_blocks(cfg: TransformerConfig, recompute: str) -> tuple[int, int]:
    """MoE blocks of the model, and those of them ``recompute`` runs forward again whole."""
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
    return len(moe), sum(block_recompute(recompute, i) == "full" for i in moe)
