"""A sample source's state inside a trainer checkpoint: plain HDF5 tensors, never pickle.

Each trainer rank's source state (:meth:`~hpcml.stream.source.SampleSource.state`: buffer
contents, the ``(sim, step)`` keys already taken, JSON meta) is saved as
``stream/rank_NNNNN/<name>`` beside the model, and restored on any number of trainer ranks
(every saved rank's state is read; each rank keeps what routes to it now).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

from hpcml.ckpt.format import member_roots
from hpcml.errors import ConfigError
from hpcml.stream.source import SampleSource

_STATE = re.compile(r"^stream/rank_(\d{5})/(.+)$")


def source_tensors(source: SampleSource, rank: int) -> dict:
    """``stream/rank_NNNNN/<name>`` tensors of this rank's source state."""
    import torch

    return {f"stream/rank_{rank:05d}/{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in
            source.state().items() if v.size}


def load_source_states(ckpt_path) -> list[dict[str, np.ndarray]]:
    """Every saved rank's source state from checkpoint ``ckpt_path`` (plain HDF5, no pickle)."""
    from hpcml import ckpt

    states: dict[int, dict[str, np.ndarray]] = {}
    for name, t in ckpt.read_tensors(ckpt_path, "stream/").items():
        m = _STATE.match(name)
        if m:
            states.setdefault(int(m.group(1)), {})[m.group(2)] = t.numpy()
    for st in states.values():
        st.setdefault("seen", np.zeros((0, 2), np.int64))
    return [states[r] for r in sorted(states)]


def samples_in(ckpt_path) -> Counter[int]:
    """Samples per simulation that checkpoint ``ckpt_path`` holds (every trainer rank's keys)."""
    return Counter(int(sim) for st in load_source_states(ckpt_path) for sim, _ in st["seen"].tolist())


def simulations_in(ckpt_path, outputs: int | dict[int, int]) -> set[int]:
    """Simulations of which checkpoint ``ckpt_path`` holds every output (``outputs``: the
    count of each, or one count for all): their data survives a restart, so a resumed
    campaign need not run them again. One that finished after the save is not among them."""
    held = samples_in(ckpt_path)
    if isinstance(outputs, int):
        return {sim for sim, n in held.items() if n >= outputs}
    return {sim for sim, n in outputs.items() if held.get(sim, 0) >= n}


def check_campaign(ckpt_dir, campaign: str) -> None:
    """Refuse to resume ``ckpt_dir``'s latest checkpoint when it holds another campaign than ``campaign``."""
    from hpcml import ckpt

    if not campaign:
        return
    path, step, extra = ckpt.read_extra(ckpt_dir)
    saved = extra.get("campaign", "")
    if saved != campaign:
        raise ConfigError(f"checkpoint {path} (step {step}) belongs to campaign {saved or 'unknown'!r}, not "
                          f"{campaign!r}: resume that campaign, or use a new run directory")


def population_step(root) -> int | None:
    """The newest checkpoint step every ``member_K`` of ``root`` holds complete (what the
    population resumes from), or None."""
    from hpcml.ckpt.format import common_step, steps_of

    members = member_roots(root)
    return common_step([steps_of(m) for m in members]) if members else None


def resume_common(views: list[list[int]], root) -> int | None:
    """The step a population resumes from, given each member's complete steps under ``root``:
    the newest every member holds; None when no member holds any (a fresh start). ConfigError
    when some hold saves but no step is common to all: starting anew would rotate those saves
    out (a population resized, or saves made before each member's rotation spared the common
    step, :func:`hpcml.train.population_online.member_keep`)."""
    from hpcml.ckpt.format import common_step

    step = common_step(views)
    if step is None and any(views):
        held = "; ".join(f"member_{k} {', '.join(map(str, v[-3:])) if v else 'none'}" for k, v in
                         enumerate(views[:8])) + ("; ..." if len(views) > 8 else "")
        n = max(k for k, v in enumerate(views) if v) + 1
        other = (f"; they are the saves of {n} members: a population of {n} resumes them"
                 if n < len(views) and common_step(views[:n]) is not None else "")
        raise ConfigError(f"{root}: the {len(views)} members hold no checkpoint step in common (their steps: {held})"
                          f": a population resumes only from a step every member holds, and starting anew would "
                          f"rotate these saves out{other}; to start over, give another checkpoint directory or move "
                          f"these members' step directories aside (they stay readable by hpcml ckpt ls)")
    return step


def member_steps(root, pop: int) -> list[list[int]]:
    """Each of ``pop`` members' complete steps under ``root`` (``member_K``; [] for one missing)."""
    from hpcml.ckpt.format import steps_of

    found = {p.name: p for p in member_roots(root)}
    return [steps_of(found[f"member_{k}"]) if f"member_{k}" in found else [] for k in range(pop)]


def simulations_kept(root, outputs: int | dict[int, int]) -> set[int]:
    """Simulations whose every output (``outputs``, as :func:`simulations_in`) the trainer will
    resume with from checkpoint root ``root``: one trainer's ``latest``, or a population's
    (``member_K``) step that every member holds -- each simulation belongs to one member."""
    from hpcml.ckpt.format import LATEST, step_dir

    members = member_roots(root)
    if not members:
        return simulations_in(root, outputs) if (Path(root) / LATEST).exists() else set()
    step = population_step(root)
    if step is None:
        return set()
    return set().union(*(simulations_in(m / step_dir(step), outputs) for m in members))
