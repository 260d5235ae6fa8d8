"""The loss a chunk at a time (``ParallelConfig.loss_chunk``) against torch's whole cross-entropy,
side by side in one run, one process (CPU):

    python benchmarks/loss_chunk.py --json           # ~2 minutes on the 2-core VM
    python benchmarks/loss_chunk.py --quick --json   # a check (~30 s)

A model with a vocabulary 32x its width (Llama 3's ratio is 31), one micro-batch a point. Per
sequence length and mode (whole, chunked): the bytes saved for backward outside the blocks
(:mod:`hpcml.train.memory`: the final norm, the logits' log-softmax or d loss / d h) and the peak
RSS the step added (VmHWM after it against VmRSS before), each point a fresh process so no
allocator cache of another hides its peak; and the logits' own floor, 4 B x vocabulary a
position (what the whole loss must keep). Then, at the longest length, tokens/s of each mode,
their steps alternating in one process (the median of the paired ratios). The last JSON line
carries ``outside_saved_ratio`` and ``peak_rss_ratio`` (chunked over whole, at the longest
length), ``whole_outside_over_logits`` (the whole loss's bytes outside the blocks over the
logits' floor) and ``tokens_per_s_ratio`` (chunked over whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHUNK = 256


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _build(seq: int, chunk: int):
    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import build_llm_trainer

    mc = TransformerConfig.preset("tiny", max_seq_len=seq, vocab_size=32 * 64)
    tc = TrainConfig(steps=1, global_batch=1, micro_batch=1, seq_len=seq, progress=False)
    return build_llm_trainer(mc, tc, ParallelConfig(loss_chunk=chunk)), mc


def point(seq: int, chunk: int) -> dict:
    from hpcml.train import memory

    trainer, mc = _build(seq, chunk)
    x, y = trainer.local_batch(0)
    account = memory.account_of(trainer.model)
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now
        f.write("5")
    rss0 = _status_kib("VmRSS")
    with account:
        trainer.model.forward_backward(x, y, 1)
    peak = (_status_kib("VmHWM") - rss0) * 1024
    counts = account.take()[0]
    trainer.close()
    return {"seq": seq, "chunk": chunk, "saved_bytes": sum(counts.values()),
            "saved_outside_bytes": counts.get(memory.OUTSIDE, 0), "peak_rss_added_bytes": peak,
            "logits_floor_bytes": 4 * mc.padded_vocab * seq}


def timing(seq: int, rounds: int) -> dict:
    import torch

    trainers = {c: _build(seq, c)[0] for c in (0, CHUNK)}
    batches = {c: t.local_batch(0) for c, t in trainers.items()}
    times: dict[int, list[float]] = {c: [] for c in trainers}
    for r in range(rounds + 1):
        for c in ((0, CHUNK) if r % 2 else (CHUNK, 0)):
            t0 = time.perf_counter()
            trainers[c].model.forward_backward(*batches[c], 1)
            dt = time.perf_counter() - t0
            for p in trainers[c].model.parameters():
                p.grad = None
            if r:
                times[c].append(dt)
    ratios = [w / k for w, k in zip(times[0], times[CHUNK])]
    for t in trainers.values():
        t.close()
    del torch
    return {"seq": seq, "rounds": rounds, "tokens_per_s": {"whole": seq / statistics.median(times[0]),
                                                          "chunked": seq / statistics.median(times[CHUNK])},
            "tokens_per_s_ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--point", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(*args.point)))
        return
    seqs = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192]
    rows = []
    for seq in seqs:
        for chunk in (0, CHUNK):
            out = subprocess.run([sys.executable, __file__, "--point", str(seq), str(chunk)], capture_output=True,
                                 text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    t = timing(seqs[-1], 3 if args.quick else 7)
    if args.json:
        print(json.dumps(t), flush=True)
    whole, chunked = (next(r for r in rows if r["seq"] == seqs[-1] and r["chunk"] == c) for c in (0, CHUNK))
    result = {"seq": seqs[-1], "chunk": CHUNK,
              "outside_saved_ratio": chunked["saved_outside_bytes"] / whole["saved_outside_bytes"],
              "saved_ratio": chunked["saved_bytes"] / whole["saved_bytes"],
              "peak_rss_ratio": chunked["peak_rss_added_bytes"] / whole["peak_rss_added_bytes"],
              "whole_outside_over_logits": whole["saved_outside_bytes"] / whole["logits_floor_bytes"],
              "tokens_per_s_ratio": t["tokens_per_s_ratio"], "tokens_per_s_ratio_range": t["ratio_range"]}
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
