"""Tensor-parallel styles torch lacks, for models' plans (DTensor ``parallelize_module``).

A fused projection (``attention.wqkv``, ``feed_forward.w13``) is column-parallel with each
rank holding its slice of every sub-parameter, ``[wq_r; wk_r; wv_r]``, so the local matmul
yields this rank's heads of q, k and v; checkpoints store it logical (``fused_widths``,
docs/checkpoint-format.md). The transformer's plan is in
:mod:`hpcml.models.transformer.parallelize`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel


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
