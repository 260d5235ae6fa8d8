"""Step time of a layout, analytically: matmul time at a calibrated, shape-dependent share of
the device's peak; tensor-, context- and pipeline-parallel traffic on the links it crosses,
exposed; data-parallel traffic overlapped with what it can hide behind; the pipeline bubble of
the schedule; the optimizer step at memory bandwidth. The constants per device family come from
published measured runs (:mod:`hpcml.plan.calibration`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from hpcml.models.transformer.config import TransformerConfig
from hpcml.models.transformer.footprint import block_recompute, layer_kinds
from hpcml.plan import traffic
from hpcml.plan.devices import Device
from hpcml.plan.memory import fp32_grad_copy, saved_how, state_bytes, weight_bytes
from hpcml.plan.placement import RankState, moe_layers, rank_classes, rank_state, stage_layer_lists
from hpcml.plan.candidate import MEGATRON_MODEL, PlanLayout
from hpcml.plan.constants import Constants, elementwise_passes


@dataclass(frozen=True)
class StepTime:
    step_s: float
    compute_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    pp_s: float
    bubble_s: float
    dp_s: float
    optimizer_s: float
    flops_per_rank: float
    """Hardware FLOPs of one rank per step, recomputation included."""


def _link(dev: Device, group: int, stride: int) -> float:
    """Bytes/s a ring collective moves per rank for a group of ``group`` ranks ``stride`` apart.
    Inside a node: the device's link. Across nodes the ring crosses each node boundary once per
    channel, and NCCL spreads channels over the node's NICs: the group's members on one node
    share the node's injection bandwidth with the other groups there, so the rate is the
    per-device share times the members per node (Megatron's tp 8, one member a node, gets one
    NIC's worth; a 64-way FSDP group of whole nodes gets all of them)."""
    if group * stride <= dev.gpus_per_node:
        return 1e9 * dev.intra_gbps
    per_node = max(1, min(group, dev.gpus_per_node // max(1, stride)))
    return 1e9 * min(dev.intra_gbps, dev.inter_gbps * per_node)


def _ring(nbytes: float, n: int, bw: float, c: Constants, factor: float = 2.0) -> float:
    """A ring all-reduce (factor 2) or all-gather / reduce-scatter (factor 1) of ``nbytes``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return factor * (n - 1) / n * nbytes / (bw * c.comm_eff) + c.latency_s * (n - 1)


@lru_cache(maxsize=65536)
def layer_flops(cfg: TransformerConfig, layer: int, seq_len: int, tp: int) -> float:
    """Forward FLOPs per token of block ``layer`` on one tp rank: matmuls of the active
    parameters and the causal attention scores and values (cached: a search asks ~60,000 times)."""
    hd, kv = cfg.head_dim, cfg.kv_heads
    attn = cfg.dim * hd * (2 * cfg.n_heads + 2 * kv)
    if cfg.is_moe(layer):
        ffn = 3 * cfg.dim * (cfg.moe_top_k * cfg.expert_hidden + cfg.moe_shared_hidden) + cfg.dim * cfg.n_experts
    else:
        ffn = cfg.mlp_matrices * cfg.dim * cfg.hidden
    return (2 * (attn + ffn) + 2 * seq_len * cfg.n_heads * hd) / tp


def _recompute_flops(cfg: TransformerConfig, lay: PlanLayout, kinds: dict[int, int], tokens: float) -> float:
    """Matmul FLOPs backward spends recomputing the forward, per micro-batch."""
    out = 0.0
    for i, count in kinds.items():
        full = tokens * layer_flops(cfg, i, lay.seq_len, lay.tp)
        core = tokens * 2 * lay.seq_len * cfg.dim / lay.tp
        mode = block_recompute(lay.recompute, i)
        out += count * {"none": tokens * _fpdt_mlp(cfg, lay, i), "full": full, "selective": core,
                        "selective-op": (full - core) / 2 + core}[mode]
    return out


def _fpdt_mlp(cfg: TransformerConfig, lay: PlanLayout, layer: int) -> float:
    """Forward FLOPs per token FPDT recomputes in a block: a dense block's MLP (chunked, checkpointed)."""
    return 0.0 if not lay.fpdt_chunk or cfg.is_moe(layer) else 2 * cfg.mlp_matrices * cfg.dim * cfg.hidden / lay.tp


def _node_aware_share(cfg: TransformerConfig, lay: PlanLayout, dev: Device, pp_rank: int, across_bw: float) -> float:
    """HSDP's, hpZ's, qwZ's and qgZ's data-parallel time over plain FSDP's on the same layout:
    their bytes inside and across nodes (:func:`hpcml.plan.traffic.dp_bytes`) each at its link's
    rate, over FSDP's the same way, so plain FSDP's fitted time stays as it is."""
    nodes = lay.gpus_per_node or dev.gpus_per_node
    inside = 1e9 * dev.intra_gbps

    def cost(d: dict) -> float:
        return d["dp_bytes_intra_node"] / inside + d["dp_bytes_inter_node"] / across_bw

    plain = cost(traffic.dp_bytes(cfg, replace(lay, dp_replicate=1, hpz=False, qwz=False, qgz=False), nodes, pp_rank))
    return cost(traffic.dp_bytes(cfg, lay, nodes, pp_rank)) / plain if plain > 0 else 1.0


#: Megatron-core's gradient bucket, in parameters: ``max(40e6, 1e6 x dp x cp)`` by default
#: (``DistributedDataParallelConfig.bucket_size``: "larger DP sizes need larger buckets").
BUCKET_MIN, BUCKET_PER_RANK = 40e6, 1e6


def _chunk0_tensors(cfg: TransformerConfig, lay: PlanLayout, layers: tuple[int, ...], first: bool) -> list[float]:
    """The parameters of a rank's first model chunk, one entry a tensor, in the forward's order
    (the embedding first on the first stage), as one tp rank holds them -- Megatron-core's tensors,
    not hpcml's own model's (``footprint.param_shapes``): its Transformer Engine layers fuse q, k, v
    into one weight and the MLP's gate and up projections into another, and a bucket never splits a
    tensor. The final norm and output layer of a one-chunk last stage are left out: they fill the
    backward's first buckets, and move the last one's remainder only when a bucket outgrows them."""
    hd, tp = cfg.head_dim, lay.tp
    out = [cfg.padded_vocab * cfg.dim / tp] if first else []
    for i in layers:
        if cfg.is_moe(i):
            mlp = [3 * cfg.dim * (cfg.n_experts * cfg.expert_hidden + cfg.moe_shared_hidden) / (tp * lay.ep)]
        else:
            mlp = [(cfg.mlp_matrices - 1) * cfg.dim * cfg.hidden / tp, cfg.dim * cfg.hidden / tp]
        out += [cfg.dim, cfg.dim * hd * (cfg.n_heads + 2 * cfg.kv_heads) / tp, cfg.n_heads * hd * cfg.dim / tp,
                cfg.dim, *mlp]
    return out


def _last_bucket(tensors: list[float], bucket: float) -> float:
    """Parameters in the last bucket Megatron-core reduces: it fills buckets from the last tensor
    back and closes one once it holds ``bucket`` parameters, never splitting a tensor, so the last
    holds the remainder and the first tensors (the whole embedding shard on the first stage)."""
    fill = closed = 0.0
    for n in reversed(tensors):
        fill += n
        if fill >= bucket:
            closed, fill = fill, 0.0
    return fill or closed


def _megatron_tail(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int, layers: tuple[int, ...], ws: int,
                   bw: float, c: Constants, grad_per_param: float, param_bytes: float, shared: bool = False) -> float:
    """What of Megatron-core's overlapped data-parallel traffic nothing hides: its last gradient
    bucket's reduction (its gradients are the backward's last) and, at ZeRO-1, that bucket's
    parameter gather before the next forward (the first it needs). Only a rank's first model chunk
    is bucketed (the others reduce whole, behind the remaining chunks' backward); ``shared``: a tied
    embedding under a pipeline, which Megatron-core puts in a bucket of its own."""
    if ws <= 1 or not layers:
        return 0.0
    bucket = max(BUCKET_MIN, BUCKET_PER_RANK * ws)
    tensors = _chunk0_tensors(cfg, lay, layers, pp_rank == 0)
    last = tensors[0] if shared and pp_rank == 0 else _last_bucket(tensors, bucket)
    out = _ring(last * grad_per_param, ws, bw, c, 2.0 if lay.zero == 0 else 1.0)
    return out + (_ring(last * param_bytes, ws, bw, c, 1.0) if lay.zero == 1 else 0.0)


def _p2p(cfg: TransformerConfig, lay: PlanLayout, dev: Device, c: Constants, whole: float) -> float:
    """A pipeline stage's sends and receives of one micro-batch (``whole``: its activation's bytes).
    Each tensor-parallel rank holds the whole activation unless it is sequence-parallel; Megatron
    (``scatter_gather_tensors_in_pipeline``, on by default) and DeepSpeed's engine (``pipe_partitioned``
    under tp) send a 1/tp slice each and all-gather it over the tp group after each receive; torch's
    pipelining sends it whole. Megatron pairs a send with a receive in one batched exchange, twice a
    micro-batch; DeepSpeed's schedule makes them four blocking calls, one after the other
    (``SendGrad`` then ``RecvActivation``, ``RecvGrad`` then ``SendActivation``)."""
    split = lay.tp > 1 and not lay.sequence_parallel and lay.framework in MEGATRON_MODEL
    sent = whole / lay.tp if lay.sequence_parallel or split else whole
    one = sent / (_link(dev, lay.pp, lay.tp * lay.cp * lay.dp) * c.comm_eff) + c.latency_s
    gather = _ring(whole, lay.tp, _link(dev, lay.tp, 1), c, 1.0) if split else 0.0
    return 2 * one * (2 if lay.framework == "deepspeed" else 1) + 2 * gather


def comm_mb(cfg: TransformerConfig, lay: PlanLayout, dev: Device, c: Constants, tokens: float, stream_bytes: int,
            blocks: float, full: float, ends: float, moe: float, moe_full: float, stages: float
            ) -> tuple[float, float, float, float]:
    """Seconds of one micro-batch's tensor-, context-, expert- and pipeline-parallel traffic on a
    rank (``tokens`` its own): ``blocks`` blocks, ``full`` of them recomputed whole, ``ends`` of the
    embedding and the output, ``moe`` MoE blocks (``moe_full`` recomputed whole), ``stages`` stages.
    Exposed: only tp's share ``tp_overlap`` hides. The counts may be averages over the pipeline's
    ranks (:func:`hpcml.plan.floor.step_floor`): every term is linear in them."""
    act = 4 if lay.precision == "fp32" else 2
    # tensor parallel: two all-reduces (or reduce-scatter + all-gather) per block in forward, two in
    # backward, two more when the forward is recomputed
    per = _ring(tokens * cfg.dim * act, lay.tp, _link(dev, lay.tp, 1), c)
    tp_mb = per * (4 * blocks + 2 * full) * ((1 - c.tp_overlap) if lay.overlap else 1.0)
    if lay.tp > 1:  # the embedding and the vocabulary-parallel loss count as one block more
        tp_mb += (blocks + ends / 2) * (c.sp_block_s if lay.sequence_parallel else c.tp_block_s)
    # Ulysses: all-to-all of q, k, v before and of the output after attention, both ways (FPDT:
    # the same bytes in two calls a chunk: q, k, v together, then the output)
    cp_mb = 0.0
    if lay.cp > 1:
        a2a = tokens * (2 * cfg.dim + 2 * cfg.kv_heads * cfg.head_dim) / lay.tp * act
        calls = 2 * lay.seq_len // (lay.cp * lay.fpdt_chunk) if lay.fpdt_chunk else 4
        # (a recomputed forward repeats its forward all-to-alls, as it repeats tp's all-reduces)
        if lay.cp_kind == "allgather":  # keys and values of the whole sequence gathered; backward reduce-scatters
            a2a, calls = tokens * lay.cp * 2 * cfg.kv_heads * cfg.head_dim / lay.tp * act, 2
        cp_mb = (blocks + full / 2) * (2 * ((lay.cp - 1) / lay.cp * a2a / (_link(dev, lay.cp, lay.tp) * c.comm_eff)
                                            + calls * c.latency_s) + c.cp_block_s)
    # experts: the dispatch and the combine all-to-all of every MoE block, both ways
    ep_mb = 0.0
    if lay.ep > 1 and moe:
        routed = tokens * cfg.moe_top_k * cfg.dim * act
        ep_mb = (4 * moe + 2 * moe_full) * ((lay.ep - 1) / lay.ep * routed / (_link(dev, lay.ep, lay.tp) * c.comm_eff)
                                            + c.latency_s)
    pp_mb = 0.0 if lay.pp == 1 else stages * _p2p(cfg, lay, dev, c, tokens * cfg.dim * stream_bytes)
    return tp_mb, cp_mb, ep_mb, pp_mb


def dp_comm(lay: PlanLayout, dev: Device, c: Constants, st: RankState) -> tuple[float, float]:
    """(seconds of a step's data-parallel traffic on a rank holding ``st``, before any of it hides
    and before hybrid or quantized sharding's share; of one gather of its parameters, 0 without FSDP)."""
    ws = lay.dp * lay.cp
    dp_bw = _link(dev, ws, lay.tp)
    m = lay.microbatches
    grad_full = (2.0 if lay.reduce_dtype == "bf16" else 4.0) * st.compute_params  # what the reduction sends
    if lay.zero < 2:  # zero 1: reduce-scatter gradients, all-gather updated parameters; zero 0: all-reduce
        # gradients (DeepSpeed's BF16_Optimizer all-reduces its whole fp32 copy at ZeRO-1 too)
        whole = lay.zero == 0 or lay.framework == "deepspeed"
        return _ring(grad_full, ws, dp_bw, c, 2.0 if whole else 1.0) \
            + (_ring(state_bytes(lay, st)[0], ws, dp_bw, c, 1.0) if lay.zero == 1 else 0.0), 0.0
    # FSDP: gather parameters (forward, and backward again at ZeRO-3), reduce-scatter gradients
    gather = _ring(weight_bytes(lay) * st.compute_params, ws, dp_bw, c, 1.0)  # the stage's parameters, once
    ag = gather * (2 if lay.zero == 3 else 1)
    rs = _ring(grad_full, ws, dp_bw, c, 1.0)
    # gradients reduce-scattered after each micro-batch (torch's default) or the last one only
    # (``step_sync``). Under a pipeline the parameters a backward gathered serve the next forward
    if lay.fsdp_piped:
        return gather * (m + 1 if lay.zero == 3 else 1) + rs, gather
    if lay.step_sync:
        return m * ag + rs, gather
    if lay.framework == "deepspeed" and lay.zero == 2:  # weights kept whole: gathered once, after the step
        return m * rs + gather, gather
    return m * (ag + rs), gather


def _bf16_accumulate(lay: PlanLayout, st: RankState, dev: Device) -> float:
    """DeepSpeed's ``BF16_Optimizer`` (ZeRO 0-1, fp32 gradient accumulation) adds each micro-batch's
    bf16 gradients into its fp32 copy after that backward (``update_hp_grads``: a bf16 read, an fp32
    temporary written and read, the copy read and written: 18 bytes a parameter), on the stream."""
    return 18.0 * st.compute_params / (dev.hbm_gbps * 1e9) if fp32_grad_copy(lay) else 0.0


def step_time(cfg: TransformerConfig, lay: PlanLayout, dev: Device, c: Constants, *, tied_copy: bool = False
              ) -> StepTime:
    """The step time of the slowest pipeline rank. Ranks sharing fewer cores (``dev.shared_cores``,
    a CPU) give their core away while they wait, so the step is the longer of the critical path
    at a whole core per rank and the ranks' busy time spread over the cores. ``tied_copy``: the
    last stage's output layer is a copy of the first's embedding (a tied embedding under a
    pipeline, Megatron's and DeepSpeed's way), their gradients all-reduced once a step."""
    if dev.shared_cores and lay.gpus > dev.shared_cores:
        share = dev.shared_cores / lay.gpus  # the measured figures are each rank's share of the cores
        whole = replace(dev, peak_tflops=dev.peak_tflops / share, hbm_gbps=dev.hbm_gbps / share, shared_cores=0)
        fixed = {k: getattr(c, k) * share for k in ("block_s", "tp_block_s", "sp_block_s", "cp_block_s",
                                                      "fsdp_unit_s", "step_overhead_s")}
        crit = step_time(cfg, lay, whole, replace(c, **fixed), tied_copy=tied_copy)
        busy = crit.step_s - crit.bubble_s
        return replace(crit, step_s=max(crit.step_s, busy / share))
    times = [_rank_time(cfg, lay, dev, c, r, rank_state(cfg, lay, r), tied_copy)
             for r in rank_classes(cfg.n_layers, lay.pp, lay.v, lay.split, moe_layers(cfg))]
    worst = max(times, key=lambda t: t.step_s)
    if lay.pp > 1 and lay.framework == "megatron" and lay.overlap:
        # a pipeline drains on its first rank: that rank's last bucket goes out after the slowest
        # rank's schedule, whichever rank that is (the others' hide behind the drain)
        first = times[0]
        pipe = max(t.step_s - t.dp_s - t.optimizer_s for t in times)
        drained = pipe + first.dp_s + first.optimizer_s
        if drained > worst.step_s:
            worst = replace(worst, step_s=drained, dp_s=first.dp_s, optimizer_s=first.optimizer_s)
    return worst


def _rank_time(cfg: TransformerConfig, lay: PlanLayout, dev: Device, c: Constants, pp_rank: int,
               st: RankState, tied_copy: bool = False) -> StepTime:
    n_stages = lay.pp * lay.v
    stages = stage_layer_lists(cfg.n_layers, n_stages, lay.split)
    mine = list(range(pp_rank, n_stages, lay.pp))
    layers = tuple(i for s in mine for i in stages[s])
    tokens = lay.micro_batch * lay.seq_len / lay.cp  # tokens of a micro-batch on this rank
    m = lay.microbatches
    how = saved_how(lay)
    act = how.act_bytes
    fwd, refwd = 0.0, 0.0  # seconds of one forward of this rank's blocks, and of what backward recomputes
    peak, hbm = dev.peak_tflops * dev.sustained * 1e12, dev.hbm_gbps * 1e9
    rows, width = tokens, cfg.dim / lay.tp  # a GEMM's rows (the rank's own tokens, whatever cp's kind) and width
    eff = c.gemm_eff * rows / (rows + c.m_half) * width / (width + c.n_half)
    kinds = layer_kinds(cfg, layers)
    flash = lay.attention != "eager"
    megatrons = lay.framework == "megatron" and lay.attention == "flash"  # TE's own pick: cuDNN's kernel
    fused = c.attn_eff_fused if megatrons and c.attn_eff_fused > 0 else c.attn_eff
    a_eff = fused if flash and fused > 0 else eff
    flash_bwd = 0.0  # flash attention's backward recomputes the scores: half a forward of the core more
    # the linear layers' matmuls: at the FP8 peak under precision fp8 (attention and the output layer stay bf16)
    lin = dev.fp8_tflops * dev.sustained * 1e12 * c.fp8_eff if lay.precision == "fp8" else peak
    for i, count in kinds.items():
        core_flops = tokens * 2 * lay.seq_len * cfg.n_heads * cfg.head_dim / lay.tp  # causal, in layer_flops
        # hpcml's all-gather attention takes a dense mask: no causal half skipped
        dense = 2.0 if lay.cp > 1 and lay.cp_kind == "allgather" and lay.framework == "hpcml" else 1.0
        core_mm = dense * core_flops / (peak * a_eff)
        mm = (tokens * layer_flops(cfg, i, lay.seq_len, lay.tp) - core_flops) / (lin * eff) + core_mm
        ew = tokens * elementwise_passes(c, lay.compile) * cfg.dim * act / lay.tp / hbm
        sm = tokens * c.softmax_passes * cfg.n_heads / lay.tp * lay.seq_len * act / hbm if lay.attention == "eager" \
            else 0.0
        core = core_mm + sm  # attention scores and values
        flash_bwd += count * core_mm / 2 if flash else 0.0
        fwd += count * (mm + ew + sm)
        mode = block_recompute(lay.recompute, i)
        mlp = _fpdt_mlp(cfg, lay, i)  # FPDT recomputes a dense block's MLP: its matmuls and half the elementwise
        refwd += count * {"none": mlp * tokens / (peak * eff) + ew / 2 if mlp else 0.0,
                          "full": mm + ew + sm, "selective": core, "selective-op": (mm - core) / 2 + ew + core}[mode]
    head = 2 * tokens * cfg.dim * cfg.padded_vocab / lay.tp / (peak * eff) if n_stages - 1 in mine else 0.0
    full_layers = sum(n for i, n in kinds.items() if block_recompute(lay.recompute, i) == "full")
    compute_mb = 3 * (fwd + head) + refwd + flash_bwd + c.block_s * (len(layers) + full_layers / 3) \
        + _bf16_accumulate(lay, st, dev)
    head_flops = 2 * cfg.dim * cfg.padded_vocab / lay.tp if n_stages - 1 in mine else 0.0
    flops_mb = 3 * tokens * (sum(n * layer_flops(cfg, i, lay.seq_len, lay.tp) for i, n in kinds.items()) + head_flops) \
        + _recompute_flops(cfg, lay, kinds, tokens)  # hardware FLOPs, recomputation included
    moe_blocks = sum(n for i, n in kinds.items() if cfg.is_moe(i))
    moe_full = sum(n for i, n in kinds.items() if cfg.is_moe(i) and block_recompute(lay.recompute, i) == "full")
    tp_mb, cp_mb, ep_mb, pp_mb = comm_mb(cfg, lay, dev, c, tokens, how.stream_bytes, len(layers), full_layers,
                                         (0 in mine) + (n_stages - 1 in mine), moe_blocks, moe_full, len(mine))
    t_mb = compute_mb + tp_mb + cp_mb + ep_mb + pp_mb
    bubble = (lay.pp - 1) / lay.v * t_mb if lay.pp > 1 else 0.0
    pipe = m * t_mb + bubble
    # data parallel over dp x cp ranks (experts over dp x cp / ep)
    ws = lay.dp * lay.cp
    dp_bw = _link(dev, ws, lay.tp)
    p_bytes, g_bytes, _ = state_bytes(lay, st)
    backward_mb = compute_mb * 2 / 3
    comm, gather = dp_comm(lay, dev, c, st)
    if lay.zero >= 2:  # FSDP: gather parameters (forward, and backward again at ZeRO-3), reduce-scatter gradients
        if lay.dp_replicate > 1 or lay.hpz or lay.qwz or lay.qgz:  # their bytes, priced as FSDP's are
            comm *= _node_aware_share(cfg, lay, dev, pp_rank, dp_bw)
        # its fixed cost per unit and micro-batch is its gathers': ZeRO-3 gathers twice (forward and
        # backward), ZeRO-2 once; ``fsdp_unit_s`` is ZeRO-3's, as the probe and a calibration measure it
        dp = max(0.0, comm - c.dp_overlap * m * compute_mb) + gather / max(1, len(layers)) \
            + m * (len(layers) + 1) * c.fsdp_unit_s * (1.0 if lay.zero == 3 else 0.5)
    else:
        # hpcml's DDP and DeepSpeed's BF16_Optimizer reduce after the last backward (DeepSpeed's
        # pipeline engine after its schedule): nothing hides them
        hide = m * compute_mb if lay.overlap else 0.0 if lay.framework in ("hpcml", "deepspeed") else backward_mb
        if lay.overlap and lay.framework == "megatron" and lay.pp == 1:
            # without a pipeline Megatron runs every micro-batch but the last under ``no_sync``: the gradients
            # go out behind the last backward, the parameters come back behind the next step's first forward
            hide = compute_mb if lay.zero == 1 else backward_mb
        tail = 0.0
        if lay.framework == "megatron" and lay.overlap and st.compute_params > 0:  # buckets only when overlapped
            tail = _megatron_tail(cfg, lay, pp_rank, stages[pp_rank], ws, dp_bw, c,
                                  2.0 if lay.reduce_dtype == "bf16" else 4.0, p_bytes / st.compute_params,
                                  shared=tied_copy)
        dp = tail + max(0.0, comm - tail - c.dp_overlap * hide)
    # the optimizer reads and writes parameters, master weights and moments, reads gradients
    opt_bytes = 2 * sum(state_bytes(lay, st)) + g_bytes
    opt = opt_bytes / (dev.hbm_gbps * 1e9)
    if tied_copy and (pp_rank == 0 or n_stages - 1 in mine):  # the embedding's and its copy's main gradients
        dp += _ring((2.0 if lay.reduce_dtype == "bf16" else 4.0) * cfg.padded_vocab * cfg.dim / lay.tp, 2,
                    _link(dev, 2, lay.tp * lay.cp * lay.dp * (lay.pp - 1)), c)
    step = pipe + dp + opt + c.step_overhead_s
    return StepTime(step_s=step, compute_s=m * compute_mb, tp_s=m * tp_mb, cp_s=m * cp_mb, ep_s=m * ep_mb,
                    pp_s=m * pp_mb,
                    bubble_s=bubble, dp_s=dp, optimizer_s=opt, flops_per_rank=m * flops_mb)
