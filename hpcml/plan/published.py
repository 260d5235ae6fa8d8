"""Published measured runs as planner cases: each row of a table in ``data/published/`` becomes
a :class:`PlanLayout` with what was measured (throughput, step time, memory, or an OOM).

Throughput is compared per GPU in tokens/s: a published TFLOP/s or MFU figure is turned into
tokens/s with the publisher's own FLOP count (stated per table), so the comparison does not
depend on whose FLOP convention is used; an MFU error of x% is a tokens/s error of x%.
Assumptions a table does not state (sequence length, micro-batch, precision) are written next
to its rows here and in docs/plan.md.
"""

from __future__ import annotations

import math

from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan.calibration import published
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.cases import Case
from hpcml.plan.published_nanotron import nanotron_h100
from hpcml.plan.published_titan import (torchtitan_h100, torchtitan_h100_4d, torchtitan_h100_async_tp,
                                        torchtitan_h100_compile)
from hpcml.plan.published_nemo import (nemo_gpt3_175b, nemo_grok1_314b, nemo_llama31_8b, nemo_llama31_70b,
                                       nemo_llama31_405b, nemo_nemotron4_15b, nemo_nemotron4_340b, nemotron4_15b)


def gpt(h: int, heads: int, layers: int, vocab: int, seq: int) -> TransformerConfig:
    """A GPT-style shape as a SwiGLU transformer of the same parameter and FLOP count (8h/3
    rounded to 128 for the 4h GeLU MLP's 8h^2)."""
    return TransformerConfig(vocab_size=vocab, dim=h, n_heads=heads, n_layers=layers, max_seq_len=seq,
                             ffn_hidden=-(-8 * h // 3 // 128) * 128, vocab_multiple=128)


def megatron_flops(h: int, layers: int, seq: int, vocab: int, recompute: bool) -> float:
    """FLOPs per token by Narayanan et al. 2021, eq. 3 (96 with recompute, 72 without;
    Megatron-core's ``num_floating_point_operations`` for an MHA GPT gives the 72 form)."""
    k, v = (96, 16) if recompute else (72, 12)
    return k * layers * h * h * (1 + seq / (6 * h) + vocab / (v * layers * h))


def gpt_blocks(h: int, heads: int, layers: int, vocab: int, seq: int, positions: str = "learned") -> TransformerConfig:
    """GPT-3's blocks (GeLU MLP of 4h, LayerNorm, biases, tied embedding), as BLOOM, MT-NLG and MPT
    build them; ``positions``: learned, or BLOOM's ALiBi."""
    return TransformerConfig(vocab_size=vocab, dim=h, n_heads=heads, n_layers=layers, max_seq_len=seq, ffn_hidden=4 * h,
                             activation="gelu", norm="layernorm", bias=True, tie_embeddings=True, positions=positions)


def sc21_table1() -> list[Case]:
    """Narayanan et al. SC'21 Table 1 (A100 80GB, fp16, full recompute, seq 2048, vocab 51,200)
    with the layouts of Megatron-LM's ``examples/sc21/run_table_1.sh``."""
    img, lay = published("megatron_sc21_table1_readme_image"), published("megatron_sc21_table1_layouts")
    out = []
    for row, l in zip(img["rows"], lay["rows"], strict=True):
        size, h, layers, tflops = row[0], row[1], row[2], row[7]
        tp, pp, mbs, gbs, heads, nodes, extra = l[1], l[2], l[3], l[4], l[7], l[9], l[10]
        v = 1
        if "virtual-pipeline-stage" in extra:
            v = layers // (pp * int(extra.rsplit(" ", 1)[1]))
        cfg = gpt(h, heads, layers, 51200, 2048)
        layout = PlanLayout(model=cfg, gpus=nodes * 8, gpu="a100-80gb", seq_len=2048, global_batch=gbs, tp=tp, pp=pp,
                            micro_batch=mbs, recompute="full", attention="eager", framework="megatron",
                            schedule="interleaved1f1b" if v > 1 else "1f1b", stages_per_rank=v if v > 1 else None)
        out.append(Case("sc21-table1", size, layout,
                        tokens_per_gpu=tflops * 1e12 / megatron_flops(h, layers, 2048, 51200, True)))
    return out


def korthikanti_table5() -> list[Case]:
    """Korthikanti et al. 2022 Table 5 iteration times (A100 80GB, data-parallel size 1), full
    recompute and sequence parallel + selective recompute, layouts as calculon transcribes them."""
    out = []
    for row in published("korthikanti2022_table5_calculon")["rows"]:
        name, h, _ffn, heads, layers, seq, gpus, tp, pp, _dp, gbs, mbs, v, full_s, sel_s = row
        cfg = gpt(h, heads, layers, 51200, seq)
        for mode, t in (("full", full_s), ("selective", sel_s)):
            layout = PlanLayout(model=cfg, gpus=gpus, gpu="a100-80gb", seq_len=seq, global_batch=gbs, tp=tp, pp=pp,
                                micro_batch=mbs, recompute=mode, sequence_parallel=mode == "selective",
                                attention="eager", framework="megatron",
                                schedule="interleaved1f1b" if v > 1 else "1f1b",
                                stages_per_rank=v if v > 1 else None)
            out.append(Case("korthikanti-table5", f"{name} {mode}", layout, step_s=t,
                            tokens_per_gpu=gbs * seq / t / gpus))
    return out


_AC = {"no": "none", "selective layer": "selective-layer", "selective op": "selective-op", "full": "full"}
_TITAN = {"13B": ("llama2-13b", 4096), "70B": ("llama2-70b", 4096)}


def torchtitan_a100() -> list[Case]:
    """torchtitan's FSDP2 runs on 64 A100 80GB (Llama 2 13B/70B at seq 4096, Llama 3 8B/70B
    at 8192, the configs' defaults), OOM rows included."""
    out = []
    for table, models in (("torchtitan_a100_fsdp2_2024-04", _TITAN),
                          ("torchtitan_a100_llama3_fsdp2_2024", {"8B": ("llama3-8b", 8192),
                                                                  "70B": ("llama3-70b", 8192)})):
        for size, local, ac, wps, _mfu in published(table)["rows"]:
            preset, seq = models[size]
            local = int(str(local).split("[")[0])
            layout = PlanLayout(model=preset, gpus=64, gpu="a100-80gb", seq_len=seq, global_batch=64 * local,
                                micro_batch=local, zero=3, recompute=_AC[ac], framework="torchtitan")
            oom = wps == "OOM"
            out.append(Case(table, f"{preset} local {local} AC {ac}", layout, fits=not oom,
                            tokens_per_gpu=None if oom else float(wps)))
    return out


def megatron_core_h100() -> list[Case]:
    """Megatron-core's H100 weak-scaling table (seq 4096, vocab 131,072, its communication
    overlaps as the README lists them; bf16, no recompute, sequence parallelism and the
    distributed optimizer assumed, and the micro-batch: the README does not state them). Without a
    pipeline a data rank's 4 sequences are one micro-batch -- behind 4 of 1 Megatron's schedule
    could not hide the traffic the rows show hidden (the 32B row at TP 8 would be 33% slow) --
    and 1 with a pipeline."""
    out = []
    for row in published("megatron_core_h100_weak_scaling_2024")["rows"]:
        size, heads, h, layers, tp, pp, dp, gpus, batch, tflops, _mfu, _agg = row
        cfg = gpt(h, heads, layers, 131072, 4096)
        layout = PlanLayout(model=cfg, gpus=gpus, gpu="h100-80gb", seq_len=4096, global_batch=batch, tp=tp, pp=pp,
                            zero=1, framework="megatron", sequence_parallel=tp > 1, overlap=True,
                            attention="flash-attn", micro_batch=batch // dp if pp == 1 else 1)
        out.append(Case("megatron-core-h100", size, layout,
                        tokens_per_gpu=tflops * 1e12 / megatron_flops(h, layers, 4096, 131072, False)))
    return out


def llama3_405b(*, schedule: str = "interleaved1f1b", stages_per_rank: int | None = 8) -> list[Case]:
    """Llama 3 405B pre-training on 8,192 and 16,384 H100 80GB (TP 8, PP 16, CP 1 at 8K tokens and
    CP 16 at 128K; 16M tokens a step): 3-D parallelism at the scale the issue's hidden table has.
    As the paper describes its stack (section 3.3.2, quoted in the table's file): FSDP sharding
    the optimizer state and gradients, parameters kept from forward to backward (``zero`` 2, bf16
    compute over fp32 shards: ``torchtitan``, whose split counts the embedding and the output as a
    block each, as the paper's does), an interleaved schedule of 8 one-block chunks a rank (126
    blocks + 2 = 16 x 8), sequence parallelism with tp, keys and values all-gathered over cp,
    micro-batch 1, no recompute (``schedule``, ``stages_per_rank``: another schedule)."""
    out = []
    for gpus, tp, cp, pp, _tokens, tflops in published("llama3_405b_h100_2024")["rows"]:
        seq = 8192 if cp == 1 else 131072
        cfg = TransformerConfig.preset("llama3-405b")
        layout = PlanLayout(model=cfg, gpus=gpus, gpu="h100-80gb", seq_len=seq, global_batch=(1 << 24) // seq, tp=tp,
                            pp=pp, cp=cp, cp_kind="allgather", zero=2, sequence_parallel=True, framework="torchtitan",
                            schedule=schedule, stages_per_rank=stages_per_rank)
        out.append(Case("llama3-405b-h100", f"405B tp{tp} cp{cp} pp{pp} x{gpus}", layout,
                        tokens_per_gpu=tflops * 1e12 / cfg.flops_per_token(seq), notes={"mfu": tflops / 989}))
    return out


def bloom_176b() -> list[Case]:
    """BLOOM 176B on 384 A100 80GB (Megatron-DeepSpeed: TP 4 x PP 12 x DP 8, seq 2048, full
    recompute, DeepSpeed's ZeRO-1) at three global batch sizes of its ramp-up, 16 to 2,048: a
    pipeline from one micro-batch a step to 128. Its blocks as they are (GeLU MLP of 4h, LayerNorm,
    biases, ALiBi, tied embedding: the last stage holds its copy), Megatron's fused softmax rather
    than flash attention (``eager``), its nodes' 4 x 100 Gb/s Omni-Path (``node_injection_gbps`` 50 GB/s)."""
    out = []
    h, heads, layers, vocab, seq = 14336, 112, 70, 250880, 2048
    cfg = gpt_blocks(h, heads, layers, vocab, seq, positions="alibi")
    for gbs, mbs, tflops, step in published("bloom_176b_a100_2022")["rows"]:
        layout = PlanLayout(model=cfg, gpus=384, gpu="a100-80gb", node_injection_gbps=50, seq_len=seq, global_batch=gbs,
                            micro_batch=mbs, tp=4, pp=12, zero=1, recompute="full", attention="eager",
                            framework="deepspeed")
        out.append(Case("bloom-176b-a100", f"176B gbs {gbs} mbs {mbs}", layout, step_s=step,
                        tokens_per_gpu=tflops * 1e12 / megatron_flops(h, layers, seq, vocab, True)))
    return out


def mtnlg_530b() -> list[Case]:
    """Megatron-Turing NLG 530B on 2,240-3,360 A100s of Selene (DeepSpeed's pipeline engine and
    ZeRO-1 with Megatron's tensor slicing: TP 8 x PP 35, 3 blocks a stage, data-parallel 8-12),
    a global batch of 1,920 x 2,048 tokens: a second Megatron-DeepSpeed table beside BLOOM's, on
    HDR InfiniBand rather than Omni-Path. GPT-3's blocks, full recompute, Megatron's fused
    softmax, micro-batch 1 (unverified: the table's file says which of these its source gives);
    16-bit gradients (``reduce_dtype`` bf16): it ran before DeepSpeed's BF16_Optimizer existed."""
    h, heads, layers, vocab, seq, gbs = 20480, 128, 105, 50272, 2048, 1920
    cfg = gpt_blocks(h, heads, layers, vocab, seq)
    out = []
    for nodes, step, _tflops in published("mtnlg_530b_a100_2022")["rows"]:
        layout = PlanLayout(model=cfg, gpus=8 * nodes, gpu="a100-80gb", seq_len=seq, global_batch=gbs, micro_batch=1,
                            tp=8, pp=35, zero=1, recompute="full", attention="eager", framework="deepspeed",
                            reduce_dtype="bf16")
        out.append(Case("mtnlg-530b-a100", f"530B x{8 * nodes}", layout, step_s=step,
                        tokens_per_gpu=gbs * seq / (step * 8 * nodes)))
    return out


#: MPT shapes of llm-foundry's yamls (d_model, n_heads, n_layers)
MPT = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
       "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
       "70b": (8192, 64, 80)}
FOUNDRY = {"foundry-h100-large": ("H100 80GB BF16 (Large Scale, >= 128 GPUs)", "h100-80gb", None),
           "foundry-h100": ("H100 80GB BF16", "h100-80gb", None),
           "foundry-a100-80gb": ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "a100-80gb", None),
           "foundry-a100-40gb": ("A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "a100-40gb", None),
           # the 7 FP8 rows: the four of the 3B model fit fp8_eff, the three of the 1B are held out
           "foundry-h100-fp8": ("H100 80GB FP8", "h100-80gb", ("3b",)),
           "foundry-h100-fp8-1b": ("H100 80GB FP8", "h100-80gb", ("1b",))}


def llm_foundry(name: str) -> list[Case]:
    """llm-foundry's MPT benchmarks (Composer FSDP FULL_SHARD, bf16, flash attention, 125M-70B,
    512-65,536 tokens, 8-512 GPUs): one section of its README. MPT's blocks as they are (GeLU MLP
    of 4h, LayerNorm, biases, learned positions, tied embedding: the README's NumParams, exactly);
    FSDP2 with bf16 compute over fp32 shards (``torchtitan``) stands for Composer's FSDP, with
    llm-foundry's fused cross-entropy."""
    section, gpu, models = FOUNDRY[name]
    data = published("llm_foundry_mpt_benchmarks_2024-04")["sections"][section]
    cols = data["columns"]
    out = []
    for values in data["rows"]:
        r = dict(zip(cols, values))
        if models is not None and r["model"] not in models:
            continue
        h, heads, layers = MPT[r["model"]]
        cfg = gpt_blocks(h, heads, layers, 50368, r["seq_len"])
        layout = PlanLayout(model=cfg, gpus=r["gpus"], gpu=gpu, seq_len=r["seq_len"], global_batch=r["global_batch"],
                            micro_batch=r["micro_batch"], zero=3, framework="torchtitan", loss="fused",
                            precision="fp8" if r["precision"] == "amp_fp8" else "bf16",
                            recompute="full" if r["activation_checkpointing"] else "none")
        out.append(Case(name, f"{r['model']} seq {r['seq_len']} x{r['gpus']} mb {r['micro_batch']}"
                        + (" AC" if r["activation_checkpointing"] else ""), layout,
                        tokens_per_gpu=float(r["tokens_per_gpu"]), notes={"mfu": r["mfu"]}))
    return out


TABLES = {"sc21-table1": sc21_table1, "korthikanti-table5": korthikanti_table5, "torchtitan-a100": torchtitan_a100,
          "megatron-core-h100": megatron_core_h100, "torchtitan-h100": torchtitan_h100,
          "torchtitan-h100-compile": torchtitan_h100_compile, "torchtitan-h100-4d": torchtitan_h100_4d,
          "torchtitan-h100-async-tp": torchtitan_h100_async_tp,
          "llama3-405b-h100": llama3_405b,
          "bloom-176b-a100": bloom_176b, "mtnlg-530b-a100": mtnlg_530b, "nemo-llama31-405b-h100": nemo_llama31_405b,
          "nemo-nemotron4-340b-h100": nemo_nemotron4_340b, "nemo-llama31-70b-h100": nemo_llama31_70b,
          "nemo-nemotron4-15b-h100": nemo_nemotron4_15b, "nemo-grok1-314b-h100": nemo_grok1_314b,
          "nemo-gpt3-175b-h100": nemo_gpt3_175b, "nemo-llama31-8b-h100": nemo_llama31_8b,
          "nemotron4-15b-h100": nemotron4_15b,
          **{name: (lambda n=name: llm_foundry(n)) for name in FOUNDRY}, "nanotron-h100": nanotron_h100}
"""Every table the planner is checked against, by name."""

CALIBRATION = {"nvidia-a100": ["sc21-table1", "foundry-a100-80gb"],
               "nvidia-h100": ["megatron-core-h100", "foundry-h100", "foundry-h100-fp8"]}
"""The tables each device family's constants are fitted on; the others are held out."""

STAGED_CALIBRATION = {"nvidia-h100": ["nemo-llama31-8b-h100", "torchtitan-h100-compile"]}
"""Tables added to the family's for its staged constants alone (:data:`hpcml.plan.fit.STAGED`),
each fitted with the others held: a table that isolates what the constant prices. NVIDIA's
Llama 3.1 8B recipe runs cuDNN's attention (``NVTE_FUSED_ATTN=1``) at 8K tokens on TP 1, a
seventh of its FLOPs -- the fitted Megatron-core table, at 4K on TP 1-8, names no kernel.
torchtitan's two Llama 3.1 8B runs compiled and not (Tables 1 and 3, bf16) isolate what
``torch.compile`` saves (``compiled_passes``); their eager halves fit the part's sustained share."""

DEVICE_CALIBRATION = {"h100-96gb-500w": ["torchtitan-h100"]}
"""The tables a device's ``sustained`` share of its peak is fitted on, inside the range its source
gives (torchtitan's power-capped H100s: between the NVL and the SXM rating); nothing else is fitted there."""

MEMORY_CALIBRATION = {"nvidia-h100": ["torchtitan-h100"]}
"""The tables whose published memory fits a family's ``reserved_gib`` (torchtitan's H100 runs
are the only ones found that publish a peak per GPU; other families keep the default)."""


def relative_error(predicted: float, published_value: float) -> float:
    return predicted / published_value - 1 if published_value else math.inf
