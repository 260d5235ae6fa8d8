"""Memory of the fullest rank of a layout: parameters, gradients and optimizer state in the bytes
each framework keeps them (their elements: :mod:`hpcml.plan.placement`), activations per layer
and recompute mode for the micro-batches a pipeline schedule keeps in flight, and the transient
buffers of the step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from hpcml.models.transformer import footprint as fp
from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan.candidate import MEGATRON_MODEL, PlanLayout
from hpcml.plan.placement import (RankState, holder_parts, moe_layers, rank_classes, rank_state, shard_ranks,
                                  stage_layer_lists, whole_embedding_grad)


def in_flight(lay: PlanLayout, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once at its peak, all its stages
    together, in units of its whole share of layers (torch.distributed.pipelining's schedules: 1F1B
    warms up ``pp - rank`` forwards; interleaved 1F1B ``(v - 1) * mb_per_round + 2 * (pp - 1 - rank)``
    stage forwards, spread over its stages as :func:`held` counts them)."""
    return max(sum(n) for n in held(lay.microbatches, lay.pp, lay.v, pp_rank, lay.schedule)) / lay.v


@lru_cache(maxsize=4096)
def held(m: int, pp: int, v: int, pp_rank: int, schedule: str) -> tuple[tuple[int, ...], ...]:
    """The micro-batches pipeline rank ``pp_rank`` holds on each of its ``v`` stages (its first
    stage first) after each forward that may make its peak: the counts no other moment exceeds on
    every stage. Interleaved 1F1B as torch's schedule (and Megatron's) orders it: a rank's forwards
    go to its stages in rounds of ``m / rounds`` micro-batches, first stage first, and its backwards
    in rounds from its last stage -- so the last rank, whose last stage holds the logits, keeps the
    first stage's whole round and one micro-batch of the last before a backward frees one."""
    if pp == 1:
        return ((1,) * v,)
    if schedule == "gpipe":
        return ((m,) * v,)
    if schedule == "1f1b" or v == 1:
        return ((min(m, pp - pp_rank),) * v,)
    per_round = m // max(1, m // pp)
    total = m * v
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    # past the warm-up the counts repeat every per_round * v forwards (each stage gains per_round
    # forwards and loses per_round backwards a cycle): one cycle after it holds every count there is
    counts, after, b = [0] * v, [], 0
    for f in range(min(total, warm + per_round * v + 1)):
        counts[(f // per_round) % v] += 1
        after.append(tuple(counts))
        if f >= warm:  # steady state: each forward past the warm-up, then a backward
            counts[v - 1 - (b // per_round) % v] -= 1
            b += 1
    # a linear count of bytes peaks where the stages forwards and backwards go to change: keep those
    last = len(after) - 1
    ends = {p for i, p in enumerate(after) if i in (0, last) or _step(after, i) != _step(after, i + 1)}
    return tuple(sorted(p for p in ends if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in ends)))


def _step(points: list[tuple[int, ...]], i: int) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(points[i], points[i - 1]))


def node_ranks(lay: PlanLayout, gpus_per_node: int) -> int:
    """Data ranks (dp x cp, ``tp`` apart) on one node: hpZ's secondary shard, qgZ's first exchange."""
    return max(1, min(lay.dp * lay.cp, gpus_per_node // lay.tp))


def bf16_weights(lay: PlanLayout) -> bool:
    """Compute sees bf16 weights: Megatron's and torchtitan's, and hpcml's under FSDP (its trainer
    gathers bf16 there, ``ParallelConfig.param_dtype``); hpcml without FSDP keeps fp32 weights that
    autocast casts per matmul."""
    return lay.precision != "fp32" and (lay.framework != "hpcml" or lay.zero >= 2)


def weight_bytes(lay: PlanLayout) -> int:
    """Bytes of a weight as compute sees it (what FSDP gathers): :func:`bf16_weights` or fp32."""
    return 2 if bf16_weights(lay) else 4


def saved_how(lay: PlanLayout) -> fp.Saved:
    """Tensor widths and placements of ``lay`` as the activation count takes them (one object for
    layouts alike in them: the caches keyed on it then compare it by identity, a search's ~50,000
    calls)."""
    return _saved_how(lay.precision, bf16_weights(lay), lay.framework, lay.tp, lay.cp, lay.sequence_parallel,
                      lay.recompute, lay.attention, lay.fpdt_chunk, lay.loss_chunk, lay.pp, lay.loss, lay.cp_kind)


@lru_cache(maxsize=4096)
def _saved_how(precision: str, bf16: bool, framework: str, tp: int, cp: int, sequence_parallel: bool, recompute: str,
               attention: str, fpdt_chunk: int, loss_chunk: int, pp: int, loss: str, cp_kind: str) -> fp.Saved:
    act = 4 if precision == "fp32" else 2
    stream = 2 if bf16 else 4  # hpcml without FSDP: fp32 weights, an fp32 residual stream
    return fp.Saved(tp=tp, cp=cp, sequence_parallel=sequence_parallel, recompute=recompute,
                    attention=attention, act_bytes=act, stream_bytes=stream,
                    sp_saves_gathered=framework not in MEGATRON_MODEL, fpdt=fpdt_chunk > 0,
                    chunked_loss=(fpdt_chunk or loss_chunk) > 0 and pp == 1, loss=loss,
                    cp_kind=cp_kind,
                    fused_blocks=framework in MEGATRON_MODEL, norm_upcast=framework == "hpcml")


@lru_cache(maxsize=4096)
def _rank_layers(n_layers: int, n_stages: int, pp: int, pp_rank: int, split: str = "blocks") -> tuple[int, ...]:
    """The blocks of every stage pipeline rank ``pp_rank`` holds, in order."""
    stages = stage_layer_lists(n_layers, n_stages, split)
    return tuple(i for s in range(pp_rank, n_stages, pp) for i in stages[s])


@lru_cache(maxsize=256)
def _kept_whole(how: fp.Saved) -> fp.Saved:
    """``how`` without recompute: the block that backward recomputes, as its forward keeps it."""
    return replace(how, recompute="none")


@lru_cache(maxsize=16384)
def _rank_saved(cfg: TransformerConfig, how: fp.Saved, seq_len: int, n_stages: int, pp: int, pp_rank: int,
                split: str, hpcml: bool) -> tuple[tuple[float, ...], float, float, bool, float]:
    """What a pipeline rank's stages keep whatever the micro-batch: (bytes per token of each of its
    stages' blocks and heads, its first stage first; bytes per micro-batch of a stage's ALiBi mask
    (hpcml's), the last stage's constant, whether it holds an MoE block, the bytes per token of its
    largest block kept whole) -- a search prices thousands of layouts alike in these (cached)."""
    mine = range(pp_rank, n_stages, pp)
    stages = stage_layer_lists(cfg.n_layers, n_stages, split)
    per_stage = tuple(sum(n * fp.layer_saved(cfg, i, seq_len, how) for i, n in fp.layer_kinds(cfg, stages[s]).items())
                      + fp.head_saved(cfg, how, first=s == 0, last=s == n_stages - 1) for s in mine)
    kinds = fp.layer_kinds(cfg, _rank_layers(cfg.n_layers, n_stages, pp, pp_rank, split))  # alike once
    # hpcml's ALiBi mask, built by SDPA's caller (flash-attn's kernels take the slopes)
    bias = fp.bias_saved(cfg, seq_len, how) if hpcml else 0.0
    const = fp.head_constant(cfg, how, last=n_stages - 1 in mine)
    whole = 0.0
    if how.recompute != "none":
        full = _kept_whole(how)
        whole = max((fp.layer_saved(cfg, i, seq_len, full) for i in kinds), default=0.0)
    return per_stage, bias, const, any(cfg.is_moe(i) for i in kinds), whole


def activation_bytes(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int, state: RankState,
                     how: fp.Saved | None = None) -> tuple[float, float]:
    """(saved for backward at the peak, transient buffers) in bytes, on pipeline rank ``pp_rank``
    (``how``: :func:`saved_how` of ``lay``, where the caller has it)."""
    n_stages = lay.pp * lay.v
    how = saved_how(lay) if how is None else how
    tokens = lay.micro_batch * lay.seq_len
    per_stage, bias, const, moe, whole = _rank_saved(cfg, how, lay.seq_len, n_stages, lay.pp, pp_rank, lay.split,
                                                     lay.framework == "hpcml")
    last = (n_stages - 1) % lay.pp == pp_rank
    mine = range(pp_rank, n_stages, lay.pp)
    outs = _stage_output_bytes(cfg, lay, how, mine)
    kept = [t * tokens + bias for t in per_stage]  # a micro-batch's bytes on each stage, saved and sent
    peaks = held(lay.microbatches, lay.pp, lay.v, pp_rank, lay.schedule)
    counts = peaks[0] if len(peaks) == 1 else max(peaks, key=lambda n: sum(k * (a + o) for k, a, o in
                                                                           zip(n, kept, outs)))
    saved = sum(k * a for k, a in zip(counts, kept)) + const
    if lay.framework == "hpcml" and lay.precision != "fp32" and not bf16_weights(lay):
        # autocast's bf16 weight copies, saved by the matmuls: cached once for the whole step (the
        # schedule runs inside one autocast region), whatever the micro-batches in flight
        saved += 2 * (state.compute_params - _never_cast(cfg, lay, pp_rank))
    # transients: the logits' gradient on the last stage, one block recomputed in backward
    buffers = 0.0
    if last and how.loss != "fused":  # (FPDT's chunked loss: one chunk's logits at a time;
        # a fused loss writes the gradient over the logits it kept)
        chunk = lay.fpdt_chunk or lay.loss_chunk
        logit_rows = min(tokens / lay.cp, lay.micro_batch * chunk) if how.chunked_loss else tokens / lay.cp
        buffers += 2 * 4 * cfg.padded_vocab / lay.tp * logit_rows
    if lay.ep > 1 and moe:  # all-to-all send and receive buffers of one MoE block
        buffers += 2 * tokens / lay.cp * cfg.moe_top_k * cfg.dim * how.act_bytes
    buffers += tokens * whole
    return saved, buffers + sum(k * o for k, o in zip(counts, outs))


def _never_cast(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int) -> int:
    """Elements of a pipeline rank's weights autocast never casts: the embeddings it looks up (an
    untied token embedding) and the norms, which run in fp32; it casts every matmul's weight."""
    n_stages = lay.pp * lay.v
    norm = cfg.dim * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    out = 2 * norm * len(_rank_layers(cfg.n_layers, n_stages, lay.pp, pp_rank, lay.split))
    out += norm if (n_stages - 1) % lay.pp == pp_rank else 0
    if pp_rank == 0:
        ws = shard_ranks(lay)
        parts = holder_parts(cfg, lay.tp, lay.ep, ws, ws // lay.ep, whole_embedding_grad(lay))
        names = ("pos_embeddings.weight",) if cfg.tie_embeddings else ("tok_embeddings.weight", "pos_embeddings.weight")
        out += sum(parts[h][0] for h in names if h in parts)
    return out


def stage_outputs(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int, how: fp.Saved, mine: Sequence[int],
                  flight: float | None = None) -> float:
    """Bytes of the stage outputs a pipeline rank keeps while their micro-batches are in flight
    (``flight`` of each of the stages ``mine``; :func:`in_flight` where not given):
    ``torch.distributed.pipelining`` holds each forward's output until its backward (``fwd_cache``:
    hpcml's trainer, torchtitan) -- a block's output (sharded over tp under sequence parallelism),
    or on the last stage the logits the loss reads; Megatron and DeepSpeed free them once sent
    (Megatron's ``deallocate_pipeline_outputs``), as Llama 3's training did."""
    flight = in_flight(lay, pp_rank) if flight is None else flight
    return flight * sum(_stage_output_bytes(cfg, lay, how, mine))


def _stage_output_bytes(cfg: TransformerConfig, lay: PlanLayout, how: fp.Saved, mine: Sequence[int]
                        ) -> tuple[float, ...]:
    """A micro-batch's output of each stage of ``mine`` that its framework keeps (:func:`stage_outputs`)."""
    if lay.pp == 1 or lay.framework not in ("hpcml", "torchtitan"):
        return (0.0,) * len(mine)
    rows = lay.micro_batch * lay.seq_len / lay.cp
    last = lay.pp * lay.v - 1
    block = rows * cfg.dim * how.stream_bytes / (lay.tp if lay.sequence_parallel else 1)
    logits = rows * cfg.padded_vocab / lay.tp * how.act_bytes if how.loss != "fused" else 0.0  # (fused: kept)
    return tuple(logits if s == last else block for s in mine)


@dataclass(frozen=True)
class Memory:
    """Bytes on the fullest rank."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    reserved: float
    pp_rank: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.reserved

    def gib(self) -> dict[str, float]:
        g = 1 << 30
        return {"params": self.params / g, "grads": self.grads / g, "optimizer": self.optimizer / g,
                "activations": self.activations / g, "buffers": (self.buffers + self.reserved) / g,
                "total": self.total / g}


def fp32_grad_copy(lay: PlanLayout) -> bool:
    """Whether DeepSpeed's ``BF16_Optimizer`` runs ``lay`` (ZeRO 0-1 in bf16, gradients reduced in
    fp32): it keeps a whole fp32 copy of the gradients and adds each micro-batch's bf16 ones into it."""
    return lay.framework == "deepspeed" and lay.precision != "fp32" and lay.zero < 2 and lay.reduce_dtype != "bf16"


def state_bytes(lay: PlanLayout, st: RankState) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes: torch's fp32 Adam (two moments and a ``step``
    per tensor: hpcml, torchtitan, and Megatron's FSDP); Megatron's bf16 weights, main gradients
    and fp32 master weights + moments (18 bytes a parameter unsharded) at ZeRO-0/1 -- its main
    gradients are the buffer it reduces, so in the reduce dtype (bf16 without
    ``--accumulate-allreduce-grads-in-fp32``: 16 bytes); NeMo's distributed Adam 2 bytes less of
    master weights (``master_weights`` remainder), Transformer Engine's FP8 weights 1 byte less
    (``fp8_params``). DeepSpeed's ``BF16_Optimizer`` (ZeRO 0-1)
    keeps the bf16 gradients and, in fp32, a whole copy it accumulates them into and reduces
    (``fp32_groups_gradients_flat``); its ZeRO-2 and -3 a fp32 gradient partition, ZeRO-2 the bf16
    weights whole."""
    if lay.framework == "megatron" and lay.precision != "fp32" and lay.zero < 2:
        return ((1.0 if lay.fp8_params else 2.0) * st.params, (2.0 if lay.reduce_dtype == "bf16" else 4.0) * st.grads,
                (10.0 if lay.master_weights == "remainder" else 12.0) * st.optimizer)
    if lay.framework == "deepspeed" and lay.precision != "fp32":
        if lay.zero < 2:
            return 2.0 * st.params, (6.0 if fp32_grad_copy(lay) else 2.0) * st.grads, 12.0 * st.optimizer
        return 2.0 * (st.compute_params if lay.zero == 2 else st.params), 4.0 * st.grads, 12.0 * st.optimizer
    return 4.0 * st.params, 4.0 * st.grads, 8.0 * st.optimizer + 4.0 * st.tensors


def memory(cfg: TransformerConfig, lay: PlanLayout, reserved_bytes: float = 0.0, gpus_per_node: int = 8,
           pp_rank: int | None = None) -> Memory:
    """The memory of the fullest pipeline rank of ``lay`` (of ``pp_rank``, if given)."""
    worst: tuple | None = None
    most = 0.0
    ranks = rank_classes(cfg.n_layers, lay.pp, lay.v, lay.split, moe_layers(cfg)) if pp_rank is None else (pp_rank,)
    how = saved_how(lay)
    for r in ranks:
        st = rank_state(cfg, lay, r)
        p, g, o = state_bytes(lay, st)
        act, buf = activation_bytes(cfg, lay, r, st, how)
        compute_bytes = weight_bytes(lay)
        if lay.zero == 3 and not lay.fsdp_piped:  # FSDP: a gathered block and the one prefetched, the root kept
            # gathered, a block's grads (under a pipeline no backward but the last reshards: every block gathered)
            buf += compute_bytes * (2 * st.largest_unit + st.root) + 4 * st.largest_unit
            if lay.hpz:  # hpZ: every block's secondary shard over the node's data ranks, from forward to backward
                local = node_ranks(lay, lay.gpus_per_node or gpus_per_node)
                buf += compute_bytes * (st.compute_params - st.root) / local
        elif lay.zero == 2 and lay.framework == "deepspeed":  # ZeRO-2 keeps its weights whole (counted above)
            buf += 4 * st.largest_unit
        elif lay.zero >= 2:  # FSDP without resharding after forward: every block stays gathered until backward
            buf += compute_bytes * st.compute_params + 4 * st.largest_unit
        if lay.step_sync and lay.microbatches > 1:
            # unsharded gradients accumulate until the last micro-batch syncs (hpcml's ``grad_sync step``;
            # under a pipeline torch.distributed.pipelining's, whatever the framework), in FSDP2's reduce dtype
            buf += (2 if lay.reduce_dtype == "bf16" else 4) * st.compute_params
        elif lay.zero == 0 and lay.framework == "hpcml" and lay.dp * lay.cp > 1:
            buf += 4 * st.grads  # hpcml's DDP all-reduces one flat copy of every gradient
        total = p + g + o + act + buf + reserved_bytes  # (Memory's total, without making one per rank)
        if worst is None or total > most:
            worst, most = (p, g, o, act, buf, reserved_bytes, r), total
    assert worst is not None
    return Memory(*worst)
