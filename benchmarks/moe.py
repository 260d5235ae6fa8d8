"""Mixture-of-Experts (issue 13): all-to-all bytes against theory, the MoE layer against the
dense layer of the same active parameters, ep 2 against ep 1, and the load balance of each
balancing scheme over training.

    python benchmarks/moe.py --json                    # one rank: layer speed, load balance
    mpiexec -n 2 python benchmarks/moe.py --json       # + bytes and ep2 vs ep1 on 2 ranks
    mpiexec -n 4 python benchmarks/moe.py --json       # + bytes on 4 ranks

Theory, per rank and MoE layer, forward, fp32: N tokens, top-k, hidden d, ep ranks, balanced
routing: dispatch and combine each hand ``N*k*d`` elements to ``all_to_all_single``, of which
``(ep-1)/ep`` leave the rank: ``2*N*k*d*(ep-1)/ep*4`` bytes (backward moves the same again),
plus the token counts (E int64 per rank). Measured two ways: the gloo all-to-all buffers
torch's profiler records (as ``benchmarks/comm_volume.py`` does for Ulysses), and the split
sizes the dispatcher counts. Speed: forward + backward of one layer, tokens/s, best of
``--repeat``; the peer for the communication is two raw ``all_to_all_single`` of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import torch


def _best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _layer_cfg(args, **kw):
    from hpcml.models.transformer import TransformerConfig

    return TransformerConfig(vocab_size=256, dim=args.dim, n_layers=1, n_heads=8, ffn_hidden=args.expert_hidden,
                             n_experts=args.experts, moe_top_k=args.top_k, moe_z_coef=0.0, moe_aux_coef=0.0, **kw)


def layer_speed(args) -> list[dict]:
    """Tokens/s of the MoE feed-forward (grouped matmul and loop) and of the dense SwiGLU with
    the same active parameters (hidden = k * expert hidden), forward + backward, one rank."""
    from hpcml.models.transformer.model import FeedForward
    from hpcml.models.transformer.moe import MoE

    torch.manual_seed(0)
    x = torch.randn(1, args.tokens, args.dim)
    rows = []
    dense_cfg = _layer_cfg(args)
    dense = FeedForward(dense_cfg, hidden=args.top_k * args.expert_hidden)
    for name, layer in (("dense (same active params)", dense),
                        ("moe grouped_mm", MoE(_layer_cfg(args, moe_grouped_mm=True))),
                        ("moe per-expert loop", MoE(_layer_cfg(args, moe_grouped_mm=False)))):
        for p in layer.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.02)

        def step(layer=layer):
            xi = x.clone().requires_grad_()
            layer(xi).sum().backward()

        t = _best(step, args.repeat)
        active = sum(p.numel() for p in dense.parameters()) if "dense" in name else None
        rows.append({"layer": name, "tokens": args.tokens, "tokens_per_s": args.tokens / t, "seconds": t,
                     **({"active_params": active} if active else {})})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_dense"] = r["tokens_per_s"] / base
    return rows


def load_balance(args) -> list[dict]:
    """max/mean assignments per expert over training of the tiny MoE, for each balancing scheme."""
    from hpcml.models.transformer import Transformer, TransformerConfig, cross_entropy
    from hpcml.models.transformer.moe import moe_layers
    from hpcml.train import SyntheticTokens

    rows = []
    for scheme, kw in (("none", dict(moe_balance="none", moe_z_coef=0.0)),
                       ("aux (Switch + z)", dict(moe_balance="aux")),
                       ("aux-loss-free bias", dict(moe_balance="bias"))):
        cfg = TransformerConfig.preset("tiny-moe", **kw)
        torch.manual_seed(0)
        model = Transformer(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = SyntheticTokens(vocab_size=cfg.vocab_size, seq_len=32, seed=0)
        ratios = []
        for step in range(args.balance_steps):
            tokens = data.global_batch(step, 8)
            cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            layer_ratios = []
            for moe in moe_layers(model):
                moe.reduce_load()
                layer_ratios.append(moe.last["load_max_over_mean"])
                moe.update_bias()
            ratios.append(sum(layer_ratios) / len(layer_ratios))
        q = max(1, len(ratios) // 4)
        rows.append({"scheme": scheme, "steps": len(ratios), "max_over_mean_first_quarter": sum(ratios[:q]) / q,
                     "max_over_mean_last_quarter": sum(ratios[-q:]) / q, "max_over_mean_by_step": ratios})
    return rows


def comm(args) -> dict:
    """Bytes of one MoE layer's dispatch on all ranks of the world (balanced routing), and the
    layer's speed on ep = world against ep 1 (every rank holds all experts)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from hpcml.grid import ProcessGrid
    from hpcml.models.transformer.moe import MoE
    from hpcml.parallel.ep import AllToAllDispatch

    grid = ProcessGrid()
    grid.init_torch()
    p, rank = grid.world_size, grid.rank
    group = dist.new_group(list(range(p)))
    cfg = _layer_cfg(args)
    torch.manual_seed(0)
    layers = {"ep1": MoE(cfg), f"ep{p}": MoE(cfg)}
    for layer in layers.values():
        for w in layer.parameters():
            if w.requires_grad:
                torch.nn.init.normal_(w, std=0.02)
    ep = layers[f"ep{p}"]
    local = args.experts // p
    for name in ("w1", "w2", "w3"):  # this rank's experts only, as the plan shards them
        w = getattr(ep.experts, name)
        setattr(ep.experts, name, torch.nn.Parameter(w.detach()[rank * local:(rank + 1) * local].clone()))
    ep.dispatch = AllToAllDispatch(group, p, rank, args.experts)
    n, k, d = args.tokens, args.top_k, args.dim
    # balanced routing: every token's k experts round-robin, so each expert gets N*k/E
    idx = (torch.arange(n * k) % args.experts).reshape(n, k)
    x = torch.randn(n, d)
    order = torch.argsort(idx.reshape(-1), stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=args.experts)
    ep.dispatch.sent_bytes = 0
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        ep.dispatch(x[order // k], counts, ep.experts)
    counted = ep.dispatch.sent_bytes
    buffers = [e.input_shapes[0] for e in prof.events() if e.name == "gloo:all_to_all" and e.input_shapes
               and e.input_shapes[0]]
    token_elems = sum(s[0] * s[1] for s in buffers if s[-1] == d)  # tokens: [rows, d]; counts: [ep, E/ep]
    count_elems = sum(s[0] * s[1] for s in buffers if s[-1] != d)
    profiled = token_elems * (p - 1) / p * 4
    theory = 2 * n * k * d * (p - 1) / p * 4
    xs = torch.randn(1, n, d)

    def run(layer):
        xi = xs.clone().requires_grad_()
        layer(xi).sum().backward()

    t_ep1, t_ep = _best(lambda: run(layers["ep1"]), args.repeat), _best(lambda: run(ep), args.repeat)
    buf = torch.randn(n * k, d)
    out = torch.empty_like(buf)
    raw = _best(lambda: [dist.all_to_all_single(out, buf, group=group) for _ in range(4)], args.repeat)
    ep.dispatch.sent_bytes = 0
    run(ep)  # the layer's own (learned, unbalanced) routing
    from mpi4py import MPI

    times = grid.comm.allreduce(t_ep, op=MPI.MAX)
    return {"ranks": p, "tokens_per_rank": n, "top_k": k, "dim": d, "experts": args.experts,
            "theory_bytes_fwd": theory, "profiled_bytes_fwd": profiled, "profiled_over_theory": profiled / theory,
            "dispatcher_bytes_fwd": counted, "dispatcher_over_theory": counted / theory,
            "router_routing_bytes_fwd": ep.dispatch.sent_bytes,
            "router_routing_over_balanced": ep.dispatch.sent_bytes / theory,
            "count_all_to_all_elems": count_elems,
            "ep1_tokens_per_s": n / t_ep1, f"ep{p}_tokens_per_s": n / t_ep, f"ep{p}_over_ep1": t_ep1 / t_ep,
            "slowest_rank_ep_s": times, "raw_all_to_all_x4_s": raw, "ep_layer_minus_ep1_s": t_ep - t_ep1,
            "comm_overhead_over_raw": (t_ep - t_ep1) / raw if raw > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--expert-hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--balance-steps", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from mpi4py import MPI

    world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    result: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if world == 1:
        result["layer_speed"] = layer_speed(args)
        result["load_balance"] = load_balance(args)
    else:
        result["comm"] = comm(args)
    if rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
