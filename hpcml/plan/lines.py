"""A prediction in a line of ``hpcml plan``'s output: a layout's degrees and the options that
tell it from the plain one, then whether it fits, in how much, how fast, and why."""

from __future__ import annotations

import json


def shape_of(lay: dict) -> str:
    """A layout's degrees and options in a line (a layouts line's and a search's alike)."""
    dp = lay["gpus"] // (lay["tp"] * lay["pp"] * lay["cp"])
    return (f"tp {lay['tp']} cp {lay['cp']} pp {lay['pp']} dp {dp}" + (f" ep {lay['ep']}" if lay["ep"] > 1 else "")
            + f" zero {lay['zero']} mb {lay['micro_batch']} recompute {lay['recompute']}"
            + (" sp" if lay["sequence_parallel"] else "") + (f" {lay['schedule']}" if lay["pp"] > 1 else "")
            + (f" x{lay['stages_per_rank']}" if lay["pp"] > 1 and lay["schedule"] == "interleaved1f1b" else "")
            + (f" fpdt {lay['fpdt_chunk']}" if lay["fpdt_chunk"] else "")
            + "".join(f" {k.replace('_', '-')} {json.dumps(lay[k]).strip(chr(34))}" for k, plain in _SHOWN
                      if lay.get(k) not in plain)
            + (f" cp-kind {lay['cp_kind']}" if lay["cp"] > 1 and lay["cp_kind"] != "ulysses" else ""))


_SHOWN = (("grad_sync", (None, "microbatch")), ("precision", ("bf16",)),
          ("reduce_dtype", ("fp32",)), ("activation", (None,)), ("norm", (None,)), ("bias", (None,)),
          ("positions", (None,)), ("loss", ("eager",)), ("attention", ("flash",)),
          ("compile", (False, None)))
"""A layout's options a line names where they are not the plain ones: two lines never read alike."""


def line(p) -> str:
    r = p.to_dict()
    return verdict(shape_of(r["layout"]), r)


def verdict(shape: str, r: dict) -> str:
    """A prediction in a line: does it fit, in how much, how fast, and why."""
    if not r["memory_gib"]:
        return f"{shape}: {r['why']}"
    return (f"{shape}: {'fits' if r['fits'] else 'OOM '} {r['memory_gib']['total']:.1f} GiB, step {r['step_s']:.3g} s, "
            f"{r['tokens_per_s']:.4g} tok/s, MFU {r['mfu']:.1%}"
            f"{' of the bf16 peak' if r['layout'].get('precision') == 'fp8' else ''} -- {r['why']}")
