"""The transformer's plan rules as pure arithmetic (no torch): which layouts it can take and
which layers each pipeline stage holds. Every rank checks them alike before any collective
(:mod:`~hpcml.models.transformer.parallelize`), and the planner (:mod:`hpcml.plan`) enumerates with them."""

from __future__ import annotations

from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.models.transformer.config import TransformerConfig
from hpcml.parallel.config import ParallelConfig, pipeline_refuses, split_layers


def check_plan(model: TransformerConfig, layout: Layout, config: ParallelConfig, *, stages: bool = True) -> None:
    """Raise :class:`ConfigError` unless ``model`` can be laid out on ``layout``.

    Pure arithmetic on arguments every rank holds alike: call it before any collective
    (``hpcml.parallel.parallelize`` does), so a bad plan fails on every rank and nothing hangs.
    ``stages`` False: the split of layers over pipeline stages is another framework's (the planner's).
    """
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    for name, value in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads), ("ffn hidden", model.hidden),
                        ("padded vocab", model.padded_vocab)):
        if value % tp:
            raise ConfigError(f"{name} {value} is not divisible by tp {tp}")
    for name, value in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads)):
        if config.cp_kind == "ulysses" and (value // tp) % cp:
            raise ConfigError(f"{name} {value} / tp {tp} = {value // tp} heads per rank is not divisible by cp {cp} "
                              f"(Ulysses splits heads over cp; cp_kind allgather does not)")
    if model.dim % tp:
        raise ConfigError(f"dim {model.dim} is not divisible by tp {tp}")
    if model.tie_embeddings and (tp > 1 or pp > 1):
        raise ConfigError(f"tie_embeddings needs tp 1 and pp 1, got tp {tp}, pp {pp}")
    if config.sequence_parallel and model.positions == "learned":
        raise ConfigError("sequence_parallel with learned positions is not supported: the embedding's output is "
                          "already split over tp there; use tp without it, or rotary positions")
    if model.positions == "alibi" and config.fpdt_chunk:
        raise ConfigError(f"positions alibi with fpdt_chunk {config.fpdt_chunk}: FPDT's chunked attention takes no "
                          f"biases; use cp_kind ulysses or allgather without fpdt_chunk, or rotary positions")
    if config.sequence_parallel and cp > 1:
        raise ConfigError(f"sequence_parallel (Megatron-SP over tp) with cp {cp} > 1 is not supported: use cp alone")
    why = pipeline_refuses(config, pp)
    if why:
        raise ConfigError(why)
    if model.n_experts:
        check_moe_plan(model, layout, config)
    elif layout.moe:
        raise ConfigError(f"ep {layout.ep} (etp {layout.etp}) needs a MoE model: n_experts is 0")
    n_stages = pp * config.n_stages_per_rank
    if stages and (pp > 1 or config.layers_per_stage is not None):
        if config.layers_per_stage is not None:
            if len(config.layers_per_stage) != n_stages or sum(config.layers_per_stage) != model.n_layers \
                    or min(config.layers_per_stage) < 1:
                raise ConfigError(f"layers_per_stage {list(config.layers_per_stage)} must give each of {n_stages} "
                                  f"stages >= 1 layer and sum to n_layers {model.n_layers}")
        elif model.n_layers < n_stages:
            raise ConfigError(f"n_layers {model.n_layers} < pipeline stages {n_stages} "
                              f"(pp {pp} x {config.n_stages_per_rank} stages per rank)")


def check_moe_plan(model: TransformerConfig, layout: Layout, config: ParallelConfig) -> None:
    """The MoE part of :func:`check_plan`: experts split evenly over ep, tp slices of every
    expert (expert tensor parallelism is tp's: etp = tp)."""
    if model.n_experts % layout.ep:
        raise ConfigError(f"n_experts {model.n_experts} is not divisible by ep {layout.ep}")
    if layout.etp != layout.tp:
        raise ConfigError(f"etp {layout.etp} != tp {layout.tp}: the transformer's experts are tensor-parallel over "
                          f"tp itself (leave etp unset)")
    for name, value in (("expert hidden", model.expert_hidden), ("moe_shared_hidden", model.moe_shared_hidden)):
        if value % layout.tp:
            raise ConfigError(f"{name} {value} is not divisible by tp {layout.tp}")
    if config.sequence_parallel:
        raise ConfigError("sequence_parallel with a MoE model is not supported: tokens stay replicated over tp")


def stage_layers(model: TransformerConfig, n_stages: int, config: ParallelConfig) -> list[list[int]]:
    """Layer indices of every stage, stage 0 first."""
    counts = list(config.layers_per_stage) if config.layers_per_stage else split_layers(model.n_layers, n_stages)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
