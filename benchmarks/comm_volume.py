"""Bytes moved per transformer layer by Ulysses all-to-all (cp) and tensor-parallel
all-reduce (tp), measured from the gloo operations torch's profiler records, against the theory.

    mpiexec -n 4 python benchmarks/comm_volume.py --json
    mpiexec -n 2 python benchmarks/comm_volume.py --json

Theory, per rank and layer, fp32, P ranks on the axis, B*S tokens, hidden h:
  * Ulysses forward: q, k, v and the output each cross once: 4*B*S*h/P elements held
    locally, of which (P-1)/P leave the rank (GQA: k and v are kv_heads/heads of that).
    Backward moves the same again. Megatron-SP would move 4*B*S*h per layer: P times more.
  * TP forward: two all-reduces of B*S*h (after attention and after the MLP); a ring
    all-reduce sends 2*(P-1)/P of the buffer per rank. Backward: two more.
The measured figures count what the layers send (embedding, output and loss collectives
are reported apart).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

ELEM = 4  # fp32 bytes


def measure(fn) -> dict[str, list[int]]:
    """Element counts of each gloo collective that ``fn`` issues, by kind."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    calls: dict[str, list[int]] = defaultdict(list)
    for e in prof.events():
        if e.name.startswith("gloo:") and e.input_shapes and e.input_shapes[0]:
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            calls[e.name[5:]].append(numel)
    return calls


def sent_bytes(kind: str, numel: int, p: int) -> float:
    if kind == "all_to_all":
        return numel * (p - 1) / p * ELEM
    if kind == "all_reduce":
        return 2 * numel * (p - 1) / p * ELEM
    return numel * ELEM


def run_case(axis: str, p: int, model_kw: dict, batch: int, seq: int) -> dict:
    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    mc = TransformerConfig.preset("tiny", **model_kw)
    tc = TrainConfig(steps=1, global_batch=batch * (1 if axis in ("cp", "tp") else p), micro_batch=batch, seq_len=seq,
                     progress=False)
    trainer = build_llm_trainer(mc, tc, ParallelConfig(), **{axis: p, "dp": 1})
    x, y = trainer.local_batch(0)
    part = trainer.model.parts[0]
    trainer.model.forward_backward(x, y, 1)  # warm up
    h, layers = mc.dim, mc.n_layers
    kv_frac = mc.kv_heads / mc.n_heads
    fwd_calls = measure(lambda: part(x))

    def fwd_bwd():
        with trainer.model.loss_context():
            from hpcml.models.transformer import cross_entropy

            cross_entropy(part(x), y).backward()

    all_calls = measure(fwd_bwd)
    kind = "all_to_all" if axis == "cp" else "all_reduce"
    layer_numel = batch * seq * h // (p if axis == "cp" else 1)  # the activation shape the layer exchanges
    if axis == "cp":
        per_layer = [n for n in fwd_calls[kind]]
        theory_fwd = batch * seq * h / p * (2 + 2 * kv_frac) * (p - 1) / p * ELEM
    else:
        per_layer = [n for n in fwd_calls[kind] if n == layer_numel][: 2 * layers - 0]
        per_layer = per_layer[1:] if len(per_layer) > 2 * layers else per_layer  # drop the embedding's
        theory_fwd = 2 * 2 * batch * seq * h * (p - 1) / p * ELEM
    measured_fwd = sum(sent_bytes(kind, n, p) for n in per_layer) / layers
    total_fwd_bwd = sum(sent_bytes(kind, n, p) for n in all_calls[kind])
    import torch.distributed as dist

    dist.destroy_process_group()
    return {"axis": axis, "P": p, "batch": batch, "seq": seq, "hidden": h, "heads": mc.n_heads, "kv_heads": mc.kv_heads,
            "layers": layers, "collective": kind,
            "calls_per_layer_fwd": len(per_layer) / layers,
            "measured_bytes_per_layer_fwd": measured_fwd, "theory_bytes_per_layer_fwd": theory_fwd,
            "measured_over_theory": measured_fwd / theory_fwd,
            "all_bytes_fwd_bwd_whole_model": total_fwd_bwd,
            "calls_fwd_bwd_whole_model": len(all_calls[kind]),
            "megatron_sp_bytes_per_layer_fwd": 4 * batch * seq * h * ELEM if axis == "cp" else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_size()
    heads = 4 * world
    mha = {"n_heads": heads, "n_kv_heads": heads, "dim": heads * 8}
    gqa = {"n_heads": heads, "n_kv_heads": world, "dim": heads * 8}
    cases = [run_case("cp", world, mha, args.batch, args.seq), run_case("cp", world, gqa, args.batch, args.seq),
             run_case("tp", world, mha, args.batch, args.seq)]
    if MPI.COMM_WORLD.rank == 0:
        out = {"benchmark": "comm_volume", "world_size": world, "cases": cases}
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
