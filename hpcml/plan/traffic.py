"""Data-parallel bytes a rank sends a step, inside its node and across nodes, for FSDP and
its node-aware forms (HSDP, hpZ, qwZ, qgZ): the count :class:`hpcml.parallel.hsdp.CommBytes`
makes of the real collectives, so the two can be held equal (``tests/mpi/test_hsdp.py``).

The direct algorithm's bytes: a collective over ``n`` ranks, ``a`` of them on this rank's node,
sends ``per_peer`` to each of ``a - 1`` ranks inside and ``n - a`` across. FSDP2 all-gathers each
unit (a block; the root -- embeddings, final norm, output -- apart) as one flat buffer of the
ranks' padded dim-0 chunks, every micro-batch's forward and, resharded after forward, its
backward (the root keeps its weights to backward); gradients are reduce-scattered each micro-batch, or once a
step (``grad_sync step``); HSDP's all-reduce across replicas follows each reduce-scatter, but in hpcml's
trainer once a step.
Under a pipeline ``torch.distributed.pipelining`` neither reshards nor reduces after a backward
but the last: a stage is gathered once a step (once more in each backward if it reshards after
forward), and reduced once, whatever the framework. DeepSpeed's ZeRO-2 keeps its weights whole:
it gathers them once a step, after the optimizer.
qwZ sends 1 byte a value and a 4-byte scale a block of the flat buffer; qgZ sends the node's
chunks in full precision inside it and int8 blocks across.
"""

from __future__ import annotations

import math

from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.memory import node_ranks, weight_bytes
from hpcml.plan.placement import holder_parts, shard_ranks, stage_layer_lists


def _units(cfg: TransformerConfig, lay: PlanLayout, ws: int, pp_rank: int) -> tuple[list[int], list[int]]:
    """(each block's, the root's) elements of one rank's FSDP shard over ``ws`` data ranks:
    (blocks, [root]) as FSDP2 groups them; trainable ones for the gradients are the same here."""
    parts = holder_parts(cfg, lay.tp, lay.ep, ws, max(1, ws // lay.ep))
    n_stages = lay.pp * lay.v
    stages = stage_layer_lists(cfg.n_layers, n_stages, lay.split)
    blocks = [parts[f"L{i}"][1] for s in range(pp_rank, n_stages, lay.pp) for i in stages[s]]
    ends = [h for h in ("tok_embeddings.weight", "pos_embeddings.weight") if pp_rank == 0 and h in parts]
    ends += [h for h in ("norm.weight", "norm.bias", "output.weight") if (n_stages - 1) % lay.pp == pp_rank
             and h in parts]
    return blocks, [sum(parts[h][1] for h in ends)] if ends else []


def _quantized(values: int, block: int) -> int:
    """Bytes of ``values`` sent as int8 blocks with a 4-byte scale each."""
    blocks = math.ceil(values / block)
    return blocks * block + 4 * blocks


def dp_bytes(cfg: TransformerConfig, lay: PlanLayout, gpus_per_node: int, pp_rank: int = 0) -> dict[str, float]:
    """``{"dp_bytes_intra_node", "dp_bytes_inter_node"}`` of one data rank a step (0 without FSDP's
    collectives: DDP and ZeRO-1 are not counted)."""
    out = {"dp_bytes_intra_node": 0.0, "dp_bytes_inter_node": 0.0}
    ws = lay.dp * lay.cp
    if lay.zero < 2 or ws == 1:
        return out
    local = node_ranks(lay, gpus_per_node)
    shard_ws = shard_ranks(lay)
    w, g, m = weight_bytes(lay), 2 if lay.reduce_dtype == "bf16" else 4, lay.microbatches

    def send(n: int, per_peer: float, calls: float = 1.0) -> None:
        """``calls`` collectives over ``n`` consecutive data ranks, ``per_peer`` bytes to each."""
        here = min(n, local) if n <= local or n % local == 0 else 1
        out["dp_bytes_intra_node"] += calls * per_peer * (here - 1)
        out["dp_bytes_inter_node"] += calls * per_peer * (n - here)

    def gathered(values: int) -> float:
        return _quantized(values, lay.quant_block) if lay.qwz else values * w

    blocks, root = _units(cfg, lay, shard_ws, pp_rank)
    piped = lay.fsdp_piped
    after_forward = 2 if lay.zero == 3 and not lay.hpz else 1
    once = piped or lay.framework == "deepspeed" and lay.zero == 2  # DeepSpeed's ZeRO-2: the updated weights, once
    for u in blocks:  # under a pipeline the first forward gathers, and each backward again at ZeRO-3
        send(shard_ws, gathered(u), (m + 1 if lay.zero == 3 else 1) if once else m * after_forward)
    for r in root:
        send(shard_ws, gathered(r), 1 if once else m)
    if lay.hpz and lay.zero == 3:  # backward gathers the secondary shards, over the node's ranks
        for u in _units(cfg, lay, min(local, ws), pp_rank)[0]:
            send(min(local, ws), gathered(u), m)
    syncs = 1 if lay.step_sync else m
    # HSDP's all-reduce across replicas: hpcml's trainer sums each micro-batch's reduce-scattered shards
    # and all-reduces them once, after the last (FSDP2's ``set_requires_all_reduce``); the others with each
    all_reduces = 1 if lay.framework == "hpcml" else syncs
    for u in blocks + root:
        if lay.qgz and local < shard_ws:  # the node's chunks in full precision, then int8 across
            nodes = shard_ws // local
            send(local, nodes * u * g, syncs)
            send_across = _quantized(u, lay.quant_block)
            out["dp_bytes_inter_node"] += syncs * send_across * (nodes - 1)
        else:
            send(shard_ws, u * g, syncs)
        if lay.dp_replicate > 1:  # HSDP: the reduce-scatter's output all-reduced across replicas, shard_ws apart
            r = lay.dp_replicate
            here = max(1, min(r, local // shard_ws)) if local % shard_ws == 0 else 1
            out["dp_bytes_intra_node"] += all_reduces * (2 * u * g // r) * (here - 1)
            out["dp_bytes_inter_node"] += all_reduces * (2 * u * g // r) * (r - here)
    return out
