"""``hpcml ckpt``: list, inspect, verify, sign, export, consolidate or convert checkpoints
(docs/checkpoints.md, docs/dcp.md). Here, above :mod:`hpcml.ckpt`, because export and
convert read models (:mod:`hpcml.interop`)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(sub, parser_class: type[argparse.ArgumentParser]) -> None:
    ck = sub.add_parser("ckpt", help="list, inspect, verify, export, consolidate or convert checkpoints")
    cks = ck.add_subparsers(dest="ckpt_command", required=True, parser_class=parser_class)
    p = cks.add_parser("ls", help="checkpoints under a directory")
    p.add_argument("dir")
    p = cks.add_parser("inspect", help="tensors, shapes, dtypes, saved layout, sizes")
    p.add_argument("ckpt", help="a step_N directory, or a directory with 'latest'")
    p.add_argument("--json", action="store_true")
    p = cks.add_parser("verify", help="checksums, and every element of every tensor covered exactly once")
    p.add_argument("ckpt")
    p = cks.add_parser("sign", help="sign a checkpoint you trust with the checkpoint key (after verifying every byte)")
    p.add_argument("ckpt")
    p = cks.add_parser("export", help="consolidated model weights for inference")
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "torch", "hf"],
                   help="hf: a Hugging Face Llama directory OUT (config.json + safetensors)")
    p = cks.add_parser("consolidate", help="one self-contained HDF5 file, no virtual datasets")
    p.add_argument("ckpt")
    p.add_argument("out")
    _add_convert(cks)
    for p in cks.choices.values():
        if p.prog.split()[-1] != "ls":
            p.add_argument("--key", metavar="FILE", help="checkpoint key file (one key per line, the first signs; "
                           "default $HPCML_CKPT_KEY or $HPCML_CKPT_KEY_FILE): "
                           "unsigned or foreign checkpoints are refused")


def _add_convert(cks) -> None:
    p = cks.add_parser("convert", help="to or from torch.distributed.checkpoint (torchtitan's layout and Llama3 "
                                       "names; docs/dcp.md)")
    p.add_argument("src", help="--to dcp: an hpcml checkpoint (step_N, or a directory with 'latest'); "
                               "--to hpcml: a DCP directory")
    p.add_argument("dst", help="--to dcp: a new DCP directory; --to hpcml: the checkpoint root (DST/step_N)")
    p.add_argument("--to", required=True, choices=["dcp", "hpcml"])
    p.add_argument("--model", help="the transformer preset the checkpoint is of (default: the config it carries)")
    p.add_argument("--fused-qkv", action="store_true", help="--to hpcml: write one wqkv weight per layer")
    p.add_argument("--fused-mlp", action="store_true", help="--to hpcml: write one w13 weight per layer")
    p.add_argument("--titan-qkv", choices=["fused", "split"], default="fused",
                   help="--to dcp: optimizer state for torchtitan's FusedQKVLinear (its Llama3 default) or QKVLinear")
    p.add_argument("--schedule-steps", type=int, help="--to hpcml: resume hpcml's own warmup + cosine of this many "
                   "steps (default: go on from torchtitan's learning rate at the saved step)")


def run(args: argparse.Namespace) -> int:
    from hpcml.ckpt import tools

    c = args.ckpt_command
    if getattr(args, "key", None):  # every read below (and the writes of convert) uses this key
        from hpcml.ckpt import keys

        keys.from_file(args.key)  # a bad key file: one line, before anything else
        os.environ.pop(keys.ENV_KEY, None)
        os.environ[keys.ENV_KEY_FILE] = args.key
    if c == "ls":
        rows = tools.list_checkpoints(args.dir)
        for row in rows:
            flags = ("latest " if row["latest"] else "") + ("" if row["complete"] else "INCOMPLETE")
            print(f"{row['path']}  step {row['step']}  {row['bytes'] / 1e6:.1f} MB  {flags}".rstrip())
        if not rows:  # said, not an empty success: a wrong directory looks the same
            print(f"{args.dir}: no checkpoints (no step_N directories, nor a population's member_K ones)",
                  file=sys.stderr)
    elif c == "inspect":
        info = tools.inspect(args.ckpt)
        if args.json:
            print(json.dumps(info))
        else:
            print(f"{info['path']}: step {info['step']}, format {info['format_version']}, "
                  f"hpcml {info['hpcml_version']}, "
                  f"saved by {info['world_size']} ranks on {info['layout']}, {info['total_bytes'] / 1e6:.1f} MB "
                  f"in {len(info['shards'])} shards")
            model = info["extra"].get("model") if isinstance(info["extra"], dict) else None
            if isinstance(model, dict):  # what rebuilds the model (hpcml ckpt export --format hf reads it)
                print(f"model: {model.get('type')} {json.dumps(model.get('config'))}")
            width = max(len(n) for n in info["tensors"]) if info["tensors"] else 4
            for name, t in info["tensors"].items():
                extra = "".join(f"  {k} {t[k]}" for k in ("logical_shape", "fused_widths", "fused_dim", "experts")
                                if k in t)
                print(f"  {name:<{width}}  {str(t['shape']):<14} {t['dtype']:<9} {t['bytes']:>10} B  "
                      f"{t['pieces']} piece(s)  {t['partition']}{extra}")
    elif c == "verify":
        problems = tools.verify(args.ckpt)
        for p in problems:
            print(f"hpcml ckpt verify: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"{args.ckpt}: ok ({tools.signature_note(args.ckpt)})")
    elif c == "sign":
        print(f"{args.ckpt}: signed with key {tools.sign(args.ckpt)}")
    elif c == "export":
        from hpcml.interop import export

        n = export(args.ckpt, args.out, args.format)
        print(f"wrote {args.out} ({n / 1e6:.1f} MB, {args.format})")
    elif c == "consolidate":
        n = tools.consolidate(args.ckpt, args.out)
        print(f"wrote {args.out} ({n / 1e6:.1f} MB)")
    elif c == "convert":
        _ckpt_convert(args)
    return 0


def _ckpt_convert(args: argparse.Namespace) -> None:
    from hpcml.ckpt.tools import out_dir
    from hpcml.interop import torchtitan
    from hpcml.models.transformer import TransformerConfig

    cfg = TransformerConfig.preset(args.model) if args.model else None
    out_dir(args.dst)
    if args.to == "dcp":
        done = torchtitan.to_dcp(args.src, args.dst, cfg, titan_fused_qkv=args.titan_qkv == "fused")
    else:
        done = torchtitan.from_dcp(args.src, args.dst, cfg, fused_qkv=args.fused_qkv, fused_mlp=args.fused_mlp,
                                   schedule_steps=args.schedule_steps)
    print(f"wrote {done.path} ({'torchtitan DCP' if args.to == 'dcp' else 'hpcml'}): step {done.step}, "
          f"{done.tensors} tensors, {done.nbytes / 1e6:.1f} MB in {done.seconds:.1f} s")
