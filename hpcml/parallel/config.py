"""How to parallelise a model on the grid, and the checks that run before any collective."""

from __future__ import annotations

from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.models.transformer import TransformerConfig

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Choices for each axis; the degrees themselves come from the grid's layout."""

    fsdp: bool = False
    """dp: shard parameters, gradients and optimizer state with FSDP2 (ZeRO-3-like); False: replicate and all-reduce gradients (DDP)."""
    reshard_after_forward: bool = True
    """FSDP only: False keeps parameters gathered from forward to backward (ZeRO-2-like: more memory, fewer all-gathers)."""
    sequence_parallel: bool = False
    """tp: shard norms and residuals along the sequence between tensor-parallel regions (Megatron-SP)."""
    pp_schedule: str = "1f1b"
    """gpipe, 1f1b or interleaved1f1b."""
    stages_per_rank: int | None = None
    """Pipeline stages on each pp rank; None: 2 for interleaved1f1b, else 1."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit split of the layers over all stages; None: the balanced rule of :func:`split_layers`."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""

    def __post_init__(self) -> None:
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"pp_schedule {self.pp_schedule!r} unknown: expected one of {', '.join(PP_SCHEDULES)}")
        if self.stages_per_rank is not None and self.stages_per_rank < 1:
            raise ConfigError(f"stages_per_rank must be >= 1, got {self.stages_per_rank}")
        if self.pp_schedule == "interleaved1f1b" and self.stages_per_rank == 1:
            raise ConfigError("interleaved1f1b needs stages_per_rank >= 2, got 1")
        if self.pp_schedule != "interleaved1f1b" and (self.stages_per_rank or 1) != 1:
            raise ConfigError(f"{self.pp_schedule} runs one stage per rank, got stages_per_rank {self.stages_per_rank}")

    @property
    def n_stages_per_rank(self) -> int:
        return self.stages_per_rank or (2 if self.pp_schedule == "interleaved1f1b" else 1)


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage: as even as possible; the remainder goes to the stages nearest the
    middle, and the first and last stages (which also hold the embedding and the output
    layer) get an extra layer only when every middle stage has one.
    """
    if n_layers < n_stages:
        raise ConfigError(f"n_layers {n_layers} < pipeline stages {n_stages}: every stage needs at least one layer")
    base, rem = divmod(n_layers, n_stages)
    centre = (n_stages - 1) / 2
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1) and n_stages > 2, abs(s - centre), s))
    counts = [base] * n_stages
    for s in order[:rem]:
        counts[s] += 1
    return counts


def check_plan(model: TransformerConfig, layout: Layout, config: ParallelConfig) -> None:
    """Raise :class:`ConfigError` unless ``model`` can be laid out on ``layout``.

    Pure arithmetic on arguments every rank holds alike: call it before any collective
    (``hpcml.parallel.parallelize`` does), so a bad plan fails on every rank and nothing hangs.
    """
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    for name, value in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads), ("ffn hidden", model.hidden),
                        ("padded vocab", model.padded_vocab)):
        if value % tp:
            raise ConfigError(f"{name} {value} is not divisible by tp {tp}")
    for name, value in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads)):
        if (value // tp) % cp:
            raise ConfigError(f"{name} {value} / tp {tp} = {value // tp} heads per rank is not divisible by cp {cp} "
                              f"(Ulysses splits heads over cp)")
    if model.dim % tp:
        raise ConfigError(f"dim {model.dim} is not divisible by tp {tp}")
    if model.tie_embeddings and (tp > 1 or pp > 1):
        raise ConfigError(f"tie_embeddings needs tp 1 and pp 1, got tp {tp}, pp {pp}")
    if config.sequence_parallel and cp > 1:
        raise ConfigError(f"sequence_parallel (Megatron-SP over tp) with cp {cp} > 1 is not supported: use cp alone")
    n_stages = pp * config.n_stages_per_rank
    if pp > 1 or config.layers_per_stage is not None:
        if config.layers_per_stage is not None:
            if len(config.layers_per_stage) != n_stages or sum(config.layers_per_stage) != model.n_layers \
                    or min(config.layers_per_stage) < 1:
                raise ConfigError(f"layers_per_stage {list(config.layers_per_stage)} must give each of {n_stages} "
                                  f"stages >= 1 layer and sum to n_layers {model.n_layers}")
        elif model.n_layers < n_stages:
            raise ConfigError(f"n_layers {model.n_layers} < pipeline stages {n_stages} "
                              f"(pp {pp} x {config.n_stages_per_rank} stages per rank)")


def stage_layers(model: TransformerConfig, layout: Layout, config: ParallelConfig) -> list[list[int]]:
    """Layer indices of every stage, stage 0 first."""
    n_stages = layout.pp * config.n_stages_per_rank
    counts = list(config.layers_per_stage) if config.layers_per_stage else split_layers(model.n_layers, n_stages)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
