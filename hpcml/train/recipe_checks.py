"""Every check of an LLM run's configs before anything is built, with no torch: the layout
over the ranks, the model's plan on it, the batch and sequence split, the data -- on every rank
alike and with no collective, so a mistake is refused in one line in a fraction of a second
(:func:`hpcml.train.recipe.build_llm_trainer` runs them again, and then builds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hpcml.errors import ConfigError
from hpcml.grid.layout import DEGREE_AXES, Layout
from hpcml.models.transformer.config import TransformerConfig
from hpcml.models.transformer.rules import check_plan
from hpcml.parallel.config import ParallelConfig
from hpcml.train.config import TrainConfig, check_source


def check_llm_layout(model_cfg: TransformerConfig, train_cfg: TrainConfig, parallel_cfg: ParallelConfig,
                     world_size: int, degrees: Mapping[str, int], data: Any = None) -> Layout:
    """The layout of ``degrees`` over ``world_size`` ranks, once ``data`` (a token source, or None
    for synthetic tokens), ``model_cfg``'s plan and the batch and sequence split fit it
    (:func:`check_llm_plan`); ConfigError (or GridError) otherwise."""
    if data is not None:
        check_source(data, train_cfg.seq_len, model_cfg.vocab_size, eod=train_cfg.doc_mask_eod)
    layout = Layout.from_degrees(world_size, dict(degrees))
    check_llm_plan(model_cfg, train_cfg, parallel_cfg, layout)
    return layout


def check_llm_plan(model_cfg: TransformerConfig, train_cfg: TrainConfig, parallel_cfg: ParallelConfig,
                   layout: Layout, data: Any = None) -> None:
    """ConfigError unless ``model_cfg``'s plan, the batch and sequence split (and ``data``) fit ``layout``."""
    if data is not None:
        check_source(data, train_cfg.seq_len, model_cfg.vocab_size, eod=train_cfg.doc_mask_eod)
    check_plan(model_cfg, layout, parallel_cfg)
    train_cfg.check_layout(layout, model_cfg.max_seq_len, parallel_cfg.fpdt_chunk, parallel_cfg.loss_chunk)


class MemberConfig(NamedTuple):
    degrees: dict[str, int]
    layout: Layout
    train: TrainConfig
    parallel: ParallelConfig


def member_configs(members: Sequence[Mapping[str, Any]], model_cfg: TransformerConfig, train_cfg: TrainConfig,
                   parallel_cfg: ParallelConfig, world_size: int) -> list[MemberConfig]:
    """Each member's degrees, layout, train and parallel configs from its entry of ``members``
    (degrees such as ``{"tp": 2}``, any :class:`~hpcml.parallel.ParallelConfig` field such as
    ``"fsdp": true``, and ``micro_batch``), over its share of ``world_size`` ranks. Every
    member's plan is checked here, on every rank and with no collective: one member's mistake
    is refused in one line by all of them, never after the others have entered torch's set-up."""
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    if world_size % len(members):
        raise ConfigError(f"{len(members)} members do not split {world_size} ranks evenly: every member needs as "
                          f"many ranks")
    out = []
    for i, entry in enumerate(members):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"member {i}: {entry!r} is not a mapping: expected an object such as {{\"tp\": 2}}")
        odd = sorted(str(k) for k in entry if k not in DEGREE_AXES and k not in fields and k != "micro_batch")
        if odd:
            raise ConfigError(f"member {i} ({dict(entry)}): unknown keys {odd}: expected degrees "
                              f"({', '.join(DEGREE_AXES)}), ParallelConfig fields (fsdp, activation_checkpointing, "
                              f"...) or micro_batch")
        degrees = {k: v for k, v in entry.items() if k in DEGREE_AXES}
        try:
            par = dataclasses.replace(parallel_cfg, **{k: v for k, v in entry.items() if k in fields})
            train = dataclasses.replace(train_cfg, **({"micro_batch": entry["micro_batch"]}
                                                      if "micro_batch" in entry else {}))
            layout = check_llm_layout(model_cfg, train, par, world_size // len(members), degrees)
        except (ValueError, TypeError) as e:  # ConfigError and GridError are ValueErrors
            raise ConfigError(f"member {i} ({dict(entry)}): {' '.join(str(e).split())}") from None
        out.append(MemberConfig(degrees, layout, train, par))
    return out


def resume_point(ckpt_dir: str | Path, pop: int = 1, steps: int | None = None) -> tuple[int, str] | None:
    """(step, where) of what a run resumes from, its manifests (and signatures) checked as the
    load will check them: ``ckpt_dir``'s ``latest`` or the step directory given, for one trainer
    (missing or broken: the load's error, raised here on every rank, before any collective); the
    newest step every ``member_K`` holds, for a population of ``pop`` -- every member's manifest
    read only when that step is at least ``steps`` (nothing left to train: the caller acts on it
    before any load; otherwise each member's load checks its own); None when no member holds
    any (members' saves with no step in common: the ConfigError of
    :func:`~hpcml.train.online_state.resume_common`, here, before torch)."""
    from hpcml import ckpt
    from hpcml.ckpt.format import step_dir
    from hpcml.train.online_state import member_steps, resume_common

    if pop == 1:
        with ckpt.Checkpoint(ckpt_dir) as saved:
            return saved.step, str(saved.path)
    step = resume_common(member_steps(ckpt_dir, pop), ckpt_dir)
    if step is None:
        return None
    if steps is None or step >= steps:
        for k in range(pop):
            ckpt.Checkpoint(Path(ckpt_dir) / f"member_{k}" / step_dir(step)).close()
    return step, f"{ckpt_dir} (every member's {step_dir(step)})"
