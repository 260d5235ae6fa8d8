"""Gradients reduced in bf16 (``ParallelConfig.reduce_dtype``, ``llm_pretrain.py --reduce-dtype``):
what crosses the wire is bf16, and the result is exactly each data rank's own gradient rounded
to bf16, summed in bf16 and divided -- for DDP's flat all-reduce and FSDP2's reduce-scatter,
on 2 data ranks (2 ranks: dp 2; 4 ranks: tp 2 x dp 2 for the transformer, whose tp shards
each reduce over their 2 data ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.distributed.tensor import DTensor

from hpcml.errors import ConfigError
from hpcml.grid import ProcessGrid
from hpcml.parallel import ParallelConfig, parallelize
from tests.mpi.helpers import needs_world

WORLD = MPI.COMM_WORLD.Get_size()


def _recording(monkeypatch, name: str) -> list[torch.dtype]:
    """The dtypes of the tensors ``torch.distributed.<name>`` is called on from now on."""
    seen: list[torch.dtype] = []
    real = getattr(dist, name)

    def wrapped(*args, **kwargs):
        seen.append(args[1].dtype if name == "reduce_scatter_single" else args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, name, wrapped)
    return seen


@needs_world(2)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_a_bf16_reduction_is_each_ranks_gradient_rounded_then_summed_in_bf16(comm, monkeypatch, fsdp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
    alone = copy.deepcopy(model)  # this rank's gradient, plain torch, no reduction
    grid = ProcessGrid(dp=2)
    grid.init_torch()
    pm = parallelize(model, grid, ParallelConfig(fsdp=fsdp, reduce_dtype="bf16"), loss_fn=nn.functional.mse_loss)
    seen = _recording(monkeypatch, "reduce_scatter_single" if fsdp else "all_reduce")
    gen = torch.Generator().manual_seed(100 + comm.rank)  # each rank its own batch
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    pm.forward_backward(x, y)
    pm.sync_grads()
    assert seen and set(seen) == {torch.bfloat16}, seen  # the wire carries bf16
    nn.functional.mse_loss(alone(x), y).backward()
    grads = comm.allgather({n: p.grad.numpy() for n, p in alone.named_parameters()})
    differs = 0
    for name, p in pm.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert got.dtype == torch.float32
        mine = [torch.from_numpy(g[name]) for g in grads]
        expected = (mine[0].bfloat16() + mine[1].bfloat16()).float() / 2
        assert torch.equal(got, expected), (name, (got - expected).abs().max())
        differs += not torch.equal(got, (mine[0] + mine[1]) / 2)  # not what an fp32 reduction gives
    assert differs == len(list(alone.parameters()))


@needs_world(2)
@pytest.mark.parametrize("fsdp,sync", [(False, None), (True, None), (True, "step")], ids=["ddp", "fsdp", "fsdp-step"])
def test_micro_batches_accumulate_as_each_data_parallel_form_reduces_them(comm, fsdp, sync):
    """Four micro-batches a rank, a bf16 reduction: DDP sums them in fp32 and rounds the sum once
    for the wire; FSDP2 by default reduces each micro-batch's gradient in bf16 and adds the results
    in fp32 (its sharded gradient); with ``grad_sync="step"`` it keeps a gradient not yet
    synchronised in its reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``), so each
    micro-batch's running sum is rounded to bf16 -- exactly so, as docs/parallel.md says."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))
    alone = copy.deepcopy(model)
    grid = ProcessGrid(dp=2)
    grid.init_torch()
    pm = parallelize(model, grid, ParallelConfig(fsdp=fsdp, reduce_dtype="bf16", grad_sync=sync),
                     loss_fn=nn.functional.mse_loss)
    gen = torch.Generator().manual_seed(100 + comm.rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    pm.forward_backward(x, y, n_micro=4)
    pm.sync_grads()
    per = []  # this rank's micro-batches' gradients, plain torch
    for k in range(4):
        alone.zero_grad()
        (nn.functional.mse_loss(alone(x[2 * k:2 * k + 2]), y[2 * k:2 * k + 2]) / 4).backward()
        per.append({n: p.grad.numpy().copy() for n, p in alone.named_parameters()})
    ranks = comm.allgather(per)
    for name, p in pm.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if fsdp and sync is None:  # each micro-batch reduced alone, the results summed in fp32
            each = [(torch.from_numpy(ranks[0][k][name]).bfloat16() + torch.from_numpy(ranks[1][k][name]).bfloat16())
                    .float() / 2 for k in range(4)]
            assert torch.equal(got, each[0] + each[1] + each[2] + each[3]), name
            continue
        sums = []
        for mine in ranks:
            g = [torch.from_numpy(m[name]) for m in mine]
            if fsdp:
                acc = g[0].bfloat16()
                for t in g[1:]:
                    acc = (acc.float() + t).bfloat16()
            else:
                acc = (g[0] + g[1] + g[2] + g[3]).bfloat16()
            sums.append(acc)
        assert torch.equal(got, (sums[0] + sums[1]).float() / 2), name


@needs_world(4)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_a_transformer_on_tp2_x_dp2_trains_within_bf16s_rounding_of_the_fp32_reduction(comm, fsdp):
    """The transformer's plan (tp shards, FSDP units) with the bf16 wire: its losses within
    bf16's rounding of the fp32 reduction's, and not equal to them."""
    from hpcml.models.transformer import TransformerConfig
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    model, train = TransformerConfig.preset("tiny"), TrainConfig(steps=3, global_batch=4, micro_batch=2, seq_len=32,
                                                                  progress=False)
    losses = {}
    for dtype in ("fp32", "bf16"):
        trainer = build_llm_trainer(model, train, ParallelConfig(fsdp=fsdp, reduce_dtype=dtype), tp=2)
        losses[dtype] = [m["loss"] for m in trainer.fit()]
        trainer.close()
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=1e-3)
    assert losses["bf16"][1:] != losses["fp32"][1:]


def test_an_unknown_reduce_dtype_is_one_line():
    with pytest.raises(ConfigError, match=r"^reduce_dtype 'fp16': expected one of fp32, bf16$"):
        ParallelConfig(reduce_dtype="fp16")
