"""Population-based training (Jaderberg et al. 2017) over a population of trainers: every
``every`` steps the members are ranked by their validation loss; each of the worst
``fraction`` copies the weights, optimizer state and hyperparameters of one of the best
(exploit) and perturbs the hyperparameters (explore).

It rides on the same population and transfers as the tournaments (:mod:`hpcml.train.population`):
one layout in every member, so a copy is one send per rank of the source and one receive per
rank of the copier. Every draw -- which best member a copier takes, each perturbation --
comes from ``(seed, round, member)``, the same on every rank with nothing communicated, so a
resumed population makes the same choices. The job's rank 0 appends each round's ranking
and hyperparameters to ``history`` (JSON lines) for :func:`hpcml.train.population_report.plot`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcml import log, safeio, waiting
from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.train.population import (agree_stop, check_alike, member_tensors, own_score, some_finite,
                                    through_checkpoints, transfer, waits_on_divergence)

logger = log.get_logger(__name__)

#: Hyperparameters PBT knows how to read and set on a :class:`~hpcml.train.loop.TrainLoop`:
#: the base learning rate, the weight decay, the warmup's length in steps (a whole number; a
#: longer warmup set after the ramp ended takes the rate back onto the ramp) and, for a trainer
#: fed by a stream, its training buffer's policy (explored by switching to another policy).
HYPERPARAMETERS = ("lr", "weight_decay", "warmup", "buffer_policy")


@dataclass(frozen=True, kw_only=True)
class PBTConfig:
    """When PBT acts and how far it explores."""

    every: int
    """Steps between rounds (after steps ``every``, ``2 * every``, ...)."""
    fraction: float = 0.25
    """The worst this fraction of the members copy from the best this fraction (at least one each)."""
    perturb: tuple[float, ...] = (0.8, 1.25)
    """Each hyperparameter of a copier is multiplied by one of these, drawn per round and member."""
    hyperparameters: tuple[str, ...] = ("lr", "weight_decay")
    """Those explored, of :data:`HYPERPARAMETERS`; the others are copied with the weights."""
    seed: int = 0
    history: str | Path | None = None
    """JSON lines, one a round (the job's rank 0 appends); None: kept in memory only."""
    scratch: str | Path | None = None
    """A directory every rank reaches, for members of different layouts: a copy between two of
    them goes through the source's checkpoint, resharded on load. Required when such members
    can copy from each other."""

    def __post_init__(self) -> None:
        if not is_int(self.every) or self.every < 1:
            raise ConfigError(f"PBTConfig(every={self.every!r}): expected a whole number of steps >= 1")
        if self.scratch is not None and not isinstance(self.scratch, (str, Path)):
            raise ConfigError(f"PBTConfig(scratch={self.scratch!r}): expected a directory path")
        if not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 0.5:
            raise ConfigError(f"PBTConfig(fraction={self.fraction!r}): expected a fraction in (0, 0.5]: the worst "
                              f"copy from the best, two parts that must not overlap")
        if not self.perturb or not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0
                                       for f in self.perturb):
            raise ConfigError(f"PBTConfig(perturb={self.perturb!r}): expected one or more positive factors")
        unknown = [h for h in self.hyperparameters if h not in HYPERPARAMETERS]
        if unknown or not self.hyperparameters:
            raise ConfigError(f"PBTConfig(hyperparameters={self.hyperparameters!r}): expected some of "
                              f"{', '.join(HYPERPARAMETERS)}")
        if not is_int(self.seed):
            raise ConfigError(f"PBTConfig(seed={self.seed!r}): expected a whole number")


def hyperparameters(trainer: Any, buffer: Any = None) -> dict[str, Any]:
    """The loop's base learning rate (before the schedule's factor), its weight decay and its
    warmup; with the stream's ``buffer``, its policy too."""
    decayed = [g["weight_decay"] for g in trainer.optimizer.param_groups if g["weight_decay"] > 0]
    return {"lr": float(trainer.scheduler.base_lrs[0]), "weight_decay": float(decayed[0] if decayed else 0.0),
            "warmup": int(trainer.schedule.warmup), **({"buffer_policy": buffer.config.policy} if buffer else {})}


def perturbed(name: str, value: Any, rng: np.random.Generator, factors: tuple[float, ...]) -> Any:
    """``value`` times one of ``factors`` (a warmup stays a whole number of steps); a buffer
    policy switched to one of the others."""
    if name == "buffer_policy":
        from hpcml.stream.buffer import POLICIES

        return str(rng.choice([p for p in POLICIES if p != value]))
    factor = float(rng.choice(factors))
    return int(round(value * factor)) if name == "warmup" else value * factor


def set_hyperparameters(trainer: Any, values: dict[str, Any], buffer: Any = None) -> None:
    """Set the base learning rate (the schedule's factor of this step kept), the weight decay
    of the decayed parameter groups and the warmup; all are in the loop's checkpoint, so a
    resume keeps them."""
    if "lr" in values:
        f = values["lr"] / trainer.scheduler.base_lrs[0]
        trainer.scheduler.base_lrs = [b * f for b in trainer.scheduler.base_lrs]
        for g in trainer.optimizer.param_groups:
            g["initial_lr"] *= f
            g["lr"] *= f
    if buffer is not None and values.get("buffer_policy") not in (None, buffer.config.policy):
        buffer.set_policy(values["buffer_policy"])  # kept in the stream state a checkpoint saves
    if "weight_decay" in values:
        for g in trainer.optimizer.param_groups:
            if g["weight_decay"] > 0:
                g["weight_decay"] = values["weight_decay"]
    if "warmup" in values and int(values["warmup"]) != trainer.schedule.warmup:
        trainer.schedule.set_warmup(int(values["warmup"]))
        for g in trainer.optimizer.param_groups:  # this step's rate on the new schedule, as a resume sets it
            g["lr"] = g["initial_lr"] * trainer.schedule(trainer.step)
    trainer.scheduler._last_lr = [g["lr"] for g in trainer.optimizer.param_groups]


@dataclass(frozen=True)
class Round:
    """One PBT round as one member saw it."""

    round: int
    scores: list[float]
    """Every member's validation loss, by member."""
    source: int | None
    """The member this one copied (None: it kept its own)."""
    hyperparameters: list[dict[str, float]]
    """Every member's hyperparameters after the round."""


def plan(scores: list[float], fraction: float, seed: int, round_: int) -> dict[int, int]:
    """Copier -> source: the worst ``ceil``-free ``fraction`` of the members (at least one)
    each take one of the best as many, drawn from ``(seed, round_, copier)``. A NaN or
    infinite loss ranks last; ties rank by member."""
    pop = len(scores)
    if pop < 2:
        return {}
    cut = max(1, int(fraction * pop))
    order = sorted(range(pop), key=lambda m: (not math.isfinite(scores[m]), scores[m] if math.isfinite(scores[m])
                                              else 0.0, m))
    best, worst = order[:cut], order[pop - cut:]
    return {m: best[int(np.random.default_rng([seed, round_, m]).integers(cut))] for m in worst}


class PopulationBasedTraining:
    """PBT on one member of a population; also a :meth:`TrainLoop.fit` hook (``trainer.hooks``).

    ``evaluate()``: the member's validation loss of the current weights, collective over the
    member (:meth:`Trainer.evaluate`); lower is better."""

    def __init__(self, grid: Any, trainer: Any, evaluate: Callable[[], float], *, config: PBTConfig,
                 buffer: Any = None) -> None:
        if not isinstance(config, PBTConfig):
            raise ConfigError(f"PopulationBasedTraining(config={config!r}): expected a PBTConfig")
        if "buffer_policy" in config.hyperparameters and buffer is None:
            raise ConfigError("PBTConfig(hyperparameters=(..., 'buffer_policy')): this trainer has no training buffer "
                              "to explore (a population fed by a stream has: train_surrogate(population=...))")
        if grid.torch is None:
            raise ConfigError("PopulationBasedTraining: the grid has no torch.distributed yet: call grid.init_torch()")
        if len(set(getattr(grid, "member_layouts", ()))) > 1 and config.scratch is None:
            raise ConfigError("PopulationBasedTraining: the members have different layouts, so a copy between two of "
                              "them goes through a checkpoint: give PBTConfig(scratch=DIR), a directory every rank "
                              "reaches")
        writer = grid.world_comm.Get_rank() == 0
        missing = writer and config.history is not None and not Path(config.history).parent.is_dir()
        if waiting.allreduce(grid.world_comm, int(missing)):  # the writer's view, told to every rank (collective)
            raise ConfigError(f"PBTConfig(history={str(config.history)!r}): its directory does not exist")
        self.grid, self.trainer, self.evaluate, self.config, self.buffer = grid, trainer, evaluate, config, buffer
        self.history: list[Round] = []

    def __call__(self, trainer: Any, metrics: dict) -> None:
        agree_stop(self.grid, metrics)
        waits_on_divergence(trainer)
        if trainer.step % self.config.every == 0:
            r = self.play(trainer.step // self.config.every)
            metrics["pbt"] = {"round": r.round, "source": r.source, **r.hyperparameters[self.grid.member]}

    def play(self, round_: int) -> Round:
        """Round ``round_`` (collective over the whole population)."""
        g, cfg, tr = self.grid, self.config, self.trainer
        score = own_score(self.evaluate, tr.model, g.comm, getattr(tr, "diverged", False))
        scores = g.pop_comm.allgather(score)
        some_finite(scores, round_, "PBT")
        copies = plan(scores, cfg.fraction, cfg.seed, round_)
        hypers = g.pop_comm.allgather(hyperparameters(tr, self.buffer))
        tensors = member_tensors(tr.model, tr.optimizer)
        source = copies.get(g.member)
        layouts = g.member_layouts
        on_disk = {c: s for c, s in copies.items() if layouts[c] != layouts[s]}  # copies between two layouts
        near = source if source is not None and g.member not in on_disk else None
        check_alike(g, tensors, [near] if near is not None else [])
        transfer(g, tensors, send_to=sorted(c for c, s in copies.items() if s == g.member and c not in on_disk),
                 receive_from=near)
        if on_disk:  # every rank: the agreements are over the whole population
            through_checkpoints(g, tr.model, tr.optimizer, cfg.scratch, round_, save=g.member in on_disk.values(),
                                load_from=on_disk.get(g.member), what="PBT")
        for copier, src in copies.items():  # every rank works out every member's new values alike
            rng = np.random.default_rng([cfg.seed, round_, copier, 1])
            hypers[copier] = {h: (perturbed(h, hypers[src][h], rng, cfg.perturb) if h in cfg.hyperparameters
                                  else hypers[src][h]) for h in HYPERPARAMETERS if h in hypers[src]}
        if source is not None:
            set_hyperparameters(tr, hypers[g.member], self.buffer)
        out = Round(round_, scores, source, hypers)
        self.history.append(out)
        self._record(out, copies, tr.step)
        return out

    def _record(self, r: Round, copies: dict[int, int], step: int) -> None:
        if self.grid.world_comm.Get_rank() != 0:
            return
        line = safeio.finite({"round": r.round, "step": step, "members": [  # a diverged member's score: null
            {"member": m, "score": r.scores[m], "copied": copies.get(m), **r.hyperparameters[m]}
            for m in range(len(r.scores))]})
        logger.info("PBT round %d at step %d: best member %d (%.6g); %s", r.round, step,
                    min(range(len(r.scores)), key=lambda m: (not math.isfinite(r.scores[m]), r.scores[m])),
                    min(r.scores), ", ".join(f"{c} copied {s}" for c, s in sorted(copies.items())) or "no copies")
        if self.config.history is not None:
            try:
                safeio.append(self.config.history, json.dumps(line) + "\n", lines=True)
            except OSError as e:  # rank 0 alone: raising here would leave the others in the next step's collectives
                logger.error("PBT history not written to %s: %s", self.config.history, e)
