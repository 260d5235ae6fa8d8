"""The loop's state in a checkpoint's ``extra``, checked before any of it is used.

``extra`` is JSON from a file anyone may have edited: a step of -5 or 10**30, a string
where a number goes, a missing scheduler or an empty list of parameter groups must be
refused in one line that names the field, not end in a traceback -- and no key the live
objects do not have may reach ``load_state_dict`` (which sets attributes from it).
"""

from __future__ import annotations

import math
from numbers import Real

from hpcml.errors import CheckpointError
from hpcml.numeric import is_int, is_real

MAX_STEP = 1 << 53


def _where(path, field: str) -> str:
    return f"checkpoint {path}: extra[{field!r}]"


def _show(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(v) -> bool:
    return is_real(v) and math.isfinite(v)


def _like(v, live) -> bool:
    """``v`` (from JSON) has the shape of ``live`` (what the object holds now)."""
    if live is None:  # an optional flag or number (``foreach``, ``fused``)
        return v is None or _number(v) or isinstance(v, bool)
    if isinstance(live, bool):
        return isinstance(v, bool)
    if isinstance(live, int):
        return is_int(v) and abs(v) <= MAX_STEP
    if isinstance(live, Real):
        return _number(v)
    if isinstance(live, str):
        return isinstance(v, str) and len(v) <= 256
    if isinstance(live, (list, tuple)):
        return isinstance(v, list) and len(v) <= 1024 and all(_like(x, live[0] if live else None) for x in v)
    if isinstance(live, dict):
        return isinstance(v, dict) and set(v) <= set(live) and all(_like(x, live[k]) for k, x in v.items())
    return False


def check_loop_extra(extra, step: int, path, scheduler_state: dict, param_groups: list[dict]) -> None:
    """Refuse (one line) a loop state that does not fit: ``step`` is the manifest's step,
    ``scheduler_state`` and ``param_groups`` the live ones (their keys and value types are the schema)."""
    if not isinstance(extra, dict):
        raise CheckpointError(f"checkpoint {path}: extra is not a JSON object")
    saved = extra.get("step")
    if not is_int(saved) or saved != step:
        raise CheckpointError(f"{_where(path, 'step')} is {_show(saved)}: expected the saved step {step}")
    sched = extra.get("scheduler")
    if not isinstance(sched, dict) or not sched or not _like(sched, scheduler_state) \
            or any(f is not None for f in sched.get("lr_lambdas") or []):  # hpcml's schedule: a function, saved as null
        raise CheckpointError(f"{_where(path, 'scheduler')} is {_show(sched)}: expected a learning-rate scheduler "
                              f"state with keys among {sorted(scheduler_state)}")
    schedule = extra.get("schedule")
    if schedule is not None:
        anchor = schedule.get("anchor") if isinstance(schedule, dict) else None
        if not isinstance(schedule, dict) or not _steps(schedule.get("steps")) or not (
                anchor is None or isinstance(anchor, list) and len(anchor) == 2 and _steps(anchor[0], 0)
                and _number(anchor[1])) or not (schedule.get("warmup") is None or _steps(schedule["warmup"], 0)):
            raise CheckpointError(f"{_where(path, 'schedule')} is {_show(schedule)}: expected "
                                  f"{{'steps': N >= 1, 'anchor': null or [step, factor], 'warmup' (if set): N >= 0}}")
    elif not isinstance(extra.get("train_config"), dict) or not _steps(extra["train_config"].get("steps")):
        raise CheckpointError(f"{_where(path, 'schedule')} is missing and extra['train_config']['steps'] is not a "
                              f"step count: nothing to resume the learning-rate schedule from")
    groups = extra.get("param_groups")
    live = {k: v for g in param_groups for k, v in g.items() if k != "params"}
    if not isinstance(groups, list) or not groups or len(groups) > 1024 or not all(_like(g, live) for g in groups) \
            or not all(_number(g.get("initial_lr")) and g["initial_lr"] >= 0 for g in groups):
        raise CheckpointError(f"{_where(path, 'param_groups')} is {_show(groups)}: expected 1 or more optimizer "
                              f"parameter groups, each with initial_lr >= 0 and keys among {sorted(live)}")


def _steps(v, lo: int = 1) -> bool:
    return is_int(v) and lo <= v <= MAX_STEP


__all__ = ["check_loop_extra"]
