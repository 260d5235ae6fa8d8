"""One call from configs to a ready Trainer: validate everything, then build the grid,
bootstrap torch, build and parallelise the model. Used by workflows/llm_pretrain.py."""

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
