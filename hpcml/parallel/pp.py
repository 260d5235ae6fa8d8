"""Pipeline parallelism with ``torch.distributed.pipelining``: which stages a rank holds,
and the schedule over them (a model's plan cuts the stages)."""

from __future__ import annotations

import torch
from torch import nn

#: The schedules' classes in ``torch.distributed.pipelining``, by name. That module is imported
#: by :func:`build_schedule` only: it brings in torch's compiler stack, which a run without a
#: pipeline never uses (0.5-0.7 CPU-s of every rank's start-up, measured on llm_pretrain.py).
_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B"}


def local_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages on ``pp_rank``: looped placement ``pp_rank, pp_rank + pp, ...`` (what the interleaved
    schedule expects)."""
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def build_schedule(parts: list[nn.Module], stage_ids: list[int], n_stages: int, device: torch.device, group,
                   schedule: str, n_microbatches: int, loss_fn):
    """PipelineStage for each local part, then the schedule over them."""
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(part, sid, n_stages, device, group=group)
              for part, sid in zip(parts, stage_ids)]
    cls = getattr(pipelining, _CLASSES[schedule])
    if cls is pipelining.ScheduleInterleaved1F1B:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
