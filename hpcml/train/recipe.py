"""One call from configs to a ready Trainer: validate everything, then build the grid,
bootstrap torch, build and parallelise the model (or a member of a population of them).
Used by workflows/llm_pretrain.py."""

from __future__ import annotations

import torch

from hpcml.grid import Layout, ProcessGrid
from hpcml.models.transformer import Transformer, TransformerConfig
from hpcml.models.transformer.parallelize import check_plan
from hpcml.parallel import ParallelConfig, parallelize
from hpcml.train.data import SyntheticTokens
from hpcml.train.trainer import TrainConfig, Trainer, check_source


def build_llm_trainer(model_cfg: TransformerConfig, train_cfg: TrainConfig, parallel_cfg: ParallelConfig | None = None,
                      *, comm=None, grid: ProcessGrid | None = None, data=None, **degrees: int) -> Trainer:
    """Trainer for ``model_cfg`` on ``data`` (a token source: an :class:`hpcml.data.TokenDataset`;
    default synthetic tokens), on a grid of ``degrees`` over ``comm``.

    Every check (layout, plan, batch split) runs before the first collective, so bad input
    raises the same error on every rank and nothing hangs.
    """
    from mpi4py import MPI

    parallel_cfg = parallel_cfg or ParallelConfig()
    if data is not None:  # before any collective: the same refusal on every rank
        check_source(data, train_cfg.seq_len, model_cfg.vocab_size, eod=train_cfg.doc_mask_eod)
    if grid is None:
        comm = comm or MPI.COMM_WORLD
        layout = Layout.from_degrees(comm.Get_size(), degrees)
        check_plan(model_cfg, layout, parallel_cfg)
        train_cfg.check_layout(layout, model_cfg.max_seq_len, parallel_cfg.fpdt_chunk)
        grid = ProcessGrid(layout, comm=comm)
    else:
        check_plan(model_cfg, grid.layout, parallel_cfg)
        train_cfg.check_layout(grid.layout, model_cfg.max_seq_len, parallel_cfg.fpdt_chunk)
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
                     val_batches: int = 2, **degrees: int) -> Trainer:
    """This rank's member of a population of ``pop`` trainers of one layout (``degrees``
    each): its own seed (the config's plus its index), its own share of ``data`` (every K-th
    global batch, :class:`~hpcml.train.population_online.MemberShard`), its metrics in
    ``run_dir/member_K``, and -- with ``tournament_every`` or ``pbt_every`` -- the selection hook,
    scoring on its share of ``val`` (synthetic tokens: held-out batches of the same chain)."""
    from dataclasses import replace

    from hpcml.errors import ConfigError
    from hpcml.train.population_online import MemberShard, PopulationConfig, member_path, selection_hook
    from hpcml.train.pbt import PBTConfig
    from hpcml.train.population import TournamentConfig

    history = f"{train_cfg.run_dir}/pbt.jsonl" if train_cfg.run_dir else None
    config = PopulationConfig(members=pop, tournament=TournamentConfig(every=tournament_every, seed=train_cfg.seed)
                              if tournament_every else None,
                              pbt=PBTConfig(every=pbt_every, seed=train_cfg.seed, history=history)
                              if pbt_every else None)
    if (tournament_every or pbt_every) and val is None and data is not None:
        raise ConfigError("a population's tournaments (or PBT rounds) score each member on held-out data: give "
                          "validation data (--val-data) beside a corpus")
    source = data if data is not None else SyntheticTokens(vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len,
                                                           seed=train_cfg.seed)  # one chain for every member
    grid = ProcessGrid(pop=config.members, **degrees)
    member = replace(train_cfg, seed=train_cfg.seed + grid.member, run_dir=member_path(train_cfg.run_dir, grid))
    trainer = build_llm_trainer(model_cfg, member, parallel_cfg, grid=grid,
                                data=MemberShard(source, grid.pop, grid.member))
    held = MemberShard(val, grid.pop, grid.member) if val is not None else MemberShard(source, grid.pop,
                                                                                       HELD_OUT + grid.member)
    hook = selection_hook(grid, trainer, lambda: trainer.evaluate(held, val_batches), config,
                          record=f"{member.run_dir}/tournaments.jsonl" if member.run_dir else None)
    if hook is not None:
        trainer.hooks.append(hook)
    return trainer
