"""Where a layout's parameters live: the elements of parameters, gradients and optimizer state
each pipeline rank holds, counted from the model's real parameter shapes as the plan shards them
(tp, ep, pp stages and their split, FSDP's dim-0 chunks), and which ranks are alike in them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from hpcml.errors import ConfigError
from hpcml.models.transformer import footprint as fp
from hpcml.models.transformer.config import TransformerConfig
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


def shard_ranks(lay: PlanLayout) -> int:
    """Ranks FSDP shards a dense weight over: dp x cp, a replica's share of them under HSDP."""
    return lay.dp * lay.cp // lay.dp_replicate


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
    ws = shard_ranks(lay)
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
    return _rank_state(cfg, lay.tp, lay.ep, shard_ranks(lay), lay.pp, lay.v, lay.zero, pp_rank,
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
