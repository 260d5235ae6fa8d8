"""Sections of ``benchmarks/gpu.py`` that train: MFU of the ~1B transformer on one GPU against
plain eager PyTorch and the device's peak and measured GEMM rate (``mfu``); FSDP2 and tp=2
across every GPU present (``fsdp``, ``tp2``); the grouped-GEMM MoE layer against the dense
SwiGLU of the same active FLOPs (``moe``). Each runs in its own worker process."""

from __future__ import annotations

import time
from typing import Any

from gpu_common import (
    device_name,
    emit,
    free_device_memory,
    gemm_tflops,
    make_grid,
    peak_mem_gib,
    peak_tflops,
    ratio,
    sync,
    timed,
    transformer_config,
)


def _dtype(spec: dict):
    import torch

    return torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32


def _peak(spec: dict, device) -> tuple[float | None, str]:
    if spec.get("peak_tflops"):
        return float(spec["peak_tflops"]), "--peak-tflops"
    if device.type == "cpu":
        return None, "cpu: no bf16 peak table (smoke run)"
    return peak_tflops(device_name(device))


def _train(spec: dict, grid, parallel, per_replica_batch: int) -> dict[str, Any]:
    """hpcml's Trainer on this grid: warm-up steps, then ``steps`` timed steps."""
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    lay = grid.layout
    mc = transformer_config(spec["model_size"], spec["seq_len"])
    warm, steps = spec["warmup_steps"], spec["steps"]
    tc = TrainConfig(steps=warm + steps, global_batch=per_replica_batch * lay.dp, micro_batch=spec["micro_batch"],
                     seq_len=spec["seq_len"], bf16=spec["dtype"] == "bf16", progress=False, warmup_steps=1)
    trainer = build_llm_trainer(mc, tc, parallel, grid=grid)
    device = grid.torch.device
    trainer.fit(warm)
    sync(device)
    grid.comm.Barrier()
    t0 = time.perf_counter()
    trainer.fit(warm + steps)
    sync(device)
    grid.comm.Barrier()
    step_s = (time.perf_counter() - t0) / steps
    tokens = tc.global_batch * tc.seq_len
    from mpi4py import MPI

    mem = peak_mem_gib(device)
    row = {"model": spec["model_size"], "params": mc.num_params(), "seq_len": tc.seq_len,
           "global_batch": tc.global_batch, "micro_batch": tc.micro_batch, "steps": steps, "warmup_steps": warm,
           "layout": lay.describe_degrees(), "step_s": step_s,
           "step_s_median": sorted(m["step_s"] for m in trainer.history[warm:])[steps // 2],
           "tokens_per_s": tokens / step_s, "tokens_per_s_per_device": tokens / step_s / lay.world_size,
           "tflops_per_device": mc.flops_per_token(tc.seq_len) * tokens / step_s / lay.world_size / 1e12,
           "final_loss": trainer.history[-1]["loss"],
           "peak_mem_gib_max": grid.comm.allreduce(mem, op=MPI.MAX) if mem is not None else None}
    del trainer
    free_device_memory(device)
    return row


def _eager(spec: dict, device) -> float:
    """Seconds per step of the peer: the same model, batch, AdamW and clipping in a plain eager loop."""
    import torch

    from hpcml.models.transformer import Transformer, cross_entropy
    from hpcml.train import SyntheticTokens, TrainConfig
    from hpcml.train.loop import make_optimizer

    mc = transformer_config(spec["model_size"], spec["seq_len"])
    tc = TrainConfig(global_batch=spec["batch"], micro_batch=spec["micro_batch"], seq_len=spec["seq_len"])
    torch.manual_seed(0)
    model = Transformer(mc).to(device)
    opt, _ = make_optimizer(model.parameters(), tc)
    data = SyntheticTokens(vocab_size=mc.vocab_size, seq_len=tc.seq_len)
    n_micro = tc.global_batch // tc.micro_batch
    bf16 = spec["dtype"] == "bf16"
    step = [0]

    def eager_step():
        tok = data.global_batch(step[0], tc.global_batch).to(device)
        step[0] += 1
        for x, y in zip(tok[:, :-1].chunk(n_micro), tok[:, 1:].chunk(n_micro)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                (cross_entropy(model(x), y) / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # the mean, as hpcml's figure is (total time of the timed steps / steps)
    return timed(eager_step, device, warmup=spec["warmup_steps"], repeat=spec["steps"])["mean_s"]


def mfu(spec: dict) -> None:
    """(a) One device: hpcml's Trainer, the eager peer, the measured GEMM rate, the peak."""
    grid = make_grid(spec)
    device = grid.torch.device
    peak, source = _peak(spec, device)
    row = _train(spec, grid, None, spec["batch"])
    eager_s = _eager(spec, device)
    free_device_memory(device)  # the peer's model and optimizer went with its frame
    gemm = gemm_tflops(device, _dtype(spec), spec["gemm_n"])
    tokens = row["global_batch"] * row["seq_len"]
    row.update({
        "device": device_name(device), "dtype": f"{spec['dtype']} autocast, fp32 parameters and AdamW state",
        "eager_step_s": eager_s, "eager_tokens_per_s": tokens / eager_s, "hpcml_vs_eager": eager_s / row["step_s"],
        "gemm_n": spec["gemm_n"], "gemm_tflops": gemm, "peak_tflops": peak, "peak_source": source,
        "mfu": ratio(row["tflops_per_device"], peak), "of_measured_gemm": row["tflops_per_device"] / gemm,
        "gemm_of_peak": ratio(gemm, peak)})
    emit(grid.rank, {"status": "ok", **row})


def parallel(spec: dict, kind: str) -> None:
    """(b) Every rank a device: FSDP2 over all of them (``fsdp``), or tp=2 with dp over the rest
    (``tp2``); the per-replica batch is the one-device run's (weak scaling)."""
    from hpcml.parallel import ParallelConfig

    grid = make_grid(spec, **({"tp": 2} if kind == "tp2" else {}))
    device = grid.torch.device
    peak, source = _peak(spec, device)
    row = _train(spec, grid, ParallelConfig(fsdp=kind == "fsdp"), spec["batch"])
    row.update({"device": device_name(device), "ranks": grid.world_size, "peak_tflops": peak, "peak_source": source,
                "mfu_per_device": ratio(row["tflops_per_device"], peak)})
    emit(grid.rank, {"status": "ok", **row})


def moe(spec: dict) -> None:
    """(c) One MoE feed-forward (router, permutation, experts as grouped GEMMs; and the
    per-expert loop) against the dense SwiGLU with the same active FLOPs (hidden = top_k x
    expert hidden), forward + backward of ``moe_tokens`` tokens, in ``dtype``."""
    import torch

    from hpcml.models.transformer import TransformerConfig
    from hpcml.models.transformer.model import FeedForward
    from hpcml.models.transformer.moe import MoE

    grid = make_grid(spec)
    device, dtype = grid.torch.device, _dtype(spec)
    d, n, e, k, eh = (spec[f"moe_{x}"] for x in ("dim", "tokens", "experts", "top_k", "expert_hidden"))

    def cfg(grouped: bool):
        return TransformerConfig(vocab_size=256, dim=d, n_layers=1, n_heads=max(1, d // 128), ffn_hidden=eh,
                                 n_experts=e, moe_top_k=k, moe_z_coef=0.0, moe_aux_coef=0.0, moe_grouped_mm=grouped)

    torch.manual_seed(0)
    x = torch.randn(1, n, d, device=device, dtype=dtype)
    build = {"dense": lambda: FeedForward(cfg(True), hidden=k * eh), "grouped": lambda: MoE(cfg(True)),
             "loop": lambda: MoE(cfg(False))}
    flops = {"dense": 6 * n * 3 * d * k * eh, "grouped": 6 * n * (3 * d * eh * k + d * e)}
    flops["loop"] = flops["grouped"]
    peak, source = _peak(spec, device)
    out: dict[str, Any] = {"device": device_name(device), "dtype": spec["dtype"], "tokens": n, "dim": d, "experts": e,
                           "top_k": k, "expert_hidden": eh, "dense_hidden": k * eh, "peak_tflops": peak,
                           "peak_source": source}
    errors = []
    for name, make in build.items():
        try:  # one variant failing (grouped_mm on a device without it) keeps the others' figures
            out.update(_layer_speed(name, make, x, flops[name], peak, spec["repeat"]))
        except Exception as e:  # noqa: BLE001 -- reported in the JSON; the section then fails
            errors.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        free_device_memory(device)
    out.update({"active_flops_per_token_dense": flops["dense"] / n, "active_flops_per_token_moe": flops["grouped"] / n,
                "grouped_vs_dense": ratio(out.get("dense_s"), out.get("grouped_s")),
                "loop_vs_dense": ratio(out.get("dense_s"), out.get("loop_s")),
                "grouped_vs_loop": ratio(out.get("loop_s"), out.get("grouped_s"))})
    emit(grid.rank, {"status": "error", "error": "; ".join(errors), **out} if errors else {"status": "ok", **out})


def _layer_speed(name: str, make, x, flops: float, peak: float | None, repeat: int) -> dict[str, Any]:
    """Forward + backward of one freshly built layer on ``x``: median seconds, tokens/s, TFLOP/s."""
    import torch

    torch.manual_seed(1)  # the two MoE variants get the same router and experts
    layer = make()
    for p in layer.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    layer.to(device=x.device, dtype=x.dtype)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x.detach().requires_grad_()).sum().backward()

    t = timed(step, x.device, warmup=2, repeat=repeat)
    n, tflops = x.shape[1], flops / t["median_s"] / 1e12
    out = {f"{name}_s": t["median_s"], f"{name}_best_s": t["best_s"], f"{name}_tokens_per_s": n / t["median_s"],
           f"{name}_tflops": tflops, f"{name}_of_peak": ratio(tflops, peak)}
    if hasattr(layer, "load_local"):  # MoE: assignments per expert over every run above
        load = layer.load_local
        out[f"{name}_load_max_over_mean"] = float(load.max() / load.mean().clamp_min(1e-20))
    return out
