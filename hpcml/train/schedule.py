"""The learning-rate schedule: linear warmup, then cosine to a floor -- and what happens to
it when a run is resumed with a different number of steps.

The rule for a changed ``steps`` on resume (the schedule is *stretched from the saved
step*): the learning rate goes on from exactly the value it had at the saved step and
follows a cosine from there to ``min_lr_ratio`` at the new last step. Resuming with the
same ``steps`` continues the original schedule bitwise; a run extended twice is stretched
twice. (Keeping the old schedule would leave every added step at the floor; restarting it
would jump the rate back up, which is what torch's ``LambdaLR`` does on its own.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class WarmupCosine:
    """Factor of the base learning rate at each (0-based) step."""

    warmup: int
    steps: int
    min_ratio: float
    anchor: tuple[int, float] | None = None
    """(step, factor) the cosine starts from after a resume with a changed ``steps``; None:
    from the end of the warmup, at factor 1."""
    warmup_set: bool = False
    """``warmup`` was set during the run (PBT explores it), not taken from the config: saved
    with the schedule, and a resume keeps it."""

    @classmethod
    def of(cls, cfg) -> WarmupCosine:
        """The schedule a loop config (``warmup_steps``, ``steps``, ``min_lr_ratio``) asks for."""
        return cls(warmup=cfg.warmup_steps, steps=cfg.steps, min_ratio=cfg.min_lr_ratio)

    def __call__(self, step: int) -> float:
        if self.anchor is not None and step >= self.anchor[0]:
            start, top = self.anchor
        elif step < self.warmup:
            return (step + 1) / self.warmup
        else:
            start, top = self.warmup, 1.0
        progress = min(1.0, (step - start) / max(1, self.steps - start))
        return self.min_ratio + (top - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def state(self) -> dict:
        return {"steps": self.steps, "anchor": list(self.anchor) if self.anchor else None,
                **({"warmup": self.warmup} if self.warmup_set else {})}

    def set_warmup(self, warmup: int) -> None:
        """Warm up over ``warmup`` steps from now on (kept in :meth:`state`)."""
        self.warmup, self.warmup_set = int(warmup), True

    def resume(self, step: int, saved: dict) -> None:
        """Continue from ``step`` of the schedule ``saved`` (:meth:`state`) by the stretch rule;
        a warmup set during the saved run (``saved["warmup"]``) is kept."""
        if saved.get("warmup") is not None:
            self.set_warmup(saved["warmup"])
        old = WarmupCosine(warmup=self.warmup, steps=int(saved["steps"]), min_ratio=self.min_ratio,
                           anchor=tuple(saved["anchor"]) if saved.get("anchor") else None)
        if old.steps == self.steps:
            self.anchor = old.anchor
        elif step < self.warmup:
            self.anchor = None
        else:
            self.anchor = (step, old(step))
