"""Tensor parallelism with DTensor ``parallelize_module`` (Megatron's column/row split).

Attention q/k/v and the MLP's w1/w3 are column-parallel, wo and w2 row-parallel: one
all-reduce per sub-block in forward and one in backward. The embedding is
vocabulary-parallel (row-wise), the output projection column-parallel with logits left
sharded over the vocabulary, so ``loss_parallel()`` computes the cross-entropy without
gathering them. With ``sequence_parallel`` the norms and residuals are sharded along the
sequence and the all-reduces become reduce-scatter + all-gather.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpcml.models.transformer import Transformer


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
    for block in model.layers.values():
        block_plan: dict = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
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
