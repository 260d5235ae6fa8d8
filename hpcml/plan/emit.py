"""What a chosen layout runs as: ``workflows/llm_pretrain.py``'s arguments (:func:`emit`), a
population's members' (:func:`emit_members`), and the ``hpcml job`` command that submits it
(:func:`emit_job`); a one-line error names what hpcml's trainer cannot run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.predict import hf_dir, resolve_device


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
