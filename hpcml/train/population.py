"""Tournaments of a population of trainers (LBANN's LTFB): pairs of members swap their models
and each keeps the one that scores better on its own held-out data.

A population is ``ProcessGrid(pop=K, ...)``: K members of one layout, each a grid and a torch
mesh of its own over its ranks, each training on its own data. Every ``every`` steps the
members are paired by a permutation drawn from ``(seed, round)`` -- the same on every rank,
with nothing communicated -- and partners swap weights (and optimizer state) between the
ranks at the same place of the two grids (``grid.pop_comm``, torch's ``pop`` mesh axis). One
layout means each rank's shards are its partner's: the swap is one send and one receive per
rank, bit for bit, no gather and no reshard. Members of different layouts
(``ProcessGrid(members=[...])``) swap through checkpoints instead, resharded on load. Each
member then scores its own model and its partner's on its own validation data (``evaluate``,
collective over the member) and keeps the winner; a tie keeps its own, and a diverged model
(a NaN or infinite loss) loses to any finite one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpcml import log, waiting
from hpcml.ckpt.state import training_tensors
from hpcml.errors import ConfigError, HpcmlError, PopulationDivergedError
from hpcml.numeric import is_int
from hpcml.parallel import dp

logger = log.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class TournamentConfig:
    """When tournaments happen and what a swap carries."""

    every: int
    """Steps between tournaments (after steps ``every``, ``2 * every``, ...)."""
    seed: int = 0
    """Seeds the pairing of every round (the same on every rank)."""
    optimizer: bool = True
    """Swap the optimizer state with the weights (a winner keeps training as it did); False:
    each member keeps its own moments (LBANN's default exchanges the model only)."""
    scratch: str | Path | None = None
    """A directory every rank reaches, for members of different layouts
    (``ProcessGrid(members=[...])``): they swap through checkpoints written there -- one a
    member, the last round's kept -- resharded on load. Required when such members meet."""

    def __post_init__(self) -> None:
        if not is_int(self.every) or self.every < 1:
            raise ConfigError(f"TournamentConfig(every={self.every!r}): expected a whole number of steps >= 1")
        if not is_int(self.seed):
            raise ConfigError(f"TournamentConfig(seed={self.seed!r}): expected a whole number")
        if self.scratch is not None and not isinstance(self.scratch, (str, Path)):
            raise ConfigError(f"TournamentConfig(scratch={self.scratch!r}): expected a directory path")
        if not isinstance(self.optimizer, bool):
            raise ConfigError(f"TournamentConfig(optimizer={self.optimizer!r}): expected True or False")


def pairing(pop: int, round_: int, seed: int = 0) -> list[int]:
    """Each member's partner in tournament ``round_``: a permutation drawn from ``(seed, round_)``
    cut into consecutive pairs; with an odd ``pop`` the last one of it sits out (its own partner)."""
    order = np.random.default_rng([seed, round_]).permutation(pop)
    partner = list(range(pop))
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = int(b), int(a)
    return partner


@dataclass(frozen=True)
class Outcome:
    """One member's tournament: who it met, both scores on its own data, what it kept."""

    round: int
    partner: int
    own_score: float
    partner_score: float
    kept: str
    """``own``, ``partner`` (its model now holds the partner's weights) or ``alone`` (no partner this round)."""


def agree_stop(grid: Any, metrics: dict) -> None:
    """A stop (the walltime warning) seen by any member stops every member after this step: a
    member that ran on would wait forever in its next round for one that had stopped. The
    selection hooks call it after every step (collective over the job; hooks before it see the
    member's own flag, hooks after it the population's)."""
    metrics["stop"] = bool(waiting.allreduce(grid.world_comm, int(bool(metrics.get("stop")))))


def waits_on_divergence(trainer: Any) -> None:
    """A selection hook's trainer: a member that diverges waits for the next round, which gives
    it a finite model (:attr:`TrainLoop.divergence_waits`), instead of ending the job."""
    if hasattr(trainer, "divergence_waits"):
        trainer.divergence_waits = True


def own_score(evaluate: Callable[[], float], model: Any, comm: Any, diverged: bool) -> float:
    """A member's score of its own model at a round: NaN while it is diverged (its steps skipped:
    :attr:`TrainLoop.diverged`, agreed over its ranks), whatever its weights score -- a model
    that cannot take a step must lose, and its loss may still read finite."""
    return math.nan if diverged else scored(evaluate, model, comm)


def some_finite(scores: list[float], round_: int, what: str) -> None:
    """Every member's score of a round (the same list on every rank): none finite is a
    :class:`PopulationDivergedError` on every rank, before anything moves."""
    if not any(math.isfinite(x) for x in scores):
        raise PopulationDivergedError(f"every member of the population diverged: none has a model that takes finite "
                                      f"steps and scores finite on its held-out data at {what} round {round_} (scores "
                                      f"{scores}) -- lower the learning rate, or look for non-finite values in the "
                                      f"data")


def beats(theirs: float, own: float) -> bool:
    """Lower wins; a diverged model (NaN or infinite loss) loses to any finite one, and a tie keeps one's own."""
    if not math.isfinite(own):
        return math.isfinite(theirs)
    return math.isfinite(theirs) and theirs < own


def reshard(model: Any) -> None:
    """FSDP's parameters of ``model`` (a ``ParallelModel``'s parts, or an ``nn.Module``) back to their shards."""
    dp.reshard(getattr(model, "parts", None) or [model])


def member_state(model: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """The model's weights (and the optimizer's state) by name, FSDP sharded first: what a swap
    moves (in memory as this rank's shards, or through a checkpoint)."""
    reshard(model)
    return training_tensors(model.named_parameters(), optimizer, create=optimizer is not None)


def member_tensors(model: Any, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """This rank's shards of :func:`member_state`, in name order. With one layout, the same
    list on the same place of every member."""
    named = member_state(model, optimizer)
    return [named[n].to_local() if hasattr(named[n], "to_local") else named[n] for n in sorted(named)]


def scored(evaluate: Callable[[], float], model: Any, comm: Any) -> float:
    """``evaluate()``, the same on every rank of the member (its rank 0's), with FSDP sharded
    again after it: a forward leaves the root's parameters gathered, and a transfer moves shards."""
    try:
        return float(waiting.bcast(comm, float(evaluate())))  # rank 0's evaluation may take longer
    finally:
        reshard(model)


def check_alike(grid: Any, tensors: list[torch.Tensor], peers: list[int]) -> None:
    """The same shapes and dtypes as every member in ``peers`` holds at this rank's place,
    checked before anything moves; a mismatch anywhere is the same error on every rank of the
    population (one allgather and one all-reduce over the job)."""
    sig = hashlib.sha256(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()).hexdigest()
    sigs = grid.pop_comm.allgather(sig)
    bad = grid.world_comm.allreduce(int(any(sigs[p] != sig for p in peers)))
    if bad:
        raise ConfigError(f"population: {bad} rank(s) hold tensors of other shapes or dtypes than a member they "
                          f"exchange with (one layout, model and optimizer in every member expected)")


def transfer(grid: Any, tensors: list[torch.Tensor], *, send_to: list[int], receive_from: int | None) -> torch.Tensor:
    """Send ``tensors`` (packed) to the rank at this rank's place in each member of ``send_to``
    and, with ``receive_from``, copy that member's into them; the packed bytes sent are
    returned (to restore them). Every rank of the job calls it, with or without a part."""
    ours = pack(tensors)
    theirs = torch.empty_like(ours) if receive_from is not None else None
    ops = [dist.P2POp(dist.isend, ours, grid.torch_rank_of(m), group=grid.torch.pop_group) for m in send_to]
    if theirs is not None:
        ops.append(dist.P2POp(dist.irecv, theirs, grid.torch_rank_of(receive_from), group=grid.torch.pop_group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if theirs is not None:
        unpack(tensors, theirs)
    return ours


class Tournament:
    """LTFB on one member of a population; also a :meth:`TrainLoop.fit` hook (``hooks=[t]``).

    ``model``: anything with ``named_parameters()`` (an ``nn.Module``, a ``ParallelModel``);
    ``evaluate()``: the member's validation loss of the current weights, collective over the
    member and the same on its ranks (:meth:`Trainer.evaluate`); lower wins."""

    def __init__(self, grid: Any, model: Any, evaluate: Callable[[], float], *, config: TournamentConfig,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        if not isinstance(config, TournamentConfig):
            raise ConfigError(f"Tournament(config={config!r}): expected a TournamentConfig")
        if grid.torch is None:
            raise ConfigError("Tournament: the grid has no torch.distributed yet: call grid.init_torch() first")
        if len(set(getattr(grid, "member_layouts", ()))) > 1 and config.scratch is None:
            raise ConfigError("Tournament: the members have different layouts, so they swap through checkpoints: "
                              "give TournamentConfig(scratch=DIR), a directory every rank reaches")
        self.grid, self.model, self.evaluate, self.config = grid, model, evaluate, config
        self.optimizer = optimizer if config.optimizer else None
        self.history: list[Outcome] = []

    def __call__(self, trainer: Any, metrics: dict) -> None:
        """The fit hook: a round after every ``every`` steps; its outcome lands in the step's metrics."""
        agree_stop(self.grid, metrics)
        waits_on_divergence(trainer)
        if trainer.step % self.config.every == 0:
            metrics["tournament"] = asdict(self.play(trainer.step // self.config.every,
                                                     diverged=getattr(trainer, "diverged", False)))

    def play(self, round_: int, *, diverged: bool = False) -> Outcome:
        """Round ``round_`` (collective over the whole population: every member calls it).
        ``diverged``: this member's steps are being skipped (:attr:`TrainLoop.diverged`): its
        model loses to any partner's that is not, and its partner never takes it."""
        g = self.grid
        views = set(g.world_comm.allgather((self.config.seed, self.config.every, round_)))
        if len(views) > 1:  # the pairings would differ: ranks would wait on partners that never come
            raise ConfigError(f"Tournament: the members disagree on (seed, every, round): {sorted(views)[:4]}; every "
                              f"member must pass the same TournamentConfig (a member's own seed goes in its trainer's "
                              f"config, not here)")
        partners = pairing(g.pop, round_, self.config.seed)
        partner, layouts = partners[g.member], g.member_layouts
        differ = [layouts[m] != layouts[p] for m, p in enumerate(partners)]  # pairs that swap on disk
        tensors = member_tensors(self.model, self.optimizer)
        check_alike(g, tensors, [partner] if not differ[g.member] else [])
        own = own_score(self.evaluate, self.model, g.comm, diverged)
        owns = g.pop_comm.allgather(own)
        some_finite(owns, round_, "tournament")
        ours = None
        if partner != g.member and not differ[g.member]:
            ours = transfer(g, tensors, send_to=[partner], receive_from=partner)
        if any(differ):  # every rank: the disk swap's agreements are over the whole population
            self.swap_through_checkpoints(partner, round_, differ[g.member])
        if partner == g.member:
            out = Outcome(round_, partner, own, own, "alone")
        else:
            # a partner's model that scores no finite loss on its own data (diverged) is not taken
            theirs = scored(self.evaluate, self.model, g.comm) if math.isfinite(owns[partner]) else math.nan
            take = beats(theirs, own)
            if not take:
                unpack(tensors, ours) if ours is not None else self._load_on_disk(g.member)
            out = Outcome(round_, partner, own, theirs, "partner" if take else "own")
        self.history.append(out)
        if g.rank == 0:
            logger.info("tournament %d: member %d met %d: own %.6g, partner's %.6g on its data: kept %s",
                        round_, g.member, partner, own, out.partner_score, out.kept)
        return out

    # -- members of different layouts: through checkpoints, resharded on load --------------------
    def swap_through_checkpoints(self, partner: int, round_: int, mine: bool = True) -> None:
        """Members whose partner has another layout (``mine``) save their state, everyone waits for
        every save, then they load the partner's (resharded to their layout). Collective over the
        population. An error in any member is the same ConfigError on every rank of it."""
        through_checkpoints(self.grid, self.model, self.optimizer, self.config.scratch, round_, save=mine,
                            load_from=partner if mine else None, what="tournament")

    def _load_on_disk(self, member: int) -> None:
        _disk_load(self.grid, self.model, self.optimizer, self.config.scratch, member)


def _attrs(model: Any) -> dict | None:
    plan = getattr(model, "plan", None)
    return plan.tensor_attrs() if plan is not None else None


def _disk_load(grid: Any, model: Any, optimizer: torch.optim.Optimizer | None, scratch, member: int) -> None:
    from hpcml import ckpt

    ckpt.load(Path(scratch) / f"member{member:05d}", member_state(model, optimizer), comm=grid.comm,
              tensor_attrs=_attrs(model))


def through_checkpoints(grid: Any, model: Any, optimizer: torch.optim.Optimizer | None, scratch, round_: int, *,
                        save: bool, load_from: int | None, what: str) -> None:
    """Members of different layouts exchange state on disk: those that ``save`` write theirs to
    ``scratch/memberK``, everyone waits for every save, then those with ``load_from`` load that
    member's, resharded to their layout. Collective over the population; an error in any member
    is one ConfigError (``what: ...``) on every rank."""
    from hpcml import ckpt

    problem = None
    if save:
        try:
            ckpt.save(Path(scratch) / f"member{grid.member:05d}", round_, member_state(model, optimizer),
                      comm=grid.comm, tensor_attrs=_attrs(model), keep=1)
        except (OSError, HpcmlError) as e:  # raised alike on the member's ranks (ckpt.save agrees)
            problem = f"member {grid.member} could not save its state for the exchange: {e}"
    _agreed(grid, problem, what)
    if load_from is not None:
        try:
            _disk_load(grid, model, optimizer, scratch, load_from)
        except (OSError, HpcmlError) as e:
            problem = f"member {grid.member} could not load member {load_from}'s state: {e}"
    _agreed(grid, problem, what)


def _agreed(grid: Any, problem: str | None, what: str = "tournament") -> None:
    """Raise on every rank of the population the first problem any rank met (one allgather)."""
    found = [p for p in grid.world_comm.allgather(problem) if p is not None]
    if found:
        raise ConfigError(f"{what}: {found[0]}")


_ALIGN = 16  # each tensor's bytes start at a multiple of this: a slice views back as any dtype


def _spans(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int]], int]:
    spans, at = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        spans.append((at, n))
        at += -(-n // _ALIGN) * _ALIGN
    return spans, at


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes in one buffer (one message per swap, whatever the tensor count)."""
    spans, size = _spans(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    flat = torch.empty(size, dtype=torch.uint8, device=device)  # the alignment padding is never read
    for t, (at, n) in zip(tensors, spans):
        flat[at:at + n].copy_(t.detach().reshape(-1).view(torch.uint8))
    return flat


@torch.no_grad()
def unpack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``flat`` (as :func:`pack` made it) copied back into ``tensors``."""
    spans, _ = _spans(tensors)
    for t, (at, n) in zip(tensors, spans):
        t.copy_(flat[at:at + n].view(t.dtype).reshape(t.shape))
