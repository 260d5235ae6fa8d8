"""Every valid layout of a model on N devices, scored: the grid's degree rules and the model's
plan rules prune, memory filters, the time model ranks.

The candidates are what the framework can run: for hpcml, ZeRO 0 (DDP), 2 and 3 (FSDP2 with
and without resharding after forward), recompute none or full, flash attention; for Megatron,
Megatron-DeepSpeed and torchtitan their own options (ZeRO-1, selective recompute) as well.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from hpcml.errors import ConfigError
from hpcml.grid.layout import divisors
from hpcml.models.transformer.config import TransformerConfig
from hpcml.numeric import is_int
from hpcml.plan import calibration
from hpcml.plan.devices import Device
from hpcml.plan.predict import (Prediction, evaluate, hf_dir, load_model, megatron_wants_sp, plan_rules,
                                resolve_device, tied)
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.framework_rules import deepspeed_refuses

ZERO = {"hpcml": (0, 2, 3), "megatron": (0, 1, 3), "torchtitan": (0, 2, 3), "deepspeed": (0, 1, 2, 3)}
RECOMPUTE = {"hpcml": ("none", "full"), "megatron": ("none", "selective", "full"),
             "deepspeed": ("none", "selective", "full"),
             "torchtitan": ("none", "selective-op", "selective-layer", "full")}


def candidates(base: PlanLayout, cfg: TransformerConfig, dev: Device, *, max_micro_batch: int = 64,
               refused: list[int] | None = None) -> Iterator[PlanLayout]:
    """Every layout of ``base``'s model, devices, sequence and batch that the grid and the model's
    plan accept (:func:`candidate_groups`, one by one)."""
    for group in candidate_groups(base, cfg, dev, max_micro_batch=max_micro_batch, refused=refused):
        yield from group


def candidate_groups(base: PlanLayout, cfg: TransformerConfig, dev: Device, *, max_micro_batch: int = 64,
                     refused: list[int] | None = None) -> Iterator[list[PlanLayout]]:
    """Every layout of ``base``'s model, devices, sequence and batch that the grid and the
    model's plan accept: tp within a node, cp, pp, ep for MoE models, micro-batch, ZeRO stage,
    recompute, sequence parallelism, and the pipeline schedule. ``refused`` (a one-item
    counter): the model's plan is checked before a layout is built, and the layouts it refuses
    are counted there instead of yielded -- pruned before they cost anything (most of a large
    search is refused: 31,260 of 39,612 layouts of a 405B model on 16,384 GPUs). Yielded in groups
    alike but for the recompute mode, ``full`` last: the least memory of them."""
    fw, gpus = base.framework, base.gpus
    sync, base = base.grad_sync, _with_sync(base, None)  # asked for, or both tried where hpcml's FSDP accumulates
    if sync == "step" and fw != "hpcml":
        raise ConfigError(f"grad_sync step with framework {fw}: without a pipeline only hpcml's trainer can be told "
                          f"to reduce once a step ({fw} reduces each micro-batch's; under a pipeline every framework "
                          f"reduces once a step)")
    max_stages = cfg.n_layers + (2 if base.split == "ends" else 0)  # (ends: the embedding and the output as blocks)
    for tp in divisors(min(gpus, dev.gpus_per_node)):
        if gpus % tp:
            continue
        for cp in divisors(gpus // tp):
            if base.seq_len % cp:
                continue
            for pp in divisors(gpus // (tp * cp)):
                if pp > max_stages:
                    continue
                dp = gpus // (tp * cp * pp)
                if base.global_batch % dp:
                    continue
                eps = [e for e in divisors(cp * dp) if cfg.n_experts % e == 0] if cfg.n_experts else [1]
                schedules = [("1f1b", None)] if pp == 1 or fw == "deepspeed" else \
                    [("1f1b", None), ("interleaved1f1b", base.stages_per_rank or 2)]
                rules_cfg, _, _, why = tied(cfg, fw, tp, pp, base.model)  # the same for every layout below
                for ep in eps:
                    # (hpcml's trainer runs SP without cp and experts; the other frameworks with both)
                    sp_ok = tp > 1 and (fw != "hpcml" or cp == 1 and not cfg.n_experts)
                    sps = (True,) if megatron_wants_sp(cfg, fw, tp) else (False, True) if sp_ok else (False,)
                    for sp in sps:
                        for schedule, v in schedules:
                            for mb in divisors(base.global_batch // dp):
                                if mb > max_micro_batch:
                                    break
                                if schedule == "interleaved1f1b" and (base.global_batch // (dp * mb)) % pp:
                                    continue
                                if pp * (v or 1) > max_stages:
                                    continue
                                try:  # the layout's own rules (hpcml's pipeline needs >= pp micro-batches, ...)
                                    lay = base.with_degrees(tp=tp, cp=cp, pp=pp, ep=ep, sequence_parallel=sp,
                                                            schedule=schedule, stages_per_rank=v, micro_batch=mb)
                                except ConfigError:
                                    continue
                                for zero in ZERO[fw]:
                                    if fw == "deepspeed" and deepspeed_refuses(pp, zero, schedule, base.overlap):
                                        continue  # its pipeline: ZeRO 0-1; its BF16_Optimizer: no overlap
                                    if refused is not None and (why or plan_rules(rules_cfg, gpus, tp, cp, pp, ep,
                                                                                  zero >= 2, sp and fw == "hpcml",
                                                                                  schedule, v, base.cp_kind,
                                                                                  lay.split)):
                                        refused[0] += len(RECOMPUTE[fw])
                                        continue
                                    try:  # (NeMo's remainders need ZeRO 0-1: the layout's own rule)
                                        at_zero = lay.with_zero(zero)
                                    except ConfigError:
                                        continue
                                    if zero >= 2 and pp > 1 and sync == "microbatch":
                                        continue  # (a pipeline reduces once a step)
                                    syncs = (None,) if zero < 2 or pp > 1 or lay.microbatches == 1 else \
                                        (sync,) if sync else (None, "step") if fw == "hpcml" else (None,)
                                    for gs in syncs:
                                        yield [_with_sync(at_zero.with_recompute(rc), gs) for rc in RECOMPUTE[fw]]


def _full_is_least(cfg: TransformerConfig, lay: PlanLayout) -> bool:
    """Full recompute needs the least memory of the modes: it keeps each block's input and one block
    whole for its recompute, where the others keep each block's activations (at least its input and
    more), so it is least wherever a rank holds two or more blocks; with one, keeping that block
    whole may be less than its input and the recompute's copy (then none is priced too: the
    selective modes keep each block's share and one block whole, never less than full)."""
    return cfg.n_layers >= 2 * lay.pp * lay.v


def _with_sync(lay: PlanLayout, sync: str | None) -> PlanLayout:
    """``lay`` with ``grad_sync`` set, unchecked: the search sets it only where it is valid."""
    if lay.grad_sync == sync:
        return lay
    return lay.unchecked(grad_sync=sync)


@dataclass(frozen=True)
class SearchResult:
    best: list[Prediction]
    candidates: int
    fitting: int
    refused: int


def search(base: PlanLayout, *, top: int = 5, headroom: float = 0.0) -> SearchResult:
    """The ``top`` fitting layouts by predicted tokens/s (ties: less memory first); a layout
    fits when its fullest rank needs at most ``1 - headroom`` of the device's memory."""
    cfg, dev = load_model(base.model), resolve_device(base)
    c = calibration.constants(dev)
    n = fitting = 0
    refused = [0]
    scored: list[Prediction] = []
    for group in candidate_groups(base, cfg, dev, refused=refused):
        n += len(group)
        priced = {len(group) - 1: evaluate(cfg, dev, c, group[-1], time_if_oom=False)}  # full recompute first
        if not _fits(priced[len(group) - 1], dev, headroom):
            if _full_is_least(cfg, group[-1]):
                continue  # full keeps the least: none of the group fits
            priced[0] = evaluate(cfg, dev, c, group[0], time_if_oom=False)
            if not _fits(priced[0], dev, headroom):
                continue  # the selective modes keep more than full (each block's share, one block whole)
        for i, lay in enumerate(group):
            p = priced[i] if i in priced else evaluate(cfg, dev, c, lay, time_if_oom=False)
            if _fits(p, dev, headroom):
                fitting += 1
                scored.append(p)
    scored.sort(key=_faster)
    best: list[Prediction] = []
    for p in scored:  # a twin is listed once: the same layout but its ZeRO stage, priced the same
        if not any(_twin(p, q) for q in best):
            best.append(p)
            if len(best) == top:
                break
    return SearchResult(best, n + refused[0], fitting, refused[0])


def _twin(p: Prediction, q: Prediction) -> bool:
    """``p`` is ``q`` but for its ZeRO stage, with the same step time and memory (ZeRO-2 and -3
    under a pipeline, whose stages gather once a step either way)."""
    return p.step_s == q.step_s and p.memory_gib == q.memory_gib and p.layout.zero != q.layout.zero \
        and p.layout.unchecked(zero=q.layout.zero) == q.layout


def _fits(p: Prediction, dev: Device, headroom: float) -> bool:
    """Runs, with ``headroom`` of the device's memory to spare."""
    return p.fits and p.memory_gib["total"] <= dev.memory_gib * (1 - headroom)


def _faster(p: Prediction) -> tuple[float, float]:
    """The search's order: more tokens/s first, then less memory."""
    return -p.tokens_per_s, p.memory_gib["total"]


def fastest_micro_batch(lay: PlanLayout, *, headroom: float = 0.0, max_micro_batch: int = 64) -> PlanLayout:
    """``lay`` at the micro-batch a search would pick for it: the fastest that fits within
    ``1 - headroom`` of the device (ties: less memory), among the divisors of its per-replica
    batch; ``lay`` itself when none fits (its prediction then says why). A layout given
    without a micro-batch asks about its other degrees: answered at micro-batch 1 it was
    predicted (and ``--emit`` ran it) up to 7x slower than the search's choice."""
    cfg, dev = load_model(lay.model), resolve_device(lay)
    c = calibration.constants(dev)
    fitting = []
    for mb in divisors(lay.global_batch // lay.dp):
        if mb > max_micro_batch:
            break
        try:  # the layout's own rules (a pipeline needs >= pp micro-batches, ...)
            p = evaluate(cfg, dev, c, replace(lay, micro_batch=mb), time_if_oom=False)
        except ConfigError:
            continue
        if _fits(p, dev, headroom):
            fitting.append(p)
    return min(fitting, key=_faster).layout if fitting else lay


def emit(lay: PlanLayout) -> list[str]:
    """``workflows/llm_pretrain.py`` arguments running ``lay``; a one-line error names what
    hpcml's trainer cannot run."""
    bad = []
    if lay.framework != "hpcml":
        bad.append(f"framework {lay.framework}")
    if lay.zero == 1:
        bad.append("zero 1 (hpcml has DDP, or FSDP2: zero 2 and 3)")
    if lay.recompute not in ("none", "full"):
        bad.append(f"recompute {lay.recompute} (hpcml: none or full)")
    if lay.attention == "eager":
        bad.append("eager attention (hpcml uses SDPA)")
    if lay.overlap:
        bad.append("overlap")
    if lay.positions == "alibi" and lay.fpdt_chunk:
        bad.append("positions alibi with FPDT (its chunked kernel takes no biases)")
    if lay.precision == "fp8":
        bad.append("precision fp8 (hpcml's trainer: bf16 or fp32)")
    if lay.loss != "eager":
        bad.append(f"loss {lay.loss} (hpcml's trainer: eager, or FPDT's chunked loss)")
    if lay.schedule == "interleaved1f1b" and lay.v != 2:
        bad.append(f"{lay.v} stages per rank (llm_pretrain.py runs 2 with interleaved1f1b)")
    model = _model_args(lay.model)
    if model is None:
        bad.append("a model that is neither a preset nor a Hugging Face directory (llm_pretrain.py takes those)")
    if bad:
        raise ConfigError(f"cannot emit this layout for llm_pretrain.py: {'; '.join(bad)}")
    args = [*model, "--tp", str(lay.tp), "--pp", str(lay.pp), "--cp", str(lay.cp)]
    args += ["--cp-kind", lay.cp_kind] if lay.cp > 1 and lay.cp_kind != "ulysses" else []
    args += [f"--{k}={v}" for k, v in (("activation", lay.activation), ("norm", lay.norm), ("positions", lay.positions))
             if v is not None]
    args += [] if lay.bias is None else ["--bias" if lay.bias else "--no-bias"]
    if lay.ep > 1:
        args += ["--ep", str(lay.ep)]
    if lay.zero >= 2:
        args += ["--fsdp"] + (["--zero2"] if lay.zero == 2 else [])
        args += ["--dp-replicate", str(lay.dp_replicate)] if lay.dp_replicate > 1 else []
        args += [f"--{k}" for k in ("hpz", "qwz", "qgz") if getattr(lay, k)]
        args += ["--quant-block", str(lay.quant_block)] if (lay.qwz or lay.qgz) and lay.quant_block != 256 else []
        args += ["--grad-sync", "step"] if lay.grad_sync == "step" else []
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    if lay.pp > 1:
        args += ["--schedule", lay.schedule]
    if lay.recompute == "full":
        args.append("--activation-checkpointing")
    if lay.fpdt_chunk:
        args += ["--fpdt-chunk", str(lay.fpdt_chunk)]
    if lay.loss_chunk:
        args += ["--loss-chunk", str(lay.loss_chunk)]
    if lay.precision == "bf16":
        args.append("--bf16")
    if lay.reduce_dtype != "fp32":
        args += ["--reduce-dtype", lay.reduce_dtype]
    args += ["--micro-batch", str(lay.micro_batch), "--global-batch", str(lay.global_batch),
             "--seq-len", str(lay.seq_len)]
    return args


#: llm_pretrain.py flags that are a member's own in a population of layouts (each in its
#: ``--member`` JSON), with the number of values each takes.
MEMBER_FLAGS = {"--tp": 1, "--pp": 1, "--cp": 1, "--ep": 1, "--cp-kind": 1, "--fsdp": 0, "--zero2": 0,
                "--dp-replicate": 1, "--hpz": 0, "--qwz": 0, "--qgz": 0, "--quant-block": 1, "--sequence-parallel": 0,
                "--schedule": 1, "--activation-checkpointing": 0, "--fpdt-chunk": 1, "--reduce-dtype": 1,
                "--grad-sync": 1, "--loss-chunk": 1, "--micro-batch": 1}


def member_entry(lay: PlanLayout) -> dict:
    """``lay``'s ``--member`` object for llm_pretrain.py: its degrees and ParallelConfig fields."""
    entry = {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, **({"ep": lay.ep} if lay.ep > 1 else {})}
    entry |= {"cp_kind": lay.cp_kind} if lay.cp > 1 and lay.cp_kind != "ulysses" else {}
    if lay.zero >= 2:
        entry |= {"fsdp": True, **({"reshard_after_forward": False} if lay.zero == 2 else {})}
        entry |= {"dp_replicate": lay.dp_replicate} if lay.dp_replicate > 1 else {}
        entry |= {k: True for k in ("hpz", "qwz", "qgz") if getattr(lay, k)}
        entry |= {"quant_block": lay.quant_block} if (lay.qwz or lay.qgz) and lay.quant_block != 256 else {}
        entry |= {"grad_sync": "step"} if lay.grad_sync == "step" else {}
    entry |= {"sequence_parallel": True} if lay.sequence_parallel else {}
    entry |= {"pp_schedule": lay.schedule} if lay.pp > 1 else {}
    entry |= {"activation_checkpointing": True} if lay.recompute == "full" else {}
    entry |= {"fpdt_chunk": lay.fpdt_chunk} if lay.fpdt_chunk else {}
    entry |= {"loss_chunk": lay.loss_chunk} if lay.loss_chunk else {}
    entry |= {"reduce_dtype": lay.reduce_dtype} if lay.reduce_dtype != "fp32" else {}
    return {**entry, "micro_batch": lay.micro_batch}


def emit_members(lays: list[PlanLayout]) -> list[str]:
    """llm_pretrain.py arguments running a population whose member ``i`` has layout ``lays[i]``:
    the shared arguments once (one model, precision, global batch and sequence length, or a
    one-line refusal), then a ``--member`` object each."""
    shared = [_shared(emit(lay)) for lay in lays]
    odd = [i for i, s in enumerate(shared) if s != shared[0]]
    if odd:
        raise ConfigError(f"members {odd} differ from member 0 in more than their layout ({shlex.join(shared[odd[0]])} "
                          f"against {shlex.join(shared[0])}): a population trains one model at one precision, global "
                          f"batch and sequence length")
    members = [json.dumps(member_entry(lay), separators=(",", ":")) for lay in lays]
    return [*shared[0], *(x for m in members for x in ("--member", m))]


def _shared(args: list[str]) -> list[str]:
    """``args`` without a member's own flags (:data:`MEMBER_FLAGS`) and their values."""
    out, i = [], 0
    while i < len(args):
        n = MEMBER_FLAGS.get(args[i])
        out += [args[i]] if n is None else []
        i += 1 + (n or 0)
    return out


def _model_args(model) -> list[str] | None:
    """``--model PRESET`` or ``--init-from HF_DIR``; None for anything else."""
    from hpcml.models.transformer.presets import PRESETS

    if isinstance(model, str) and model in PRESETS:
        return ["--model", model]
    folder = hf_dir(model)
    return None if folder is None else ["--init-from", str(folder)]


#: With ``--emit job`` and no ``--ckpt-every``: a save about every this many seconds of training.
CKPT_EVERY_S = 600.0


def emit_job(lay: PlanLayout, walltime: str, *, steps: int | None = None, account: str | None = None,
             ckpt_dir: str = "checkpoints", ckpt_every: int | None = None, data: str | None = None,
             step_s: float | None = None, site: str | None = None, members: int = 1,
             population: list[str] = (), run: list[str] | None = None) -> str:
    """The ``hpcml job --submit`` command line that submits ``lay`` on its site (or ``site``: a
    machine the device was given for) and runs to completion:
    the steps of the whole run, a checkpoint every ``ckpt_every`` steps (default: about every
    :data:`CKPT_EVERY_S` of the predicted ``step_s``), ``--auto-resume`` (the job requeues at the
    walltime warning and the next one resumes), the account the site requires, the data.
    ``members``: a population of that many members of ``lay`` (``lay.gpus`` each) in one job,
    ``population`` the trainer's arguments for it (``--pop K`` ...); ``run``: the trainer's
    arguments in place of ``lay``'s (a population of layouts, :func:`emit_members`)."""
    from hpcml.ensemble.site import load_site

    site = site or lay.site
    if not site:
        raise ConfigError("--emit job needs --site (the job is written for a site)")
    if steps is None:
        raise ConfigError("--emit job needs --steps N: the optimizer steps of the whole run, over every requeue (the "
                          "job saves, requeues at its walltime and resumes until they are done)")
    if not is_int(steps) or steps < 1:
        raise ConfigError(f"--steps {steps!r}: expected an integer >= 1")
    if ckpt_every is not None and (not is_int(ckpt_every) or ckpt_every < 1):
        raise ConfigError(f"--ckpt-every {ckpt_every!r}: expected an integer >= 1")
    from hpcml.ensemble.checks import walltime_seconds, warning_seconds

    usable = walltime_seconds(walltime) - warning_seconds(walltime)  # HH:MM:SS, or one line naming it
    if step_s and usable < step_s:
        raise ConfigError(f"--walltime {walltime}: {usable} s of it before the job is told to save and stop, less "
                          f"than one predicted step ({step_s:.0f} s): each requeue would end without a step")
    account = load_site(site).account_for(account)  # one line where the site requires one and none is given
    if ckpt_every is None:
        ckpt_every = max(1, min(steps, round(CKPT_EVERY_S / step_s))) if step_s else max(1, steps // 20)
    dev = resolve_device(lay)
    ranks = lay.gpus * members
    nodes = -(-ranks // (lay.gpus_per_node or dev.gpus_per_node))
    run = [*(emit(lay) if run is None else run), *population, "--steps", str(steps), "--ckpt-dir", ckpt_dir,
           "--ckpt-every", str(ckpt_every), "--auto-resume", *(["--data", data] if data else [])]
    script = Path(__file__).resolve().parents[2] / "workflows" / "llm_pretrain.py"  # submitted from anywhere
    return shlex.join(["hpcml", "job", "--site", site, "--nodes", str(nodes), "--walltime", walltime,
                       *(["--account", account] if account else []), "--ranks", str(ranks), "--submit", "--",
                       "python", str(script) if script.is_file() else "workflows/llm_pretrain.py", *run])
