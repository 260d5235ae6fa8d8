"""What a framework other than hpcml cannot run, as a one-line reason (the layout's and the
search's shared rule)."""

from __future__ import annotations


def deepspeed_refuses(pp: int, zero: int, schedule: str, overlap: bool) -> str | None:
    """Why Megatron-DeepSpeed cannot run these settings, or None: its pipeline engine runs one
    schedule (1F1B) and ZeRO 0-1 only (``ZeRO-2 and ZeRO-3 are incompatible with pipeline
    parallelism``); its BF16_Optimizer reduces gradients after the last micro-batch, with nothing
    to overlap."""
    if pp > 1 and zero >= 2:
        return (f"framework deepspeed with pp {pp} and zero {zero}: DeepSpeed's pipeline engine runs ZeRO 0 or 1 "
                f"only (ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism) -- use zero 1, or pp 1")
    if pp > 1 and schedule != "1f1b":
        return (f"framework deepspeed with schedule {schedule}: DeepSpeed's pipeline engine runs 1F1B only "
                f"(its TrainSchedule) -- use schedule 1f1b")
    if overlap and zero < 2:
        return (f"framework deepspeed with overlap at zero {zero}: DeepSpeed's BF16_Optimizer all-reduces the "
                f"gradients after the last micro-batch, with nothing to overlap -- drop overlap")
    return None
