"""Tensor parallelism with DTensor ``parallelize_module`` (Megatron's column/row split).

Attention q/k/v and the MLP's w1/w3 are column-parallel, wo and w2 row-parallel: one
all-reduce per sub-block in forward and one in backward. The embedding is
vocabulary-parallel (row-wise), the output projection column-parallel with logits left
sharded over the vocabulary, so ``loss_parallel()`` computes the cross-entropy without
gathering them. With ``sequence_parallel`` the norms and residuals are sharded along the
sequence and the all-reduces become reduce-scatter + all-gather.

Fused projections (``attention.wqkv``, ``feed_forward.w13``) are column-parallel too, with
each rank holding its slice of every sub-parameter, ``[wq_r; wk_r; wv_r]``, so the local
matmul yields this rank's heads of q, k and v; checkpoints store them logical
(``fused_widths``, docs/checkpoint-format.md).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpcml.models.transformer import Transformer


class FusedColwiseParallel(ColwiseParallel):
    """Column-parallel for a fused weight ``cat(subs)`` of sub-parameter ``widths``: rank r
    of n gets ``cat([sub.chunk(n)[r] for sub in subs])``. The weight is reordered to
    ``[sub_0 rank 0; sub_1 rank 0; ...; sub_0 rank 1; ...]`` and then distributed as Shard(0)."""

    def __init__(self, widths: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.widths = list(widths)

    def _partition_linear_fn(self, name, module, device_mesh):
        n = device_mesh.size()
        for pname, param in module.named_parameters():
            subs = param.detach().split(self.widths)
            interleaved = torch.cat([s.chunk(n)[r] for r in range(n) for s in subs])
            dist_param = nn.Parameter(distribute_tensor(interleaved, device_mesh, [Shard(0)],
                                                        src_data_rank=self.src_data_rank),
                                      requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)


def apply_tp(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard ``model`` (or a pipeline stage of it) over the 1-D tp ``mesh``, in place."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    fused = model.config.fused_widths
    qkv, w13 = fused.get("attention.wqkv.weight"), fused.get("feed_forward.w13.weight")
    for block in model.layers.values():
        block_plan: dict = {
            **({"attention.wqkv": FusedColwiseParallel(qkv)} if qkv else
               {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel()}),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            **({"feed_forward.w13": FusedColwiseParallel(w13)} if w13 else
               {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()}),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        # The sub-block input enters as one replicated DTensor, so the input gradients of
        # q, k, v (and of w1, w3) add up as partial sums and are all-reduced once, not once
        # per projection; with sequence parallelism that one reduction is a reduce-scatter.
        block_plan.update({
            "attention": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        })
        if sp:
            block_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, mesh, block_plan)
    model.sp_size = mesh.size() if sp else 1  # hidden states hold S / tp positions between regions
