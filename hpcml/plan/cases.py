"""A published measured run as a planner case: the layout it ran and what was measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcml.plan.candidate import PlanLayout


@dataclass(frozen=True)
class Case:
    table: str
    label: str
    layout: PlanLayout
    fits: bool = True
    """The run went (False: the publisher reports an out-of-memory error)."""
    tokens_per_gpu: float | None = None
    step_s: float | None = None
    memory_gib: float | None = None
    notes: dict = field(default_factory=dict)
