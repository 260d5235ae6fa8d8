"""ZeRO++'s quantized collectives (Wang et al., 2023) as FSDP2's custom all-gather and
reduce-scatter: qwZ and qgZ. torch has neither.

qwZ: FSDP's all-gather of weights in int8. Each rank's shard is cut into blocks of ``block``
values, each scaled by its largest magnitude (``absmax / 127``) and rounded to the nearest
int8; the int8 values and one fp32 scale a block are all-gathered and every rank dequantizes
the same bytes, so all compute with identical weights. The optimizer's weights stay exact:
only what forward and backward compute with is rounded (at most half a step of its block).

qgZ: FSDP's reduce-scatter of gradients, hierarchical. The ranks of the data group lie in
equal consecutive blocks per node (N nodes x L ranks). A rank first exchanges with the L ranks
of its node, in full precision, the chunks bound for every rank with the same place on each
node, and sums them (the node's partial sums); then it quantizes those N partial sums to int8
(blocks as above) and exchanges them with the N ranks of its place across nodes, which
dequantize and add them. Only int8 crosses nodes: a quarter of fp32's bytes (and 1 scale per
block). No error feedback: each step's rounding is independent (stochastic rounding would
make it unbiased; the loss effect is measured in docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpcml.parallel.hsdp import CommBytes, CountingAllGather, CountingReduceScatter, node_blocks, one_layout

QMAX = 127.0


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat, or rows) -> (int8 values along the last dimension, padded to whole blocks;
    the fp32 scale of each block), each row quantized on its own."""
    pad = -x.shape[-1] % block
    xf = torch.nn.functional.pad(x.float(), (0, pad))
    blocks = xf.view(*xf.shape[:-1], -1, block)
    scale = blocks.abs().amax(dim=-1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(xf.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`quantize`: the first ``n`` values of each row, in ``dtype``."""
    blocks = q.view(*scale.shape, -1).float() * scale[..., None]
    return blocks.view(q.shape)[..., :n].to(dtype)


class QuantizedAllGather(CountingAllGather):
    """qwZ: FSDP2's all-gather in int8 with block scales (a mixed-dtype group's byte buffer,
    which cannot be scaled, is gathered as it is)."""

    def __init__(self, counter: CommBytes, block: int) -> None:
        super().__init__(counter)
        self.block = block

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if not input_tensor.is_floating_point():
            return super().__call__(output_tensor, input_tensor, group, async_op)
        world, n = dist.get_world_size(group), input_tensor.numel()
        q, scale = quantize(input_tensor, self.block)
        qs = torch.empty(world * q.numel(), dtype=torch.int8, device=q.device)
        ss = torch.empty(world * scale.numel(), dtype=scale.dtype, device=q.device)
        self.counter.count(group, q.numel() + scale.numel() * scale.element_size())
        dist.all_gather_single(qs, q, group=group)
        dist.all_gather_single(ss, scale, group=group)
        output_tensor.view(world, n).copy_(dequantize(qs.view(world, -1), ss.view(world, -1), n, output_tensor.dtype))
        return None


class HierarchicalReduceScatter(CountingReduceScatter):
    """qgZ: FSDP2's reduce-scatter as a full-precision exchange inside the node, then int8
    across nodes (:mod:`module docs <hpcml.parallel.zeropp>`)."""

    def __init__(self, counter: CommBytes, block: int, node_group, cross_group, nodes: int, local: int) -> None:
        super().__init__(counter)
        self.block, self.node_group, self.cross_group = block, node_group, cross_group
        self.nodes, self.local = nodes, local

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if not input_tensor.is_floating_point() or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        n_nodes, n_local, m = self.nodes, self.local, output_tensor.numel()
        # chunk (b, j) of the input is bound for the rank at place j of node b; to local peer j go
        # the chunks of every node's place j, in node order
        by_place = input_tensor.view(n_nodes, n_local, m).transpose(0, 1).contiguous()  # [L, N, m]
        got = torch.empty_like(by_place)
        self.counter.count(self.node_group, n_nodes * m * input_tensor.element_size())
        dist.all_to_all_single(got, by_place, group=self.node_group)
        partial = got.sum(dim=0)  # [N, m]: this node's sums for my place on every node
        q, scale = quantize(partial, self.block)  # each node's row on its own
        q_in, s_in = torch.empty_like(q), torch.empty_like(scale)
        self.counter.count(self.cross_group, q[0].numel() + scale[0].numel() * scale.element_size())
        dist.all_to_all_single(q_in, q, group=self.cross_group)
        dist.all_to_all_single(s_in, scale, group=self.cross_group)
        total = dequantize(q_in, s_in, m, torch.float32).sum(dim=0)
        if op == dist.ReduceOp.AVG:
            total = total / (n_nodes * n_local)
        output_tensor.copy_(total.to(output_tensor.dtype))
        return None


def check(grid, config) -> None:
    """qgZ's node map: every data group in equal consecutive blocks per node. Pure arithmetic on
    what every rank holds alike: raised before any collective."""
    if not config.qgz:
        return
    one_layout(grid, "qgz")
    node_blocks(grid, "qgz")


def collectives(grid, config, counter: CommBytes) -> tuple[CountingAllGather, CountingReduceScatter]:
    """FSDP2's all-gather and reduce-scatter for ``config``: counted, and quantized where
    ``qwz`` / ``qgz`` ask. qgZ's groups -- a node's data ranks, and a place's across nodes, of
    every data group of every member -- are made on every rank in one order (``new_group`` is
    collective over the job)."""
    gather = QuantizedAllGather(counter, config.quant_block) if config.qwz else CountingAllGather(counter)
    per = node_blocks(grid, "qgz") if config.qgz else 0
    n_data = grid.layout.dp * grid.layout.cp
    if not per or per == n_data:  # (one node: nothing crosses, nothing to quantize)
        return gather, CountingReduceScatter(counter)
    n, me = grid.world_size, grid.global_rank(grid.rank)
    mine_node = mine_cross = None
    for member in range(grid.pop):
        for ranks in grid.layout.groups(("dp", "cp")):
            blocks = [[member * n + r for r in ranks[i:i + per]] for i in range(0, len(ranks), per)]
            for b in blocks:
                g = dist.new_group(b)
                mine_node = g if me in b else mine_node
            for j in range(len(blocks[0])):
                cross = [b[j] for b in blocks]
                g = dist.new_group(cross)
                mine_cross = g if me in cross else mine_cross
    return gather, HierarchicalReduceScatter(counter, config.quant_block, mine_node, mine_cross, n_data // per, per)
