"""``hpcml data``: ``pack`` documents into a token file, ``info`` on one (docs/data.md)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub, parser_class: type[argparse.ArgumentParser]) -> None:
    da = sub.add_parser("data", help="pack tokenized documents into an HDF5 token file; describe or verify one")
    das = da.add_subparsers(dest="data_command", required=True, parser_class=parser_class)
    p = das.add_parser("pack", help="documents (.npy token ids, .jsonl, or text with --tokenizer) into OUT.h5 and "
                                    "its manifest, in parallel under mpiexec (docs/data.md)")
    p.add_argument("out", help="the token file to write (.h5); its manifest goes beside it (.h5.json)")
    p.add_argument("sources", nargs="+", help="source files, in order")
    p.add_argument("--tokenizer", help="'bytes' (UTF-8 bytes, built in) or a Hugging Face tokenizer directory")
    p.add_argument("--vocab-size", type=int, help="ids of the vocabulary (with token-id sources)")
    p.add_argument("--eod", type=int, help="the end-of-document token id (with token-id sources)")
    p = das.add_parser("info", help="what a token file holds; --verify checks every block's CRC-32")
    p.add_argument("file", help="a token file (.h5) or its manifest (.h5.json)")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from hpcml import env
    from hpcml.data import TokenDataset, pack

    if args.data_command == "pack":
        m = pack(args.out, args.sources, tokenizer=args.tokenizer, vocab_size=args.vocab_size, eod=args.eod)
        if env.detect().rank == 0:
            print(f"{m.path}: {m.n_docs} documents, {m.n_tokens} tokens ({m.dtype.name}, vocabulary {m.vocab_size}, "
                  f"end of document {m.eod})")
        return 0
    ds = TokenDataset(args.file, seq_len=1)
    try:
        m = ds.m
        if args.verify:
            ds.verify()  # every block's CRC, every id in the vocabulary
        rec = {"file": str(m.path), "documents": m.n_docs, "tokens": m.n_tokens, "dtype": m.dtype.name,
               "vocab_size": m.vocab_size, "eod": m.eod, "bytes": m.size, "verified": bool(args.verify)}
    finally:
        ds.close()
    print(json.dumps(rec) if args.json else "\n".join(f"{k}: {v}" for k, v in rec.items()))
    return 0
