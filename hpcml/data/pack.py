"""``hpcml data pack``: tokenized documents into one HDF5 token file, written in parallel.

Sources, in the order given (the file is the same whatever the number of ranks):

- ``.npy``: one document, a 1-D array of integer token ids (loaded without pickle);
- ``.jsonl``: a document a line, ``{"tokens": [...]}`` (or ``{"text": "..."}`` with a tokenizer);
  ``.jsonl.gz`` the same, gzip-compressed (inflated line by line, bounded);
- any other file: one document of text, with ``tokenizer``: ``"bytes"`` (UTF-8 bytes as
  ids 0-255, end of document 256: nothing to download) or a Hugging Face tokenizer's
  directory or name (``transformers``, local files only).

Every document is followed by the end-of-document token. Under MPI each rank tokenizes a
contiguous share of the sources and writes its share of ``/tokens`` through parallel HDF5;
the file is made under a temporary name and renamed when whole, then its manifest
(:mod:`hpcml.data.tokens`) is written beside it -- a crash leaves no half file under the
final name.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from hpcml import safeio
from hpcml.data.tokens import BLOCK_TOKENS, DTYPES, FORMAT, Manifest, crc32, manifest_path
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int

logger = get_logger(__name__)

#: The largest source file read (a .npy document, a .jsonl file, a text; a .jsonl.gz inflated).
MAX_SOURCE_BYTES = 4 << 30
MAX_LINE_BYTES = 256 << 20
BYTES_VOCAB, BYTES_EOD = 257, 256


class Tokenizer:
    """Text to ids: ``bytes`` (built in) or a Hugging Face tokenizer (local files only)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "bytes":
            self.vocab_size, self.eod, self._tok = BYTES_VOCAB, BYTES_EOD, None
            return
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(f"tokenizer {name!r} needs the transformers package (pip install transformers), or use "
                              f"--tokenizer bytes") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tokenizer {name!r}: {str(e).splitlines()[0]}; expected a tokenizer directory (or a "
                              f"name already in the Hugging Face cache: this reads no network)") from None
        eod = self._tok.eos_token_id
        if eod is None:
            raise ConfigError(f"tokenizer {name!r} has no end-of-sequence token: give --eod ID")
        self.vocab_size, self.eod = len(self._tok), int(eod)

    def encode(self, text: str) -> np.ndarray:
        if self._tok is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
        return np.asarray(self._tok.encode(text, add_special_tokens=False), np.int64)


def holds_ids(path: Path) -> bool:
    """A source of token ids (``.npy``, ``.jsonl``, ``.jsonl.gz``); any other is text."""
    return path.suffix in (".npy", ".jsonl") or path.name.endswith(".jsonl.gz")


def _text_needs_tokenizer(path: Path) -> ConfigError:
    return ConfigError(f"source {path}: text needs a tokenizer (--tokenizer bytes, or a Hugging Face tokenizer "
                       f"directory); .npy and .jsonl sources hold token ids")


def documents(path: Path, tokenizer: Tokenizer | None) -> Iterator[np.ndarray]:
    """The documents of one source file, as int64 token ids."""
    if path.suffix == ".npy":
        fd = _open(path)
        with os.fdopen(fd, "rb") as f:
            try:
                arr = np.load(f, allow_pickle=False)
            except ValueError as e:
                raise ConfigError(f"source {path}: {e}; expected a .npy array of token ids") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(f"source {path}: a {arr.ndim}-D {arr.dtype} array; expected a 1-D array of integer "
                              f"token ids (one document)")
        yield arr.astype(np.int64)
    elif path.suffix == ".jsonl":
        yield from _records(path, safeio.iter_lines(path, MAX_LINE_BYTES), tokenizer)
    elif path.name.endswith(".jsonl.gz"):
        yield from _records(path, _gz_lines(path), tokenizer)
    else:
        if tokenizer is None:
            raise _text_needs_tokenizer(path)
        data = safeio.read_bytes(path, MAX_SOURCE_BYTES, "a text document")
        if data is None:
            raise ConfigError(f"source {path}: no such file")
        yield tokenizer.encode(data.decode("utf-8", errors="replace"))


def _records(path: Path, lines: Iterator[bytes], tokenizer: Tokenizer | None) -> Iterator[np.ndarray]:
    """A JSON-lines source's documents: ``{"tokens": [ids]}`` or ``{"text": ...}`` per line."""
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = safeio.parse_json(line, f"{path} line {k + 1}", max_depth=4)
        except ConfigError as e:
            raise ConfigError(f"source {path} line {k + 1}: {e}") from None
        if isinstance(rec, dict) and isinstance(rec.get("tokens"), list):
            toks = rec["tokens"]
            if not all(type(t) is int for t in toks):
                raise ConfigError(f"source {path} line {k + 1}: tokens must be integers")
            yield np.asarray(toks, np.int64)
        elif isinstance(rec, dict) and isinstance(rec.get("text"), str) and tokenizer is not None:
            yield tokenizer.encode(rec["text"])
        else:
            raise ConfigError(f"source {path} line {k + 1}: expected {{\"tokens\": [ids]}}"
                              + (" or {\"text\": ...}" if tokenizer else " (or {\"text\": ...} with --tokenizer)"))


def _gz_lines(path: Path) -> Iterator[bytes]:
    """The lines of a gzip-compressed source (corpora ship as ``*.jsonl.gz`` shards), bounded as
    they are inflated: a line past MAX_LINE_BYTES or a file past MAX_SOURCE_BYTES inflated is
    refused in one line, before it is held (a small file may inflate a thousandfold)."""
    total = 0
    with os.fdopen(_open(path), "rb") as raw, gzip.GzipFile(fileobj=raw) as f:
        while True:
            try:
                line = f.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as e:
                raise ConfigError(f"source {path}: not a whole gzip file ({e}); expected a .jsonl.gz") from None
            if not line:
                return
            total += len(line)
            if len(line) > MAX_LINE_BYTES or total > MAX_SOURCE_BYTES:
                what = f"a line past {MAX_LINE_BYTES} bytes" if len(line) > MAX_LINE_BYTES else \
                    f"more than {MAX_SOURCE_BYTES} bytes inflated"
                raise ConfigError(f"source {path}: {what}; split it into smaller shards")
            yield line


def _open(path: Path) -> int:
    try:
        return safeio.open_fd(path)
    except FileNotFoundError:
        raise ConfigError(f"source {path}: no such file") from None


def _tokens_of(sources: Sequence[Path], tokenizer: Tokenizer | None, vocab: int, eod: int) -> tuple[np.ndarray, list]:
    """This rank's share, end to end with an end-of-document token after each; the documents' lengths."""
    parts, lengths = [], []
    for path in sources:
        for doc in documents(path, tokenizer):
            if doc.size and (int(doc.min()) < 0 or int(doc.max()) >= vocab):
                bad = int(doc[(doc < 0) | (doc >= vocab)][0])
                raise ConfigError(f"source {path}: token id {bad} is outside the vocabulary of {vocab} (0 to "
                                  f"{vocab - 1})")
            parts += [doc, np.array([eod], np.int64)]
            lengths.append(doc.size + 1)
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), lengths


def pack(out: str | os.PathLike, sources: Sequence[str | os.PathLike], *, tokenizer: str | None = None,
         vocab_size: int | None = None, eod: int | None = None, comm=None) -> Manifest:
    """Pack ``sources`` into ``out`` (``.h5``) and its manifest; every rank of ``comm`` (default:
    MPI's world when there are several ranks) takes part. Errors are raised on every rank."""
    out = Path(out)
    if out.suffix != ".h5":
        raise ConfigError(f"output {out}: expected a name ending in .h5")
    tok = Tokenizer(tokenizer) if tokenizer else None
    vocab = vocab_size if vocab_size is not None else tok.vocab_size if tok else None
    eod = eod if eod is not None else tok.eod if tok else None
    text = next((Path(p) for p in sources if tok is None and not holds_ids(Path(p))), None)
    if text is not None:  # what is missing is the tokenizer, not a vocabulary
        raise _text_needs_tokenizer(text)
    if vocab is None or eod is None:
        raise ConfigError("token ids need their vocabulary: give --vocab-size N and --eod ID (or --tokenizer)")
    if not is_int(vocab) or not 2 <= vocab <= 1 << 32:
        raise ConfigError(f"vocab_size {vocab!r}: expected an int from 2 to 2**32")
    if not is_int(eod) or not 0 <= eod < vocab:
        raise ConfigError(f"eod {eod!r}: expected a token id of the vocabulary (0 to {vocab - 1})")
    paths = [Path(s) for s in sources]
    if not paths:
        raise ConfigError("no sources to pack")
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    lo, hi = len(paths) * rank // size, len(paths) * (rank + 1) // size  # contiguous: the order does not change
    try:
        mine, lengths = _tokens_of(paths[lo:hi], tok, vocab, eod)
        err = None
    except (ConfigError, OSError) as e:
        mine, lengths, err = np.zeros(0, np.int64), [], str(e)
    errors = [e for e in comm.allgather(err) if e]
    if errors:  # on every rank, before any collective write
        raise ConfigError(errors[0])
    counts = comm.allgather((mine.size, len(lengths)))
    n_tokens, n_docs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if n_tokens < 2:
        raise ConfigError(f"the sources hold {n_tokens} tokens: nothing to train on")
    at = sum(c[0] for c in counts[:rank])
    doc_at = sum(c[1] for c in counts[:rank])
    dtype = DTYPES["uint16" if vocab <= 1 << 16 else "uint32"]
    tmp = out.with_name(f".{out.name}.packing")
    _write(tmp, comm, n_tokens, n_docs, dtype, mine, at, lengths, doc_at)
    n_blocks = -(-n_tokens // BLOCK_TOKENS)
    err = None
    if rank == 0:
        try:
            _finish(tmp, out, n_tokens, n_docs, n_blocks, dtype, vocab, eod, tok.name if tok else None, len(paths))
        except (OSError, ConfigError) as e:
            err = f"{out}: {e}"
    err = comm.bcast(err, root=0)
    if err:  # on every rank
        raise ConfigError(err)
    return Manifest.read(out)


def _write(tmp: Path, comm, n_tokens, n_docs, dtype, mine, at, lengths, doc_at) -> None:
    import h5py

    n_blocks = -(-n_tokens // BLOCK_TOKENS)
    parallel = comm.Get_size() > 1
    kw = {"driver": "mpio", "comm": comm} if parallel else {}
    with h5py.File(tmp, "w", **kw) as f:  # contiguous, no filters: read by pread at known offsets
        tokens = f.create_dataset("tokens", (n_tokens,), dtype)
        offsets = f.create_dataset("doc_offsets", (n_docs + 1,), "<i8")
        f.create_dataset("block_crc32", (n_blocks,), "<u4")
        if mine.size:
            tokens[at:at + mine.size] = mine.astype(dtype)
        if lengths:
            offsets[doc_at:doc_at + len(lengths)] = at + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        if comm.Get_rank() == comm.Get_size() - 1:
            offsets[n_docs] = n_tokens
    comm.Barrier()


def _finish(tmp: Path, out: Path, n_tokens, n_docs, n_blocks, dtype, vocab, eod, tok_name, n_sources) -> None:
    """Rank 0: the blocks' CRCs, the attributes, the rename, then the manifest."""
    import h5py

    with h5py.File(tmp, "r+") as f:
        at = f["tokens"].id.get_offset()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            crcs = np.empty(n_blocks, "<u4")
            for b in range(n_blocks):
                n = min(BLOCK_TOKENS, n_tokens - b * BLOCK_TOKENS) * dtype.itemsize
                crcs[b] = crc32(os.pread(fd, n, at + b * BLOCK_TOKENS * dtype.itemsize))
        finally:
            os.close(fd)
        f["block_crc32"][:] = crcs
        f.attrs.update({"format": FORMAT, "vocab_size": vocab, "eod": eod, "n_tokens": n_tokens, "n_docs": n_docs,
                        "block_tokens": BLOCK_TOKENS, "tokenizer": tok_name or ""})
        offs = {name: f[name].id.get_offset() for name in ("tokens", "doc_offsets", "block_crc32")}  # the CRCs'
        # storage exists only now that they are written (serial HDF5 allocates a contiguous dataset late)
    os.replace(tmp, out)
    rec = {"format": FORMAT, "file": out.name, "size": out.stat().st_size, "vocab_size": vocab, "eod": eod,
           "dtype": dtype.name,
           "n_tokens": n_tokens, "n_docs": n_docs, "block_tokens": BLOCK_TOKENS, "tokens_offset": offs["tokens"],
           "doc_offsets_offset": offs["doc_offsets"], "crc_offset": offs["block_crc32"], "tokenizer": tok_name,
           "sources": n_sources}
    safeio.replace(manifest_path(out), json.dumps(rec, indent=1) + "\n")
    logger.info("packed %d documents, %d tokens into %s", n_docs, n_tokens, out)
