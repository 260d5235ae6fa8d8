"""``hpcml plan``: one layout, a file of layouts, or a search, as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.plan import population
from hpcml.plan.devices import DEVICES
from hpcml.plan.lines import line, shape_of, verdict
from hpcml.plan.predict import LINE_DEPTH, numbered, predict, predict_lines, resolve_device
from hpcml.plan.candidate import (ACTIVATIONS, ATTENTION, CP_KINDS, FRAMEWORKS, GRAD_SYNCS, LOSSES, MASTER_WEIGHTS,
                              NORMS, PIPELINE_SPLITS, POSITIONS, PRECISIONS, RECOMPUTE, PlanLayout)

MAX_LAYOUT_FILE = 64 << 20
MAX_LAYOUT_LINES = 20_000
_LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "zero", "micro_batch", "recompute", "sequence_parallel", "schedule")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of a layout before the allocation, or search "
                                    "for the best (docs/plan.md)")
    p.add_argument("--model", help="preset name, or a Hugging Face config.json (or its directory), or hpcml's")
    p.add_argument("--gpus", type=int, help="devices (training ranks)")
    # (no ``choices``: argparse then blamed the value of an unknown flag -- ``--dp-replicate 7`` -- as an
    # invalid action; it now names the flag, and :func:`run` an action that is not one)
    p.add_argument("action", nargs="?", help="calibrate RUNS...: fit the time model on "
                   "runs measured on your machine and write a device file (--out) for --device-file")
    p.add_argument("runs", nargs="*", metavar="RUNS", help="calibrate: JSON-lines files (a layout and its step_s or "
                   "tokens_per_s a line) or llm_pretrain.py run directories")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", choices=sorted(DEVICES), help="device kind")
    p.add_argument("--site", help="a site of site_configs (its device and node facts); with --gpu or --device-file, "
                   "the site the emitted job is for (a machine the planner has no device of: slurm-local)")
    dev.add_argument("--device-file", metavar="FILE", help="a device file written by 'hpcml plan calibrate'")
    dev.add_argument("--cpu", action="store_true", help="calibrate: the runs ran on this machine's CPU (measured "
                     "first, ~15 s)")
    p.add_argument("--out", metavar="FILE", help="calibrate: where to write the device file")
    p.add_argument("--name", help="calibrate: the device's name (default: the --out file's stem)")
    p.add_argument("--gpus-per-node", type=int, help="devices per node, when not the device's default (e.g. 4 for a "
                   "4-GPU H100 node): tp stays within a node")
    p.add_argument("--node-injection-gbps", type=float, help="the node's bandwidth off the node in GB/s (bytes), "
                   "its network interfaces together, as site files give it (e.g. 50 for 4 x 100 Gb/s), when not "
                   "the device's or site's")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), help="the data-parallel gradient reduction's dtype "
                   "(default fp32; bf16 halves its bytes)")
    p.add_argument("--grad-sync", choices=GRAD_SYNCS, help="FSDP under gradient accumulation: reduce-scatter each "
                   "micro-batch's gradients (default) or once a step (hpcml: every rank holds them unsharded)")
    p.add_argument("--loss-chunk", type=int, metavar="N", help="hpcml: the output layer and loss N positions at a "
                   "time (no whole logits: llm_pretrain.py --loss-chunk)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch", type=int, help="sequences per step")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--cp", type=int)
    p.add_argument("--ep", type=int)
    z = p.add_mutually_exclusive_group()
    z.add_argument("--fsdp", action="store_true", help="ZeRO-3 (FSDP2)")
    z.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--recompute", choices=RECOMPUTE)
    p.add_argument("--sequence-parallel", action="store_true", default=None, help="Megatron-SP over tp: norms, "
                   "dropout and residuals split over the sequence (hpcml's trainer: without cp and experts)")
    p.add_argument("--attention", choices=ATTENTION, default=None, help="flash (the framework's own fused kernel: "
                   "cuDNN's under Megatron on Hopper), flash-attn (FlashAttention-2's: NVTE_FUSED_ATTN=0) or eager")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved1f1b"))
    p.add_argument("--stages-per-rank", type=int, default=None, metavar="V", help="interleaved1f1b: pipeline "
                   "stages a rank (Megatron's --virtual-pipeline-model-parallel-size; default 2)")
    p.add_argument("--pipeline-split", choices=PIPELINE_SPLITS, default=None, help="blocks (the blocks alone) or "
                   "ends (the embedding and the output a block each: torchtitan's default, Megatron's "
                   "--account-for-embedding/loss-in-pipeline-split)")
    p.add_argument("--cp-kind", choices=CP_KINDS, default=None, help="cp: ulysses (heads divisible by cp) or "
                   "allgather (keys and values gathered: any number of kv heads)")
    p.add_argument("--fpdt-chunk", type=int, default=None, metavar="N",
                   help="FPDT on cp: chunks of N positions per rank (kept by a search, which then tries only the "
                        "cp degrees N divides)")
    p.add_argument("--precision", choices=PRECISIONS, default=None)
    p.add_argument("--activation", choices=ACTIVATIONS, default=None, help="the blocks' MLP, where it differs from "
                   "the model's config: swiglu or gelu (its width kept)")
    p.add_argument("--norm", choices=NORMS, default=None, help="the blocks' norm: rmsnorm or layernorm")
    p.add_argument("--positions", choices=POSITIONS, default=None, help="rope, learned (a table added to the "
                   "embedding) or alibi (linear biases of the scores)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases on every projection and norm (GPT's, MPT's)")
    p.add_argument("--loss", choices=LOSSES, default=None, help="eager (default: the fp32 log-softmax kept) or fused "
                   "(a kernel that writes the gradient over the logits: flash-attn's, Liger's, llm-foundry's)")
    p.add_argument("--framework", choices=FRAMEWORKS, default=None,
                   help="whose implementation (hpcml; megatron, torchtitan or deepspeed -- Megatron-DeepSpeed -- "
                        "to compare)")
    p.add_argument("--master-weights", choices=MASTER_WEIGHTS, default=None, help="megatron: fp32 master weights "
                   "(default) or remainder (NeMo's Apex distributed Adam: 16-bit remainders of the bf16 weights; "
                   "zero 0-1, bf16 or fp8 matmuls, not with --fp8-params)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torchtitan: each block compiled by torch.compile (its elementwise work fused)")
    p.add_argument("--fp8-params", action=argparse.BooleanOptionalAction, default=None,
                   help="megatron, precision fp8: weights held in FP8 alone (Transformer Engine, NeMo's fp8_params)")
    p.add_argument("--layouts", metavar="FILE", help="JSON lines, one layout each ('-': standard input); the "
                   "options above fill keys a line lacks")
    p.add_argument("--top", type=int, default=None, help="search: how many layouts to print (default 5)")
    p.add_argument("--emit", choices=("args", "job"), help="print the chosen layout as llm_pretrain.py arguments, "
                   "or as the 'hpcml job' command that submits it (needs --site)")
    p.add_argument("--walltime", help="with --emit job (default 01:00:00)")
    p.add_argument("--steps", type=int, help="with --emit job (required): optimizer steps of the whole run")
    p.add_argument("--account", help="with --emit job: the allocation to charge (default $HPCML_ACCOUNT; required "
                   "where the site requires one)")
    p.add_argument("--ckpt-dir", help="with --emit job (default: checkpoints)")
    p.add_argument("--ckpt-every", type=int, help="with --emit job: steps between saves (default: about every 10 "
                   "minutes of the predicted step time)")
    p.add_argument("--data", metavar="FILE.h5", help="with --emit: the token file to train on (hpcml data pack)")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of device memory a chosen layout leaves "
                   "free (default 0.10: allocator fragmentation and what the model misses); 0 to fill it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--pop", type=int, help="a population of POP members (docs/populations.md): each member is "
                   "planned on --gpus / POP devices, and an exchange between members priced")
    p.add_argument("--exchange-every", type=int, metavar="STEPS", help="with --pop: steps between tournaments or PBT "
                   "rounds, to price the exchanges against the steps")
    p.add_argument("--member", action="append", metavar="JSON", help="with --pop: one member's layout keys over the "
                   "others (e.g. '{\"tp\": 4}'), once a member: members of different layouts")
    p.add_argument("--scratch-gbps", type=float, help="with --member: the file-system rate (GB/s) the job's members "
                   "swap through checkpoints at")


def _given(args: argparse.Namespace) -> dict:
    d = {k: getattr(args, k) for k in ("model", "gpus", "gpu", "site", "gpus_per_node", "node_injection_gbps",
                                       "seq_len", "global_batch", "reduce_dtype", "tp", "pp", "cp", "ep", "zero",
                                       "micro_batch", "recompute", "sequence_parallel", "attention",
                                       "schedule", "precision", "framework", "fpdt_chunk", "activation", "norm",
                                       "bias", "positions", "loss", "cp_kind", "master_weights", "fp8_params",
                                       "stages_per_rank", "pipeline_split", "grad_sync", "loss_chunk", "compile")}
    if args.fsdp:
        d["zero"] = 3
    return {k: v for k, v in d.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    given = _given(args)
    if not 0 <= args.headroom < 0.9:
        raise ConfigError(f"--headroom {args.headroom:g}: expected a fraction of device memory in [0, 0.9)")
    if args.action == "calibrate":
        return _run_calibrate(args, given)
    if args.action is not None:
        raise ConfigError(f"hpcml plan {args.action[:80]!r}: invalid choice of action: expected calibrate (hpcml "
                          f"plan calibrate RUNS...), or none (a layout's flags, --layouts or a search)")
    args.job_site = None
    if args.site and (args.gpu or args.device_file):  # the device prices it, the site is where the job goes
        args.job_site = given.pop("site")
        from hpcml.ensemble.site import load_site

        load_site(args.job_site)  # an unknown site: one line now
    if args.runs or args.out or args.name or args.cpu:
        raise ConfigError("RUNS, --out, --name and --cpu belong to 'hpcml plan calibrate'")
    job_only = [f for f, v in (("--walltime", args.walltime), ("--account", args.account),
                               ("--ckpt-dir", args.ckpt_dir), ("--ckpt-every", args.ckpt_every)) if v is not None]
    if job_only and args.emit != "job":
        verb = "shape" if len(job_only) > 1 else "shapes"
        raise ConfigError(f"{', '.join(job_only)} {verb} the job --emit job prints; "
                          f"{'--emit args prints' if args.emit else 'without --emit, hpcml plan prints'} no job: "
                          f"add --emit job (and --site), or drop them")
    if args.device_file:
        from hpcml.plan import devfile

        given["gpu"] = devfile.load(args.device_file).name
    _note_unfitted(given)
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top {args.top}: expected at least 1")
    pop = _population(args, given)
    if args.member:
        return _run_members(args, given)
    if args.layouts:
        if args.emit or args.top is not None:
            raise ConfigError("--layouts predicts every line: --emit and --top apply to one layout or a search")
        return _run_file(args, given)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "gpus", "seq_len", "global_batch") if k not in given]
    missing += [] if "gpu" in given or "site" in given else ["--gpu, --site or --device-file"]
    if missing:
        raise ConfigError(f"hpcml plan needs {', '.join(missing)}")
    searching = not any(k in given for k in _LAYOUT_KEYS) and not args.fsdp
    if searching:
        return _run_search(args, PlanLayout(**given, degrees_checked=False), pop,
                           cp_kinds=None if "cp_kind" in given else CP_KINDS)
    lay = PlanLayout(**given)
    chosen = "micro_batch" not in given
    if chosen:  # the other degrees given: the micro-batch a search would take for them
        from hpcml.plan.search import fastest_micro_batch

        lay = fastest_micro_batch(lay, headroom=args.headroom)
    p = predict(lay)
    priced = pop(p) if pop else None
    if args.emit:
        if not p.fits:
            raise ConfigError(f"not emitting a layout that does not run: {p.why}")
        cap = resolve_device(lay).memory_gib
        if p.memory_gib["total"] > cap * (1 - args.headroom):
            raise ConfigError(f"not emitting a layout this close to the device's memory: it needs "
                              f"{p.memory_gib['total']:.1f} of {cap:.1f} GiB, more than {1 - args.headroom:.0%} "
                              f"(--headroom {args.headroom:g}); lower the micro-batch or recompute, or --headroom 0")
        return _emit(args, lay, p.step_s)
    if args.json:
        print(json.dumps({**p.to_dict(), **({"population": priced.to_dict()} if priced else {}),
                          "micro_batch_chosen": chosen}))
    else:
        note = "" if not chosen or not p.memory_gib else (  # a layout the model's plan refuses has no micro-batch
            f" (micro-batch {lay.micro_batch}: the fastest that fits; --micro-batch sets it)" if p.fits
            else " (no micro-batch fits: shown at 1)")
        print(line(p) + note + (f"\n{population.line(priced)}" if priced else ""))
    return 0 if p.fits else 1


def _note_unfitted(given: dict) -> None:
    """One line on stderr when the device the options name has no fitted constants."""
    from hpcml.plan import calibration
    from hpcml.plan.devices import device, site_device

    if "site" in given or given.get("gpu") in DEVICES:
        note = calibration.unfitted(site_device(given["site"]) if "site" in given else device(given["gpu"]))
        if note:
            print(f"hpcml plan: note: {note}", file=sys.stderr)


def _population(args: argparse.Namespace, given: dict):
    """With ``--pop``: each member planned on its share of ``--gpus`` (``given`` changed), and the
    function pricing a member's prediction; else None (``--exchange-every`` alone refused)."""
    if args.pop is None:
        if args.exchange_every is not None:
            raise ConfigError("--exchange-every prices a population's exchanges: give --pop too")
        if args.member or args.scratch_gbps is not None:
            raise ConfigError(f"{'--member' if args.member else '--scratch-gbps'} prices a population: give --pop too")
        return None
    if args.layouts:
        raise ConfigError(f"--pop {args.pop} plans one member's layout and prices the exchanges: not with "
                          f"--layouts (plan the member on --gpus / POP devices)")
    if "gpus" not in given:
        raise ConfigError("--pop needs --gpus: the devices of the whole population")
    per = population.member_gpus(given["gpus"], args.pop)
    given["gpus"] = per

    def priced(p):
        return population.price(p.memory_gib, p.step_s, resolve_device(p.layout), members=args.pop,
                                gpus_per_member=per, every=args.exchange_every) if p.memory_gib else None
    return priced


def _run_members(args: argparse.Namespace, given: dict) -> int:
    """``--pop K --member JSON`` x K: each member's layout predicted on its share of the devices,
    the population priced at the slowest member's step, its swaps through checkpoints."""
    if len(args.member) != args.pop:
        raise ConfigError(f"--member given {len(args.member)} times for --pop {args.pop}: one layout a member")
    from hpcml.plan.search import fastest_micro_batch

    members = []
    for i, text in enumerate(args.member):
        try:
            d = safeio.parse_json(text, "--member", max_depth=LINE_DEPTH, unique=True)
        except ValueError as e:
            raise ConfigError(f"--member {text[:60]!r}: {str(e).removeprefix('--member: ')}; expected an object such "
                              f"as '{{\"tp\": 4}}'") from None
        fixed = sorted({"model", "gpus", "gpu", "site", "gpus_per_node", "node_injection_gbps"} & set(d)) \
            if isinstance(d, dict) else []
        if fixed:
            raise ConfigError(f"--member {i} sets {fixed}: a member's layout keys only (the model, the devices and "
                              f"their nodes are the population's: --model, --gpus / --pop)")
        try:
            lay = PlanLayout.from_dict(d, **given)
            if "micro_batch" not in d and "micro_batch" not in given:  # as one layout alone: the fastest
                lay = fastest_micro_batch(lay, headroom=args.headroom)
            members.append(predict(lay))
        except ConfigError as e:
            raise ConfigError(f"--member {i} ({text[:60]}): {e}") from None
    from hpcml.plan.predict import load_model

    mp = population.price_mixed([p.step_s for p in members], load_model(members[0].layout.model),
                                gpus_per_member=given["gpus"], every=args.exchange_every,
                                scratch_gbps=args.scratch_gbps)
    if args.emit:
        bad = [f"member {i}: {p.why}" for i, p in enumerate(members) if not p.fits]
        if bad:
            raise ConfigError(f"not emitting a population whose members do not all run: {'; '.join(bad)}")
        return _emit(args, [p.layout for p in members], max(p.step_s for p in members))
    if args.json:
        print(json.dumps({"members": [p.to_dict() for p in members], "population": mp.to_dict()}))
    else:
        print("\n".join(f"member {i}: {line(p)}" for i, p in enumerate(members)) + "\n" + population.mixed_line(mp))
    return 0 if all(p.fits for p in members) else 1


def _run_calibrate(args: argparse.Namespace, given: dict) -> int:
    import re

    from hpcml.plan import calibrate, devfile

    if not args.runs:
        raise ConfigError("hpcml plan calibrate needs RUNS: JSON-lines files of measured layouts or run directories")
    if not args.out:
        raise ConfigError("hpcml plan calibrate needs --out FILE: where to write the calibrated device file")
    name = args.name or re.sub(r"[^A-Za-z0-9._-]", "-", Path(args.out).stem).lstrip("._-")[:64] or "calibrated"
    if not devfile.valid_name(name):
        raise ConfigError(f"--name {name[:80]!r}: expected 1-64 letters, digits, '.', '_' or '-', not a built-in "
                          f"device's name (it would stand for that device in every later plan)")
    base = calibrate.base_of(given.pop("gpu", None), given.pop("site", None), args.device_file, args.cpu)
    net = given.pop("node_injection_gbps", None)  # the device file's, not each run's
    runs = calibrate.read_runs(args.runs, given)
    base = calibrate.with_network(base, net, runs)
    df, report = calibrate.calibrate(runs, base, name)
    devfile.write(df, args.out)
    print(json.dumps({"device_file": args.out, **report}) if args.json
          else calibrate.summary(report) + f"\nwrote {args.out}: hpcml plan --device-file {args.out} ...")
    return 0


def _run_file(args: argparse.Namespace, given: dict) -> int:
    if args.layouts == "-":
        text = sys.stdin.read(MAX_LAYOUT_FILE + 1)
        if len(text) > MAX_LAYOUT_FILE:
            raise ConfigError(f"--layouts -: more than {MAX_LAYOUT_FILE} bytes")
    else:
        from hpcml import safeio

        try:
            text = safeio.read_text(Path(args.layouts), MAX_LAYOUT_FILE, "JSON lines of layouts")
        except OSError as e:
            raise ConfigError(f"--layouts {args.layouts}: {e.strerror}") from None
        if text is None:
            raise ConfigError(f"--layouts {args.layouts}: no such file")
    lines = text.splitlines()
    if len(lines) > MAX_LAYOUT_LINES:
        raise ConfigError(f"--layouts {args.layouts}: {len(lines)} lines, at most {MAX_LAYOUT_LINES} (a prediction "
                          f"costs ~1 ms: split the file, or let `hpcml plan` search: give no tp, pp, cp, ep)")
    results = predict_lines(lines, given)
    if not results:  # nothing predicted is no success
        raise ConfigError(f"--layouts {args.layouts}: no layout in it (one JSON object a line)")
    for (n, _), r in zip(numbered(lines), results, strict=True):  # predict_lines answers these, in order
        err = r.get("step_error")
        vs = f" (measured {r['measured_step_s']:.4g} s: {err:+.1%})" if err is not None else ""
        print(json.dumps(r) if args.json else f"line {r['line']}: {r['error']}" if "error" in r
              else f"line {n}: {verdict(shape_of(r['layout']), r)}{vs}")
    return 1 if any("error" in r for r in results) else 0


def _run_search(args: argparse.Namespace, base: PlanLayout, pop=None, cp_kinds: tuple[str, ...] | None = None) -> int:
    from hpcml.plan.forked import usable_cores
    from hpcml.plan.search import search

    r = search(base, top=args.top or 5, headroom=args.headroom, cp_kinds=cp_kinds, workers=usable_cores())
    if not r.candidates:
        raise ConfigError(f"no layout of {base.gpus} devices exists for this model: no tp x pp x cp x dp equals "
                          f"{base.gpus} with dp dividing the global batch ({base.global_batch}) and the degrees "
                          f"within the model's heads, layers and sequence")
    if not r.best:
        raise ConfigError(f"no layout of {r.candidates} fits: {r.refused} refused by the model's plan, the rest out of "
                          f"memory on {base.gpus} x {base.gpu or base.site}"
                          + (f" with {args.headroom:.0%} of it kept free (--headroom)" if args.headroom else ""))
    if args.emit:
        return _emit(args, r.best[0].layout, r.best[0].step_s)
    priced = pop(r.best[0]) if pop else None
    if args.json:
        print(json.dumps({"candidates": r.candidates, "fitting": r.fitting, "refused": r.refused,
                          "unpriced": r.unpriced,
                          "best": [p.to_dict() for p in r.best],
                          **({"population": priced.to_dict()} if priced else {})}))
    else:
        keep = f" leaving {args.headroom:.0%} of memory free" if args.headroom else ""
        slow = f" ({r.unpriced} more not priced: no faster than these)" if r.unpriced else ""
        print(f"{r.candidates} layouts: {r.refused} refused by the model's plan, {r.fitting} fit{keep}{slow}; "
              f"the best:")
        for p in r.best:
            print(line(p))
        if priced:
            print(f"with the best, {population.line(priced)}")
    return 0


def _emit(args: argparse.Namespace, lay: PlanLayout | list[PlanLayout], step_s: float | None = None) -> int:
    """Print llm_pretrain.py's arguments (or the job submitting it) for ``lay``, or for a
    population whose members have the layouts of the list ``lay``."""
    import shlex

    from hpcml.plan.emit import emit, emit_job, emit_members

    members = args.pop or 1
    every = ["--tournament-every", str(args.exchange_every)] if args.exchange_every else []
    if isinstance(lay, list):
        run, lay, pop = emit_members(lay), lay[0], every  # --member sets --pop; the first member's devices
    else:
        run, pop = emit(lay), ["--pop", str(members), *every] if members > 1 else []
    if args.emit == "job":
        print(emit_job(lay, args.walltime or "01:00:00", steps=args.steps, account=args.account,
                       ckpt_dir=args.ckpt_dir or "checkpoints", ckpt_every=args.ckpt_every, data=args.data,
                       step_s=step_s, site=args.job_site, members=members, population=pop, run=run))
    else:
        extra = [*(["--steps", str(args.steps)] if args.steps else []), *(["--data", args.data] if args.data else [])]
        print(shlex.join([*run, *pop, *extra]))
    return 0
