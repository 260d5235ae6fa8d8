"""torchtitan's Llama 3.1 runs on 96 GB, 500 W H100s (its December 2024 benchmark, Tables 1-6:
FSDP, TP, PP and CP on 8-512 GPUs, eager and compiled, bf16 and Float8, each with its peak memory)
as planner cases, each layout as torchtitan @9dec370 ran it: sequence parallelism with tp, keys and
values all-gathered over cp (its ``context_parallel_rotate_method`` default), parameters kept
gathered from forward to backward under a pipeline (``reshard_after_forward`` off with pp), pp
micro-batches a step whatever the schedule (``pipeline_parallel_microbatches``' default), two
stages a rank when interleaved, the blocks alone split over the stages (its ``generate_split_points``
gives the remainder to the middle stages, priced with torchtitan's later rule, the first stages':
on these rows one block more on the first rank, none on the last)."""

from __future__ import annotations

from hpcml.plan.calibration import published
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.cases import Case

SOURCE = "torchtitan_h100_llama31_2024-12"
MODELS = {"Llama 3.1 8B": "llama3-8b", "Llama 3.1 70B": "llama3-70b", "Llama 3.1 405B": "llama3-405b"}
#: Its 8B config's ``selective_ac_option = 'op'``.
SELECTIVE = "selective-op"


def _degrees(parallelism: str) -> dict[str, int]:
    """``"FSDP 8, CP 2, TP 8, PP8"`` -> ``{"FSDP": 8, "CP": 2, "TP": 8, "PP": 8}``."""
    out = {}
    for part in parallelism.split(","):
        name = part.strip().rstrip("0123456789").strip()
        out[name] = int(part.strip()[len(name):])
    return out


def _case(table: str, row: list) -> Case:
    source_table, model, gpus, parallelism, local, _gbs, seq, ac, precision, compiled, label, tps, mem = row
    d = _degrees(parallelism)
    tp, cp, pp, fsdp = d.get("TP", 1), d.get("CP", 1), d.get("PP", 1), d["FSDP"]
    interleaved = label.startswith("Interleaved")
    piped = {"schedule": "interleaved1f1b" if interleaved else "1f1b", "stages_per_rank": 2 if interleaved else None,
             "pipeline_split": "blocks"} if pp > 1 else {}
    layout = PlanLayout(model=MODELS[model], gpus=gpus, gpu="h100-96gb-500w", seq_len=seq if isinstance(seq, int)
                        else 8192, global_batch=local * fsdp, micro_batch=local // pp, tp=tp, cp=cp, pp=pp,
                        zero=2 if pp > 1 else 3, recompute=SELECTIVE if ac == "selective" else ac,
                        sequence_parallel=tp > 1, cp_kind="allgather" if cp > 1 else "ulysses",
                        precision="fp8" if precision == "float8" else "bf16", compile=compiled == "yes",
                        overlap="AsyncTP" in label, framework="torchtitan", **piped)
    return Case(table, f"{source_table} {model.split()[-1]} {parallelism} {label}", layout,
                tokens_per_gpu=float(tps), memory_gib=float(mem))


def _rows(keep) -> list[list]:
    return [r for r in published(SOURCE)["rows"] if keep(precision=r[8], compiled=r[9] == "yes")]


def torchtitan_h100() -> list[Case]:
    """Tables 1 and 3's bf16 runs without torch.compile (Llama 3.1 8B, FSDP on 8 and 128 GPUs,
    selective recompute, seq 8192): the power-capped part's sustained share and the H100 family's
    reserved memory are fitted on them."""
    return [_case("torchtitan-h100-2024-12", r) for r in _rows(lambda precision, compiled: precision == "bf16"
                                                               and not compiled)]


def torchtitan_h100_compile() -> list[Case]:
    """The same two runs compiled (``compile``): the one pair that isolates what torch.compile saves,
    on which ``compiled_passes`` is fitted."""
    return [_case("torchtitan-h100-compile", r) for r in _rows(lambda precision, compiled: precision == "bf16"
                                                               and compiled)]


def torchtitan_h100_4d() -> list[Case]:
    """Every Float8 run, compiled (14, held out): 8B on FSDP, and on FSDP x CP at 32K-262K tokens; 70B
    on FSDP 32 x TP 8 (async TP or not); 405B on 512 GPUs in 3-D (FSDP 8 x TP 8 x PP 8, 1F1B and
    interleaved) and 4-D (x CP 1-8 at 32K-262K tokens)."""
    return [_case("torchtitan-h100-4d", r) for r in _rows(lambda precision, compiled: precision == "float8")]


def torchtitan_h100_async_tp() -> list[Case]:
    """torchtitan's June 2025 async-TP benchmark (held out): Llama 3.1 70B on 256 H100s (FSDP 32 x
    TP 8, full recompute, 16 sequences a data rank) and 8B on 64 (FSDP 8 x TP 8, op-level selective
    recompute, 12), compiled, bf16 and Float8 (tensorwise), each with vanilla TP and async TP
    (``overlap``). The rowwise Float8 rows are left out: its source calls their baseline a defect
    being fixed."""
    out = []
    for model, gpus, fsdp, tp, local, ac, quant, kind, tps, _speedup in published(
            "torchtitan_h100_asynctp_2025-06")["rows"]:
        if quant == "float8 rowwise":
            continue
        layout = PlanLayout(model=MODELS[model], gpus=gpus, gpu="h100-96gb-500w", seq_len=8192,
                            global_batch=local * fsdp, micro_batch=local, tp=tp, zero=3,
                            recompute=SELECTIVE if ac == "selective op" else ac, sequence_parallel=True,
                            precision="bf16" if quant == "bf16" else "fp8", compile=True, overlap=kind == "async",
                            framework="torchtitan")
        out.append(Case("torchtitan-h100-async-tp", f"{model.split()[-1]} FSDP {fsdp} x TP {tp} {quant} {kind} TP",
                        layout, tokens_per_gpu=float(tps)))
    return out
