"""A population of surrogate trainers fed by one online campaign (issue 45).

``train_surrogate(..., population=PopulationConfig(members=K, tournament=TournamentConfig(every=N)))``
runs K members (``ProcessGrid(pop=K, dp=-1)``) in one training job. The job's ranks are the
stream's trainer ranks as before -- the campaign, its routing and its exactly-once accounting
do not change -- but they are numbered member-fastest: rank ``r`` of member ``m`` is stream
rank ``r * K + m``. With round-robin routing (``sim % ranks``) every simulation of member
``m`` is then one with ``sim % K == m``, whatever the number of ranks a member has, so each
member trains on its own simulations, each sample reaching exactly one member exactly once,
and a member resumed on another number of ranks keeps its own simulations.

Every member steps together: the data plumbing (the loader's agreement before every step,
the drain, the summary) runs over the whole job, so tournaments and PBT rounds come at the same
step in every member. Each member checkpoints to ``ckpt_dir/member_K``; a resume loads the
newest step every member holds (a save killed in one member but not another is not half
resumed). Tournaments score on the member's share of the held-out files; what the campaign
steers by -- the held-out error during and after training -- is the best member's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcml import log
from hpcml.ckpt.format import Keep
from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.train.pbt import PBTConfig
from hpcml.train.population import TournamentConfig

logger = log.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class PopulationConfig:
    """K members of one layout in one training job, and how they select (``repr()`` rebuilds
    it but for ``configure``)."""

    members: int
    """K: the job's ranks split into K equal members (the job's ranks must be a multiple)."""
    tournament: TournamentConfig | None = None
    """LTFB tournaments (:class:`~hpcml.train.population.Tournament`); None: none."""
    pbt: PBTConfig | None = None
    """Population-based training instead (:class:`~hpcml.train.pbt.PopulationBasedTraining`)."""
    configure: Callable[[int, Any], Any] | None = None
    """``configure(member, config) -> config``: a member's own trainer config (its learning
    rate, say); each member's seed is already the config's plus its index."""

    def __post_init__(self) -> None:
        if not is_int(self.members) or self.members < 1:
            raise ConfigError(f"PopulationConfig(members={self.members!r}): expected a whole number of members >= 1")
        if self.tournament is not None and not isinstance(self.tournament, TournamentConfig):
            raise ConfigError(f"PopulationConfig(tournament={self.tournament!r}): expected a TournamentConfig")
        if self.pbt is not None and not isinstance(self.pbt, PBTConfig):
            raise ConfigError(f"PopulationConfig(pbt={self.pbt!r}): expected a PBTConfig")
        if self.tournament is not None and self.pbt is not None:
            raise ConfigError("PopulationConfig: tournament and pbt both given: a population selects one way")
        if self.configure is not None and not callable(self.configure):
            raise ConfigError(f"PopulationConfig(configure={self.configure!r}): expected a function (member, "
                              f"config) -> config")


def stream_rank(grid: Any) -> int:
    """This rank's place among the stream's trainer ranks: member-fastest (module docstring)."""
    return grid.rank * grid.pop + grid.member


def stream_comm(grid: Any):
    """The job's ranks in stream order (:func:`stream_rank`): the communicator of the data
    plumbing. One member: the member's own."""
    if grid.pop == 1:
        return grid.comm
    return grid.world_comm.Split(color=0, key=stream_rank(grid))


def member_path(path: str | Path | None, grid: Any) -> str | None:
    """``path/member_K`` for a member of a population (``path`` itself for one trainer)."""
    if path is None or grid.pop == 1:
        return None if path is None else str(path)
    return str(Path(path) / f"member_{grid.member}")


def member_keep(ckpt_dir: str | Path, grid: Any, keep: int | None) -> int | Keep | None:
    """What a member's saves under ``ckpt_dir`` (its ``member_K``) keep: the newest ``keep``
    and the newest step every member holds, which a save killed in one member after another's
    finished leaves the population to resume from (:class:`~hpcml.ckpt.format.Keep`)."""
    if getattr(grid, "pop", 1) == 1 or not keep:
        return keep
    return Keep(last=keep, group=tuple(Path(ckpt_dir).parent / f"member_{k}" for k in range(grid.pop)))


def member_dir(run_dir: str | None, grid: Any) -> str | None:
    """A member's own directory ``run_dir/member_K`` (its metrics and report), made here if
    missing; a link or a file put there is refused, never followed."""
    path = member_path(run_dir, grid)
    if path is None or grid.pop == 1:
        return path
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    if os.path.islink(path) or not os.path.isdir(path):
        raise ConfigError(f"{path} is not a directory (a link or a file is there): the population's member "
                          f"{grid.member} keeps its metrics in a directory hpcml makes; remove it")
    return path


class MemberShard:
    """A member's own share of a token source: its global batches are the source's ``first``,
    ``first + k``, ``first + 2k``, ... (member m of K takes ``first = m``), so no two members
    train on one sequence; everything else is the source's."""

    def __init__(self, source: Any, k: int, first: int) -> None:
        self.source, self.k, self.first = source, k, first
        if hasattr(source, "rows"):
            self.rows = lambda step, n, lo, hi: source.rows(first + step * k, n, lo, hi)

    def global_batch(self, step: int, n: int):
        return self.source.global_batch(self.first + step * self.k, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def member_share(files: list, grid: Any) -> list:
    """A member's share of the held-out files (every K-th, sorted), or all of them while there
    are fewer than K: what its tournaments score on."""
    files = sorted(str(f) for f in files)
    return files[grid.member::grid.pop] if len(files) >= grid.pop else files


def selection_hook(grid: Any, trainer: Any, score: Callable[[], float], config: PopulationConfig,
                   record: str | Path | None = None, buffer: Any = None):
    """The trainer hook of ``config``'s selection (a Tournament or a PBT round), or None. With
    ``record``, the member's rank 0 appends each tournament's outcome there (a JSON line with
    its step): the step's metrics are written before the hooks run. ``buffer``: the member's
    training buffer, whose policy PBT may explore."""
    if config.pbt is not None:
        from hpcml.train.pbt import PopulationBasedTraining

        return PopulationBasedTraining(grid, trainer, score, config=config.pbt, buffer=buffer)
    if config.tournament is None:
        return None
    from hpcml.train.population import Tournament

    tournament = Tournament(grid, trainer.model, score, optimizer=trainer.optimizer, config=config.tournament)
    if record is None:
        return tournament

    def play(tr: Any, metrics: dict) -> None:
        tournament(tr, metrics)
        if "tournament" in metrics and grid.rank == 0:
            from hpcml import safeio

            line = safeio.finite({"step": tr.step, **metrics["tournament"]})  # a diverged member's score: null
            safeio.append(record, json.dumps(line) + "\n", lines=True)

    return play


def resume_step(root: str | Path, grid: Any) -> int | None:
    """The newest checkpoint step every member of ``grid``'s population finds complete in its
    ``root`` (its own directory); None when no member holds any (a fresh start), ConfigError on
    every rank when some do but none in common (:func:`~hpcml.train.online_state.resume_common`).
    Collective over the job."""
    from hpcml.ckpt.format import steps_of
    from hpcml.train.online_state import resume_common

    comm = grid.world_comm
    seen = dict(comm.allgather((grid.member, steps_of(root))))  # each member's ranks see its directory alike
    views = [seen.get(k, []) for k in range(grid.pop)]
    step = resume_common(views, Path(root).parent)
    if step is not None and comm.Get_rank() == 0 and any(v[-1] != step for v in views):
        logger.warning("population: resuming every member at step %d, the newest all of them hold (some saved "
                       "later)", step)
    return step


def member_resume(ckpt_dir: str | Path, grid: Any, *, required: bool) -> Path | None:
    """The step directory of ``ckpt_dir`` (a member's) to resume: the newest every member
    holds; None when none holds any (``required``: a ConfigError on every rank; saves held
    but none in common: always one, :func:`resume_step`).
    Collective over the job."""
    from hpcml.ckpt.format import step_dir

    step = resume_step(ckpt_dir, grid)
    if step is None:
        if required:
            raise ConfigError(f"resume: the {grid.pop} members hold no checkpoint step in common under "
                              f"{Path(ckpt_dir).parent} (each saves to member_K): nothing to resume")
        return None
    return Path(ckpt_dir) / step_dir(step)


def best_of(grid: Any, figures: dict[str, float]) -> tuple[dict[str, float], list[float]]:
    """The population's best member's held-out figures (lowest ``val_rel_l2``; a NaN never
    wins) with ``val_best_member``, and every member's error; collective over the job."""
    views = grid.pop_comm.allgather(figures)
    errs = [float(v.get("val_rel_l2", math.nan)) for v in views]
    best = lowest(errs)
    if best is None:
        return figures, errs
    return {**views[best], "val_best_member": float(best)}, errs


def lowest(scores: list[float]) -> int | None:
    """The member with the lowest score (ties: the first), a NaN or infinity never; None when
    no score is finite."""
    finite = [m for m, x in enumerate(scores) if math.isfinite(x)]
    return min(finite, key=lambda m: (scores[m], m)) if finite else None


#: The record of the best member's checkpoint made the run's own (:func:`export_best`).
BEST_RECORD = "best.json"


def export_best(root: str | Path, member: int) -> Path | None:
    """Make member ``member``'s newest checkpoint the population's own: its step directory
    hard-linked into ``root`` beside the ``member_K`` directories (:func:`hpcml.ckpt.linking.link_step`),
    ``root/latest`` naming it and ``root/best.json`` saying whose it is, so anything that loads
    the run's ``checkpoints/`` (``hpcml ckpt``, ``resolve``, a user's inference script) gets the
    best model; the earlier export, if another step, is removed. A step directory of ``root``
    that an earlier export did not make (one trainer's save in a run directory used twice) is
    never replaced: None, with a warning."""
    import shutil

    from hpcml import safeio
    from hpcml.ckpt.format import STEP_RE, resolve
    from hpcml.ckpt.linking import link_step

    root = Path(root)
    src = resolve(root / f"member_{member}")
    record = safeio.read_json(root / BEST_RECORD, 4096, error=None, expected="a population's best-member record")
    prev = record.get("step_dir") if isinstance(record, dict) else None
    prev = prev if isinstance(prev, str) and STEP_RE.match(prev) else None  # the export before, if any
    if ((root / src.name).exists() or (root / src.name).is_symlink()) and prev != src.name:
        logger.warning("population: %s is not an earlier export of the best member: the best member's checkpoint "
                       "stays in %s only", root / src.name, src.parent)
        return None
    safeio.replace(root / BEST_RECORD, json.dumps({"member": member, "step_dir": src.name}) + "\n", fsync=True)
    dst = link_step(src, root, replace=prev == src.name)
    if prev and prev != src.name and (root / prev).is_dir() and not (root / prev).is_symlink():
        shutil.rmtree(root / prev)  # the earlier export, superseded: its files live on in the member's directory
    return dst
