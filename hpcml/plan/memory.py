"""Memory of the fullest rank of a layout: parameters, gradients and optimizer state counted
from the model's real parameter shapes as the plan shards them (tp, ep, pp stages, FSDP's
dim-0 chunks), activations per layer and recompute mode for the micro-batches a pipeline
schedule keeps in flight, and the transient buffers of the step."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from hpcml.models.transformer import footprint as fp
from hpcml.models.transformer.config import TransformerConfig
from hpcml.errors import ConfigError
from hpcml.parallel.config import split_layers
from hpcml.plan.candidate import MEGATRON_MODEL, PlanLayout


@dataclass(frozen=True)
class RankState:
    """Elements one rank holds (its worst case over the data-parallel shards: the first)."""

    params: int
    """Parameter elements at rest (after tp, ep, pp and FSDP's sharding at ZeRO-2 and -3)."""
    compute_params: int
    """Parameter elements as compute sees them (tp, ep, pp only: gathered by FSDP)."""
    grads: int
    optimizer: int
    """Elements of each optimizer moment (Adam keeps two)."""
    tensors: int
    """Trainable parameter tensors (torch's Adam keeps a ``step`` scalar for each)."""
    largest_unit: int
    """Compute elements of the largest FSDP unit (a block) on this rank."""
    root: int
    """Compute elements outside the blocks (embedding, final norm, output) on this rank."""


def _local_shape(name: str, shape: tuple[int, ...], tp: int, ep: int) -> tuple[list[int], bool]:
    """The shape of one rank's piece of parameter ``name`` after tp and ep, and whether it is an expert's."""
    tdim, edim = fp.shard_dims(name)
    s = list(shape)
    if tdim is not None:
        s[tdim] //= tp
    if edim is not None:
        s[edim] //= ep
    return s, edim is not None


def _grad_elements(name: str, n: int, tp: int, whole_embedding_grad: bool = True) -> int:
    """Elements of a parameter's gradient outside FSDP: its own, but the vocabulary-parallel
    embedding's gradient comes back from torch's ``RowwiseParallel`` backward as a Replicate
    DTensor of the whole table (measured with torch 2.13; FSDP reduce-scatters it to the shard).
    Megatron's ``VocabParallelEmbedding`` is a plain shard with a shard's gradient
    (``whole_embedding_grad`` False)."""
    return n * tp if whole_embedding_grad and name == "tok_embeddings.weight" else n


def whole_embedding_grad(lay: PlanLayout) -> bool:
    """Whether ``lay``'s framework parallelizes the embedding with torch's DTensor plan (above)."""
    return lay.framework not in MEGATRON_MODEL


def _chunk(n: int, ws: int, index: int = 0) -> int:
    """Rows shard ``index`` of ``ws`` holds of ``n`` split as ``torch.chunk`` does (FSDP2's dim-0
    shard): ceil(n / ws) each, the last ones fewer or none; the first holds the most."""
    c = -(-n // ws)
    return max(0, min(c, n - index * c))


@lru_cache(maxsize=4096)
def holder_parts(cfg: TransformerConfig, tp: int, ep: int, ws: int, ews: int, whole_grad: bool = True
                 ) -> dict[str, tuple[int, ...]]:
    """Per holder -- ``"L<i>"`` for block i, else the parameter's name (embedding, norm, output) --
    the element counts (compute, at-rest shard, trainable compute, trainable shard, trainable
    tensors, unsharded gradient) after tp and ep, a shard being FSDP's dim-0 chunk over ``ws``
    (``ews`` for experts). Blocks alike in their parameters are counted once (a 405B model's 126
    blocks were 0.7 s of a search's cold start)."""
    return {key: _holder_counts(params, tp, ep, ws, ews, whole_grad) for key, params in _holders(cfg)}


@lru_cache(maxsize=64)
def _holders(cfg: TransformerConfig) -> tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]:
    """(holder, its parameters' (name, shape)), the blocks' names taken as block 0's: the counts
    read a name's suffix only, so blocks alike share one key of :func:`_holder_counts`' cache."""
    out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in fp.param_shapes(cfg).items():
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            out.setdefault(f"L{index}", []).append((f"layers.0.{rest}", tuple(shape)))
        else:
            out.setdefault(name, []).append((name, tuple(shape)))
    return tuple((k, tuple(v)) for k, v in out.items())


@lru_cache(maxsize=16384)
def _holder_counts(params: tuple[tuple[str, tuple[int, ...]], ...], tp: int, ep: int, ws: int, ews: int,
                   whole_grad: bool) -> tuple[int, ...]:
    acc = [0, 0, 0, 0, 0, 0]
    for name, shape in params:
        s, expert = _local_shape(name, shape, tp, ep)
        n = math.prod(s)
        chunked = _chunk(s[0], ews if expert else ws) * (n // s[0]) if s[0] else 0
        t = fp.trainable(name)
        for j, v in enumerate((n, chunked, n * t, chunked * t, int(t), _grad_elements(name, n, tp, whole_grad) * t)):
            acc[j] += v
    return tuple(acc)


#: How blocks are split over stages: ends (the embedding and the output a block each, the remainder to
#: the first stages: torchtitan's default, Megatron's account-for-embedding/loss split), first
#: (the blocks alone, the remainder to the first stages: torchtitan without those weights), blocks
#: (the blocks alone, the remainder to the middle stages: hpcml's trainer's ``split_layers``).
SPLITS = ("ends", "first", "blocks")


def titan_split(n_layers: int, n_stages: int, first: int = 1, last: int = 1) -> list[int]:
    """Blocks per stage as torchtitan's ``generate_llm_fqn_per_model_part`` splits them: the
    embedding counts as ``first`` blocks and the output as ``last`` (its
    ``pipeline_parallel_first/last_stage_less_layers``, 1 by default), the remainder of the
    ``n_layers + first + last`` goes to the first stages. 126 blocks over 128 stages: the first
    holds the embedding alone, the last the output alone (Llama 3 405B's split)."""
    if n_stages <= 1:
        return [n_layers]
    base, extra = divmod(n_layers + first + last, n_stages)
    if base < max(1, first, last):
        what = " + the embedding and the output" if first or last else ""
        raise ConfigError(f"pipeline stages {n_stages} > {n_layers + first + last} (n_layers {n_layers}{what}): "
                          f"fewer stages, or more layers")
    counts, left = [], n_layers
    for s in range(n_stages):
        want = base + (s < extra) - (first if s == 0 else last if s == n_stages - 1 else 0)
        counts.append(min(want, left))
        left -= counts[-1]
    return counts


@lru_cache(maxsize=4096)
def stage_layer_lists(n_layers: int, n_stages: int, split: str = "blocks") -> tuple[tuple[int, ...], ...]:
    """The blocks of every pipeline stage, stage 0 first (``split``: :attr:`PlanLayout.split`)."""
    if split == "ends":
        counts = titan_split(n_layers, n_stages)
    elif split == "first":
        counts = titan_split(n_layers, n_stages, 0, 0)
    elif split == "blocks":
        counts = split_layers(n_layers, n_stages)
    else:
        raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return tuple(out)


def rank_elements(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int, shard: int, expert_shard: int = 0
                  ) -> dict[str, int]:
    """Elements one rank holds, exactly: pipeline rank ``pp_rank``, index ``shard`` in the flat
    dp x cp group FSDP shards dense weights over (``expert_shard`` in the expert-data group).
    What :func:`rank_state` gives for shard 0, for any rank: tests compare it with the tensors
    of a parallelized model."""
    n_stages = lay.pp * lay.v
    stages = stage_layer_lists(cfg.n_layers, n_stages, lay.split)
    mine = set(range(pp_rank, n_stages, lay.pp))
    ws = lay.dp * lay.cp // lay.dp_replicate
    shard %= ws  # HSDP: the same shard in every replica
    out = {"params": 0, "grads": 0, "optimizer": 0, "tensors": 0}
    for name, shape in fp.param_shapes(cfg).items():
        if not mine.intersection(fp.stage_of(name, stages)):
            continue
        s, expert = _local_shape(name, shape, lay.tp, lay.ep)
        n = math.prod(s)
        group, index = (ws // lay.ep, expert_shard) if expert else (ws, shard)
        chunked = _chunk(s[0], group, index) * (n // s[0]) if s[0] else 0
        out["params"] += chunked if lay.zero >= 2 else n
        if fp.trainable(name):
            out["grads"] += chunked if lay.zero >= 2 else _grad_elements(name, n, lay.tp, whole_embedding_grad(lay))
            out["optimizer"] += chunked if lay.zero >= 1 else n
            out["tensors"] += 1
    return out


@lru_cache(maxsize=4096)
def rank_classes(n_layers: int, pp: int, v: int, split: str = "blocks", moe: tuple[bool, ...] = ()
                 ) -> tuple[int, ...]:
    """Pipeline ranks that stand for all: the first of each group holding stages of the same
    sizes and the same ends (embedding, output). Within a group states and step times are
    equal and the schedules keep the most micro-batches in flight on the lowest rank."""
    n_stages = pp * v
    stages = stage_layer_lists(n_layers, n_stages, split)
    seen: dict[tuple, int] = {}
    for r in range(pp):
        key = (tuple(tuple(moe[i] for i in stages[s]) if moe else len(stages[s]) for s in range(r, n_stages, pp)),
               r == 0, (n_stages - 1) % pp == r)
        seen.setdefault(key, r)
    return tuple(sorted(seen.values()))


@lru_cache(maxsize=256)
def moe_layers(cfg: TransformerConfig) -> tuple[bool, ...]:
    """Which blocks are MoE, where some are and some not (ranks alike in sizes may then differ); else ()."""
    flags = tuple(cfg.is_moe(i) for i in range(cfg.n_layers)) if cfg.n_experts else ()
    return flags if len(set(flags)) > 1 else ()


def rank_state(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int) -> RankState:
    """What pipeline rank ``pp_rank`` holds (its stages ``pp_rank + k * pp``)."""
    # (HSDP shards over a replica's dp x cp / dp_replicate ranks)
    return _rank_state(cfg, lay.tp, lay.ep, lay.dp * lay.cp // lay.dp_replicate, lay.pp, lay.v, lay.zero, pp_rank,
                       whole_embedding_grad(lay), lay.split)


@lru_cache(maxsize=65536)
def _rank_state(cfg: TransformerConfig, tp: int, ep: int, ws: int, pp: int, v: int, zero: int,
                pp_rank: int, whole_grad: bool = True, split: str = "blocks") -> RankState:
    parts = holder_parts(cfg, tp, ep, ws, ws // ep, whole_grad)
    n_stages = pp * v
    stages = stage_layer_lists(cfg.n_layers, n_stages, split)
    holders = [f"L{i}" for s in range(pp_rank, n_stages, pp) for i in stages[s]]
    units = [parts[h][0] for h in holders]
    if pp_rank == 0:
        holders += [h for h in ("tok_embeddings.weight", "pos_embeddings.weight") if h in parts]
    if (n_stages - 1) % pp == pp_rank:
        holders += [h for h in ("norm.weight", "norm.bias", "output.weight") if h in parts]
    tot = [sum(parts[h][j] for h in holders) for j in range(6)]
    n, chunked, tn, tchunked, tensors, gn = tot
    return RankState(params=chunked if zero >= 2 else n, compute_params=n, grads=tchunked if zero >= 2 else gn,
                     optimizer=tchunked if zero >= 1 else tn, tensors=tensors, largest_unit=max(units, default=0),
                     root=n - sum(units))


def in_flight(lay: PlanLayout, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once, in units of its whole
    share of layers (torch.distributed.pipelining's schedules: 1F1B warms up ``pp - rank``
    forwards; interleaved 1F1B ``(v - 1) * mb_per_round + 2 * (pp - 1 - rank)`` stage forwards)."""
    m = lay.microbatches
    if lay.pp == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "1f1b":
        return float(min(m, lay.pp - pp_rank))
    rounds = max(1, m // lay.pp)
    warmup = min((lay.v - 1) * (m // rounds) + 2 * (lay.pp - 1 - pp_rank), m * lay.v)
    return min(warmup + 1, m * lay.v) / lay.v


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
    """Tensor widths and placements of ``lay`` as the activation count takes them."""
    act = 4 if lay.precision == "fp32" else 2
    stream = 2 if bf16_weights(lay) else 4  # hpcml without FSDP: fp32 weights, an fp32 residual stream
    return fp.Saved(tp=lay.tp, cp=lay.cp, sequence_parallel=lay.sequence_parallel, recompute=lay.recompute,
                    attention=lay.attention, act_bytes=act, stream_bytes=stream,
                    sp_saves_gathered=lay.framework not in MEGATRON_MODEL, fpdt=lay.fpdt_chunk > 0,
                    chunked_loss=(lay.fpdt_chunk or lay.loss_chunk) > 0 and lay.pp == 1, loss=lay.loss,
                    cp_kind=lay.cp_kind,
                    fused_blocks=lay.framework in MEGATRON_MODEL, norm_upcast=lay.framework == "hpcml")


@lru_cache(maxsize=4096)
def _rank_layers(n_layers: int, n_stages: int, pp: int, pp_rank: int, split: str = "blocks") -> tuple[int, ...]:
    """The blocks of every stage pipeline rank ``pp_rank`` holds, in order."""
    stages = stage_layer_lists(n_layers, n_stages, split)
    return tuple(i for s in range(pp_rank, n_stages, pp) for i in stages[s])


@lru_cache(maxsize=256)
def _kept_whole(how: fp.Saved) -> fp.Saved:
    """``how`` without recompute: the block that backward recomputes, as its forward keeps it."""
    return replace(how, recompute="none")


def activation_bytes(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int, state: RankState) -> tuple[float, float]:
    """(saved for backward at the peak, transient buffers) in bytes, on pipeline rank ``pp_rank``."""
    n_stages = lay.pp * lay.v
    how = saved_how(lay)
    tokens = lay.micro_batch * lay.seq_len
    per_mb = 0.0
    mine = list(range(pp_rank, n_stages, lay.pp))
    kinds = fp.layer_kinds(cfg, _rank_layers(cfg.n_layers, n_stages, lay.pp, pp_rank, lay.split))  # alike once
    per_mb += sum(n * fp.layer_saved(cfg, i, lay.seq_len, how) for i, n in kinds.items())
    for s in mine:
        per_mb += fp.head_saved(cfg, how, first=s == 0, last=s == n_stages - 1)
    per_mb *= tokens
    if lay.framework == "hpcml":  # its ALiBi mask, built by SDPA's caller (flash-attn's kernels take the slopes)
        per_mb += len(mine) * fp.bias_saved(cfg, lay.seq_len, how)
    saved = per_mb * in_flight(lay, pp_rank) + fp.head_constant(cfg, how, last=n_stages - 1 in mine)
    if lay.framework == "hpcml" and lay.precision != "fp32" and not bf16_weights(lay):
        # autocast's bf16 weight copies, saved by the matmuls: cached once for the whole step (the
        # schedule runs inside one autocast region), whatever the micro-batches in flight
        saved += 2 * state.compute_params
    # transients: the logits' gradient on the last stage, one block recomputed in backward
    buffers = 0.0
    if n_stages - 1 in mine and how.loss != "fused":  # (FPDT's chunked loss: one chunk's logits at a time;
        # a fused loss writes the gradient over the logits it kept)
        chunk = lay.fpdt_chunk or lay.loss_chunk
        logit_rows = min(tokens / lay.cp, lay.micro_batch * chunk) if how.chunked_loss else tokens / lay.cp
        buffers += 2 * 4 * cfg.padded_vocab / lay.tp * logit_rows
    if lay.ep > 1 and any(cfg.is_moe(i) for i in kinds):  # all-to-all send and receive buffers of one MoE block
        buffers += 2 * tokens / lay.cp * cfg.moe_top_k * cfg.dim * how.act_bytes
    if lay.recompute != "none":
        full = _kept_whole(how)
        buffers += tokens * max((fp.layer_saved(cfg, i, lay.seq_len, full) for i in kinds), default=0.0)
    return saved, buffers + stage_outputs(cfg, lay, pp_rank, how, mine)


def stage_outputs(cfg: TransformerConfig, lay: PlanLayout, pp_rank: int, how: fp.Saved, mine: list[int]) -> float:
    """Bytes of the stage outputs a pipeline rank keeps while their micro-batches are in flight:
    ``torch.distributed.pipelining`` holds each forward's output until its backward (``fwd_cache``:
    hpcml's trainer, torchtitan) -- a block's output (sharded over tp under sequence parallelism),
    or on the last stage the logits the loss reads; Megatron and DeepSpeed free them once sent
    (Megatron's ``deallocate_pipeline_outputs``), as Llama 3's training did."""
    if lay.pp == 1 or lay.framework not in ("hpcml", "torchtitan"):
        return 0.0
    rows = lay.micro_batch * lay.seq_len / lay.cp
    last = lay.pp * lay.v - 1
    block = rows * cfg.dim * how.stream_bytes / (lay.tp if lay.sequence_parallel else 1)
    logits = rows * cfg.padded_vocab / lay.tp * how.act_bytes if how.loss != "fused" else 0.0  # (fused: kept)
    return in_flight(lay, pp_rank) * sum(logits if s == last else block for s in mine)


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
            return 2.0 * st.params, (2.0 if lay.reduce_dtype == "bf16" else 6.0) * st.grads, 12.0 * st.optimizer
        return 2.0 * (st.compute_params if lay.zero == 2 else st.params), 4.0 * st.grads, 12.0 * st.optimizer
    return 4.0 * st.params, 4.0 * st.grads, 8.0 * st.optimizer + 4.0 * st.tensors


def memory(cfg: TransformerConfig, lay: PlanLayout, reserved_bytes: float = 0.0, gpus_per_node: int = 8,
           pp_rank: int | None = None) -> Memory:
    """The memory of the fullest pipeline rank of ``lay`` (of ``pp_rank``, if given)."""
    worst: Memory | None = None
    ranks = rank_classes(cfg.n_layers, lay.pp, lay.v, lay.split, moe_layers(cfg)) if pp_rank is None else (pp_rank,)
    for r in ranks:
        st = rank_state(cfg, lay, r)
        p, g, o = state_bytes(lay, st)
        act, buf = activation_bytes(cfg, lay, r, st)
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
        m = Memory(p, g, o, act, buf, reserved_bytes, r)
        if worst is None or m.total > worst.total:
            worst = m
    assert worst is not None
    return worst
