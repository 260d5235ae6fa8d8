"""One call from configs to a ready Trainer: validate everything, then build the grid,
bootstrap torch, build and parallelise the model (or a member of a population of them).
Used by workflows/llm_pretrain.py."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hpcml.grid import ProcessGrid
from hpcml.models.transformer import Transformer, TransformerConfig
from hpcml.parallel import ParallelConfig, parallelize
from hpcml.train.data import SyntheticTokens
from hpcml.train.config import TrainConfig
from hpcml.train.recipe_checks import check_llm_layout, check_llm_plan, member_configs
from hpcml.train.trainer import Trainer


def build_llm_trainer(model_cfg: TransformerConfig, train_cfg: TrainConfig, parallel_cfg: ParallelConfig | None = None,
                      *, comm=None, grid: ProcessGrid | None = None, data=None, **degrees: int) -> Trainer:
    """Trainer for ``model_cfg`` on ``data`` (a token source: an :class:`hpcml.data.TokenDataset`;
    default synthetic tokens), on a grid of ``degrees`` over ``comm``.

    Every check (layout, plan, batch split) runs before the first collective, so bad input
    raises the same error on every rank and nothing hangs.
    """
    from mpi4py import MPI

    parallel_cfg = parallel_cfg or ParallelConfig()
    if train_cfg.bf16 and parallel_cfg.fsdp and parallel_cfg.param_dtype == "fp32":
        # FSDP in bf16: gather bf16 weights (half the bytes) rather than autocast's bf16 copy of each
        # fp32 weight, which autograd would keep for the whole step
        parallel_cfg = dataclasses.replace(parallel_cfg, param_dtype="bf16")
    if grid is None:
        comm = comm or MPI.COMM_WORLD
        layout = check_llm_layout(model_cfg, train_cfg, parallel_cfg, comm.Get_size(), degrees, data)
        grid = ProcessGrid(layout, comm=comm)
    else:
        check_llm_plan(model_cfg, train_cfg, parallel_cfg, grid.layout, data)
    grid.init_torch()
    torch.manual_seed(train_cfg.seed)  # the same initial weights on every rank, as on one process
    model = Transformer(model_cfg)
    pmodel = parallelize(model, grid, parallel_cfg, n_microbatches=train_cfg.micro_batches(grid.layout))
    if data is None:
        data = SyntheticTokens(vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len, seed=train_cfg.seed)
    return Trainer(model=pmodel, config=train_cfg, data=data,
                   flops_per_token=model_cfg.flops_per_token(train_cfg.seq_len))


#: Where a population's held-out batches start in a token source without validation data:
#: member m scores on batches ``HELD_OUT + m``, ``HELD_OUT + m + K``, ... (synthetic tokens only).
HELD_OUT = 1_000_000


def build_llm_member(model_cfg: TransformerConfig, train_cfg: TrainConfig, parallel_cfg: ParallelConfig | None = None,
                     *, pop: int, data=None, val=None, tournament_every: int = 0, pbt_every: int = 0,
                     val_batches: int = 2, members: Sequence[Mapping[str, Any]] | None = None,
                     scratch: str | Path | None = None, **degrees: int) -> Trainer:
    """This rank's member of a population of ``pop`` trainers of one layout (``degrees``
    each) or of one layout each (``members``, :func:`member_configs`): its own seed (the
    config's plus its index), its own share of ``data`` (every K-th global batch,
    :class:`~hpcml.train.population_online.MemberShard`), its metrics in ``run_dir/member_K``,
    and -- with ``tournament_every`` or ``pbt_every`` -- the selection hook, scoring on its share
    of ``val`` (synthetic tokens: held-out batches of the same chain). Members of different
    layouts exchange through checkpoints in ``scratch`` (resharded on load)."""
    from mpi4py import MPI

    from hpcml.errors import ConfigError
    from hpcml.train.population_online import MemberShard, PopulationConfig, member_path, selection_hook
    from hpcml.train.pbt import PBTConfig
    from hpcml.train.population import TournamentConfig

    parallel_cfg = parallel_cfg or ParallelConfig()
    configs = None
    if members is not None:
        if degrees:
            raise ConfigError(f"give each member's degrees in members, not {sorted(degrees)} beside them")
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or len(members) != pop:
            raise ConfigError(f"members {members!r}: expected a list of {pop} entries, one a member (pop {pop})")
        configs = member_configs(members, model_cfg, train_cfg, parallel_cfg, MPI.COMM_WORLD.Get_size())
        if len({c.layout for c in configs}) > 1 and (tournament_every or pbt_every) and scratch is None:
            raise ConfigError("members of different layouts exchange their models through checkpoints: give a "
                              "scratch directory every rank reaches (llm_pretrain.py --pop-scratch DIR)")
    history = f"{train_cfg.run_dir}/pbt.jsonl" if train_cfg.run_dir else None
    config = PopulationConfig(members=pop, tournament=TournamentConfig(every=tournament_every, seed=train_cfg.seed,
                                                                       scratch=scratch)
                              if tournament_every else None,
                              pbt=PBTConfig(every=pbt_every, seed=train_cfg.seed, history=history, scratch=scratch)
                              if pbt_every else None)
    if (tournament_every or pbt_every) and val is None and data is not None:
        raise ConfigError("a population's tournaments (or PBT rounds) score each member on held-out data: give "
                          "validation data (--val-data) beside a corpus")
    source = data if data is not None else SyntheticTokens(vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len,
                                                           seed=train_cfg.seed)  # one chain for every member
    if configs is None:
        grid = ProcessGrid(pop=config.members, **degrees)
    else:
        grid = ProcessGrid(members=[c.degrees for c in configs])
        train_cfg, parallel_cfg = configs[grid.member].train, configs[grid.member].parallel
    member = dataclasses.replace(train_cfg, seed=train_cfg.seed + grid.member,
                                 run_dir=member_path(train_cfg.run_dir, grid))
    trainer = build_llm_trainer(model_cfg, member, parallel_cfg, grid=grid,
                                data=MemberShard(source, grid.pop, grid.member))
    held = MemberShard(val, grid.pop, grid.member) if val is not None else MemberShard(source, grid.pop,
                                                                                       HELD_OUT + grid.member)
    hook = selection_hook(grid, trainer, lambda: trainer.evaluate(held, val_batches), config,
                          record=f"{member.run_dir}/tournaments.jsonl" if member.run_dir else None)
    if hook is not None:
        trainer.hooks.append(hook)
    return trainer


def best_member(trainer: Trainer, val=None, batches: int = 2) -> tuple[int | None, list[float]]:
    """The population's best member and every member's score: each scores its model on one
    held-out set common to all (``val``; synthetic tokens: a stretch of the chain held out of
    every member's data and tournaments), lowest wins, a NaN never -- nor a member whose steps
    are being skipped (:attr:`TrainLoop.diverged`: NaN). Collective over the job."""
    from hpcml.train.population_online import MemberShard, lowest

    common = val if val is not None else MemberShard(getattr(trainer.data, "source", trainer.data), 1, 2 * HELD_OUT)
    own = math.nan if trainer.diverged else trainer.evaluate(common, batches)  # its steps skipped: never the best
    scores = [float(x) for x in trainer.grid.pop_comm.allgather(own)]
    return lowest(scores), scores
