"""NVIDIA's DGX Cloud benchmarking recipes (NeMo on H100s) as planner cases: every table in
both precisions, each row's layout as its launch script and config set it."""

from __future__ import annotations

from dataclasses import replace

from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan.calibration import published
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.cases import Case


#: NeMo's recipes keep FP8 runs' weights in FP8 (``+model.fp8_params=$FP8_ENABLED``).
FP8_PARAMS = {"fp8": {"fp8_params": True}}
#: ... and with Apex's distributed Adam, a BF16 run's master weights as 16-bit remainders
#: (NeMo's ``store_param_remainders``; an FP8-weight run's are stored whole).
APEX_ADAM = {"bf16": {"master_weights": "remainder"}, "fp8": {"fp8_params": True}}


def _megatron_recipe(table: str, seq: int, rows, by_precision: dict | None = None, **fixed) -> list[Case]:
    """Cases of one of NVIDIA's recipe tables: each row (label, model, GPUs, global batch, its own
    layout fields, BF16 and FP8 seconds a step) in both precisions, as Megatron-core runs them
    (the distributed optimizer, sequence parallelism, TP, p2p and data-parallel traffic overlapped);
    ``by_precision``: fields of the BF16 or the FP8 runs alone; a row's own fields win."""
    out = []
    for label, cfg, gpus, gbs, own, bf16, fp8 in rows:
        for precision, step in (("bf16", bf16), ("fp8", fp8)):
            fields = {"seq_len": seq, "zero": 1, "sequence_parallel": True, "overlap": True, "framework": "megatron",
                      **fixed, **(by_precision or {}).get(precision, {}), **own}
            layout = PlanLayout(model=cfg, gpus=gpus, gpu="h100-80gb", global_batch=gbs, precision=precision,
                                **fields)
            out.append(Case(table, f"{label} x{gpus} {precision}", layout, step_s=step,
                            tokens_per_gpu=layout.seq_len * gbs / step / gpus))
    return out


def nemo_llama31_405b() -> list[Case]:
    """NVIDIA's Llama 3.1 405B recipe on 32-2,304 H100s (NeMo 24.09: TP 8 x CP 2 x PP 9 with 7
    virtual stages a rank, no recompute; 16 query groups as its config has; the smaller GPU counts
    are its proxies of 7, 21 and 42 layers), in BF16 and FP8."""
    base = replace(TransformerConfig.preset("llama3-405b"), n_kv_heads=16)
    rows = [(f"{layers} layers", replace(base, n_layers=layers), gpus, gbs,
             {"pp": pp, "stages_per_rank": vp, "schedule": "interleaved1f1b" if vp else "1f1b"}, bf16, fp8)
            for gpus, layers, gbs, pp, vp, bf16, fp8 in published("nemo_llama31_405b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-llama31-405b-h100", 8192, rows, APEX_ADAM, tp=8, cp=2, cp_kind="allgather")


def nemo_llama31_70b() -> list[Case]:
    """NVIDIA's Llama 3.1 70B recipe on 64-2,048 H100s (NeMo 24.09: TP 4 x CP 2 x PP 4 with 5
    virtual stages a rank, 64 micro-batches a pipeline, no recompute), in BF16 and FP8."""
    cfg = TransformerConfig.preset("llama3-70b")
    rows = [("70B", cfg, gpus, gbs, {}, bf16, fp8)
            for gpus, gbs, bf16, fp8 in published("nemo_llama31_70b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-llama31-70b-h100", 8192, rows, APEX_ADAM, tp=4, cp=2, pp=4, stages_per_rank=5,
                            schedule="interleaved1f1b", cp_kind="allgather")


def _nemotron4(h: int, heads: int, layers: int) -> TransformerConfig:
    """A Nemotron-4 model: its squared-ReLU MLP of 4h planned as a GeLU one (the same matmuls and
    tensors kept), LayerNorm for its LayerNorm1p, no biases, rope, 8 query groups, untied."""
    return TransformerConfig(vocab_size=256000, dim=h, n_heads=heads, n_kv_heads=8, n_layers=layers,
                             max_seq_len=4096, ffn_hidden=4 * h, activation="gelu", norm="layernorm", bias=False,
                             positions="rope")


def nemo_nemotron4_340b() -> list[Case]:
    """NVIDIA's Nemotron-4 340B recipe on 128-2,048 H100s (NeMo 24.11: TP 8 x PP 8 with 12 virtual
    stages a rank, the distributed optimizer reducing in bf16, no recompute), in BF16 and FP8."""
    rows = [("340B", _nemotron4(18432, 96, 96), gpus, gbs, {}, bf16, fp8)
            for gpus, gbs, bf16, fp8 in published("nemo_nemotron4_340b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-nemotron4-340b-h100", 4096, rows, FP8_PARAMS, tp=8, pp=8, stages_per_rank=12,
                            schedule="interleaved1f1b", reduce_dtype="bf16", attention="flash-attn")


def nemo_nemotron4_15b() -> list[Case]:
    """NVIDIA's Nemotron-4 15B recipe on 16-2,048 H100s (NeMo 24.11: TP 4, no pipeline, micro-batch
    4, four a replica, 4 to 512 data ranks, no recompute), in BF16 and FP8."""
    rows = [("15B", _nemotron4(6144, 48, 32), gpus, gbs, {}, bf16, fp8)
            for gpus, gbs, bf16, fp8 in published("nemo_nemotron4_15b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-nemotron4-15b-h100", 4096, rows, FP8_PARAMS, tp=4, micro_batch=4, loss="fused")


def nemo_grok1_314b() -> list[Case]:
    """NVIDIA's Grok-1 314B recipe (8 experts, top-2, in every block) on 8-2,048 H100s: TP 4, EP 2-8,
    CP 2 and PP 2-8 with 8 virtual stages from 64 GPUs, its proxies of 2-32 layers below 512; the
    gated GeLU experts planned as SwiGLU ones (the same matmuls and tensors), BF16 and FP8."""
    base = TransformerConfig(vocab_size=128256, dim=6144, n_heads=48, n_kv_heads=8, n_layers=64, max_seq_len=8192,
                             ffn_hidden=32768, n_experts=8, moe_top_k=2)
    rows = [(f"{layers} layers", replace(base, n_layers=layers), gpus, gbs,
             {"seq_len": seq, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "stages_per_rank": vp,
              "schedule": "interleaved1f1b" if vp else "1f1b"}, bf16, fp8)
            for gpus, seq, layers, tp, pp, cp, ep, vp, gbs, bf16, fp8 in published("nemo_grok1_314b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-grok1-314b-h100", 8192, rows, FP8_PARAMS, reduce_dtype="bf16", cp_kind="allgather",
                            attention="flash-attn")


def nemo_gpt3_175b() -> list[Case]:
    """NVIDIA's GPT-3 175B recipe (NeMo Megatron 24.11: TP 4 x PP 8 with 12 virtual stages a rank,
    64 micro-batches a pipeline, sequence 2,048) on 128-2,048 H100s, in BF16 and FP8: GeLU, LayerNorm,
    biases, learned positions, a tied output layer (NeMo's GPT defaults)."""
    cfg = TransformerConfig(vocab_size=50257, vocab_multiple=512, dim=12288, n_heads=96, n_layers=96,
                            max_seq_len=2048, ffn_hidden=4 * 12288, activation="gelu", norm="layernorm", bias=True,
                            positions="learned", tie_embeddings=True)
    rows = [("175B", cfg, gpus, gbs, {}, bf16, fp8)
            for gpus, gbs, bf16, fp8 in published("nemo_gpt3_175b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-gpt3-175b-h100", 2048, rows, FP8_PARAMS, tp=4, pp=8, stages_per_rank=12,
                            schedule="interleaved1f1b", reduce_dtype="bf16", attention="flash-attn")


def nemo_llama31_8b() -> list[Case]:
    """NVIDIA's Llama 3.1 8B recipe (NeMo 24.09: CP 2 alone, 32 micro-batches a replica, sequence
    8,192) on 8-128 H100s, in BF16 and FP8."""
    rows = [("8B", TransformerConfig.preset("llama3-8b"), gpus, gbs, {}, bf16, fp8)
            for gpus, gbs, bf16, fp8 in published("nemo_llama31_8b_h100_2024")["rows"]]
    return _megatron_recipe("nemo-llama31-8b-h100", 8192, rows, FP8_PARAMS, cp=2, cp_kind="allgather",
                            sequence_parallel=False, loss="fused")


def nemotron4_15b(micro_batch: int = 1) -> list[Case]:
    """Nemotron-4 15B's own pre-training (its report's Table 2: TP 8 and 96-288 data ranks on
    768-2,304 H100s, 4 sequences of 4,096 a data rank, the distributed optimizer): data-parallel
    traffic over one NIC a GPU at scale, as NeMo's stack of early 2024 ran it (the NeMo launcher's
    config for the model: sequence parallelism, Apex's distributed Adam, its overlaps). The
    micro-batch is not stated (``micro_batch``: 1, the planner's default; the launcher's is 2)."""
    out = []
    for dp, gpus, step, mfu, gbs in published("nemotron4_15b_h100_2024")["rows"]:
        layout = PlanLayout(model=_nemotron4(6144, 48, 32), gpus=gpus, gpu="h100-80gb", seq_len=4096,
                            global_batch=gbs, tp=8, micro_batch=micro_batch, zero=1, sequence_parallel=True,
                            overlap=True, framework="megatron", **APEX_ADAM["bf16"])
        assert layout.dp == dp, (layout.dp, dp)
        out.append(Case("nemotron4-15b-h100", f"15B tp8 dp{dp} x{gpus}", layout, step_s=step,
                        tokens_per_gpu=4096 * gbs / step / gpus, notes={"mfu": mfu / 100}))
    return out
