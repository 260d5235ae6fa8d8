"""Hugging Face's Ultra-Scale Playbook benchmarks (nanotron on 1-64 nodes of 8 H100s) as planner
cases: 1,751 runs of DP x TP x PP with ZeRO-0/1, 1,283 that ran and 468 that ran out of memory,
each row's layout read from its run's name. Held out: nothing is fitted on it."""

from __future__ import annotations

import re

from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan.calibration import constants, published
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.cases import Case
from hpcml.plan.devices import device

TABLE = "nanotron-h100"
_NAME = re.compile(r"^(?P<size>[0-9.]+G)_dp(?P<dp>\d+)_tp(?P<tp>\d+)_pp(?P<pp>\d+)_acc(?P<acc>[0-9.]+)"
                   r"_mbs(?P<mbs>\d+)_zero(?P<zero>[01])_vocab(?P<vocab>131|49)k(?P<gqa>_gqa8)?$")


def _layout(name: str, shapes: dict, node_gbps: float | None = None) -> PlanLayout:
    """The layout a run's name gives: its model's shape, degrees, micro-batch and accumulation, as
    Megatron-style 3-D training runs it (bf16 weights, fp32 gradients and master weights, ZeRO-1 the
    distributed optimizer's sharding, sequence parallelism with TP, 1F1B), FlashAttention-2, no
    recompute; ``node_gbps``: the node's network as the job measured it (None: the device's)."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"{TABLE}: run name {name!r} is not one the table's reader knows")
    layers, hidden, heads, ffn = shapes[m["size"]]
    cfg = TransformerConfig(vocab_size=131072 if m["vocab"] == "131" else 49152, dim=hidden, n_layers=layers,
                            n_heads=heads, n_kv_heads=8 if m["gqa"] else heads, ffn_hidden=ffn,
                            tie_embeddings=ffn < 10000, max_seq_len=4096)
    dp, tp, pp, mbs = int(m["dp"]), int(m["tp"]), int(m["pp"]), int(m["mbs"])
    acc = int(float(m["acc"]))
    return PlanLayout(model=cfg, gpus=dp * tp * pp, gpu="h100-80gb", seq_len=4096, global_batch=dp * mbs * acc,
                      tp=tp, pp=pp, zero=int(m["zero"]), micro_batch=mbs, sequence_parallel=tp > 1,
                      attention="flash-attn", framework="megatron", node_injection_gbps=node_gbps)


def nanotron_h100(measured_network: bool = False, comm_eff: float | None = None) -> list[Case]:
    """Every run of the table: those that ran with their tokens/s per GPU and peak reserved memory,
    the others as out of memory. ``measured_network``: each multi-node run priced on the network
    its job measured (its all-reduce bus bandwidth over ``comm_eff``, the share a ring moves), as
    ``node_injection_gbps`` (default: the H100 family's fitted one); the table's own input is the device's.
    Priced as Megatron runs it, so Megatron-core's bucket rule stands for nanotron's DDP buckets of 25 MB."""
    if measured_network and comm_eff is None:
        comm_eff = constants(device("h100-80gb")).comm_eff
    data = published("nanotron_ultrascale_h100_2025")
    shapes = {k: v for k, v in data["source"]["models"].items() if k != "source"}
    out = []
    for job, name, nodes, status, tps, mem, allreduce in data["rows"]:
        ran = status == "Success"
        node = allreduce / comm_eff if measured_network and ran and nodes > 1 and allreduce else None
        out.append(Case(TABLE, f"{name} (job {job})", _layout(name, shapes, node), fits=ran,
                        tokens_per_gpu=tps if ran else None, memory_gib=mem))
    return out
