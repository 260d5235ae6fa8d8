"""What document masking (and ALiBi's biases) cost a training step, against plain causal
attention and against the documents run one by one.

    python benchmarks/doc_mask.py --json                  # sequences of 1024, the shipped corpus
    python benchmarks/doc_mask.py --json --seq-len 2048 --repeat 5

The shipped test corpus (tests/data/corpus: 4,017 paragraphs, ~243 tokens each, UTF-8 bytes)
is packed into a token file; one process trains a small decoder on ``--batch`` of its
sequences, forward and backward, in three ways on the same batch, alternating, best of
``--repeat``:

- ``causal``: plain causal attention over the packed sequence (nanoGPT's, Megatron's default):
  the peer, and the most that masking could give back;
- ``masked``: hpcml's document masking (``doc_ids``: a boolean mask built once per forward);
- ``alibi``: the same model with ALiBi positions (a float mask of per-head biases built once
  per forward, in place of rotary positions and SDPA's causal flag);
- ``alone``: every document through the model by itself, no mask (the test reference): the
  same result with no attention across documents computed at all -- the limit a block-sparse
  kernel (FlexAttention) approaches, where the dense mask computes every pair and drops it.

Last line: ``masked_over_causal`` (step time: the mask's cost over plain attention),
``alibi_over_causal`` and
``alone_over_masked`` (< 1: what skipping the masked blocks could save). On GPUs the mask takes
SDPA's memory-efficient kernel instead of flash: not measured here (no GPU lent).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    from mpi4py import MPI

    from hpcml.data import TokenDataset, pack
    from hpcml.models.transformer import Transformer, TransformerConfig, cross_entropy
    from hpcml.parallel.docmask import document_ids
    from tests.reference import document_by_document_loss

    torch.set_num_threads(2)
    shards = sorted((ROOT / "tests" / "data" / "corpus").glob("*.jsonl.gz"))
    with tempfile.TemporaryDirectory() as d:
        m = pack(Path(d) / "c.h5", shards, tokenizer="bytes", comm=MPI.COMM_SELF)
        data = TokenDataset(m.path, seq_len=args.seq_len, seed=0)
        tokens = data.global_batch(0, args.batch)
    x, y = tokens[:, :-1], tokens[:, 1:]
    docs = document_ids(x, m.eod)
    cfg = TransformerConfig(vocab_size=384, dim=256, n_layers=4, n_heads=8, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = Transformer(cfg)
    alibi = Transformer(cfg.with_blocks(positions="alibi"))
    alibi.load_state_dict(model.state_dict())

    def step(kind: str) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if kind == "causal":
            loss = cross_entropy(model(x), y)
        elif kind == "alibi":
            alibi.zero_grad(set_to_none=True)
            loss = cross_entropy(alibi(x), y)
        elif kind == "masked":
            loss = cross_entropy(model(x, doc_ids=docs), y)
        else:
            loss = document_by_document_loss(model, x, y, m.eod)
        loss.backward()
        return time.perf_counter() - t0

    kinds = ("causal", "masked", "alibi", "alone")
    for k in kinds:  # warm-up
        step(k)
    best = {k: float("inf") for k in kinds}
    for _ in range(args.repeat):
        for k in kinds:
            best[k] = min(best[k], step(k))
    n = args.batch * args.seq_len
    out = {"seq_len": args.seq_len, "batch": args.batch, "documents_per_sequence":
           round(float((docs[:, -1] + 1).float().mean()), 2),
           **{f"{k}_tokens_per_s": round(n / best[k]) for k in kinds},
           "masked_over_causal": round(best["masked"] / best["causal"], 3),
           "alibi_over_causal": round(best["alibi"] / best["causal"], 3),
           "alone_over_masked": round(best["alone"] / best["masked"], 3)}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
