"""A tokenized corpus as one HDF5 file, read as untrusted input: sequences by partial reads.

The file (``hpcml-tokens/1``, written by :mod:`hpcml.data.pack`) holds the documents'
tokens end to end, each followed by the end-of-document token, in one contiguous,
unfiltered dataset ``/tokens`` (uint16 or uint32), with ``/doc_offsets`` (where each
document starts, int64) and ``/block_crc32`` (a CRC-32 of every ``block_tokens`` tokens).
Any HDF5 tool reads it (``h5dump -d /tokens``). Beside it, ``NAME.h5.json`` -- the
manifest -- says where those datasets lie in the file.

hpcml never hands the file to libhdf5 to read it: a corpus on a shared file system may have
been put there by someone else, and a C library parsing hostile metadata is a risk no
training job should take. :class:`TokenDataset` reads the manifest (bounded, depth-checked
JSON), opens the data file as a regular file beside it (no link, no FIFO), checks every
offset and length against the file's size, and reads sequences with ``pread``, each block
checked against its CRC the first time it is read; a token id outside the vocabulary is
refused naming the file and the position.

**Which sequence a step reads** depends only on (seed, step, sequence length), never on the
layout: the corpus is cut into ``(n_tokens - 1) // seq_len`` windows of ``seq_len + 1``
tokens (inputs and their next-token targets); epoch ``e`` visits them in a permutation
seeded by (seed, e); global sample ``g = step x global_batch + i`` is window
``perm_e[g mod W]`` of epoch ``g div W``. A run resumed at step ``s`` on any dp size reads
exactly what the uninterrupted run would have read next: the position rides in the
checkpoint as the step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.numeric import is_int

FORMAT = "hpcml-tokens/1"
MANIFEST_SUFFIX = ".json"
#: Tokens per checked block (HDF5 has no chunks here: the dataset is contiguous): a sequence
#: of 4096 tokens reads the 2 or 3 blocks that hold it.
BLOCK_TOKENS = 1 << 10
MAX_MANIFEST_BYTES = 1 << 20
#: CRCs read from the table at once.
CRC_CHUNK = 1 << 14
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover -- isal is a dependency; zlib is the fallback
    from zlib import crc32


class DataError(ConfigError):
    """A token file that is not what its manifest says, or holds what training cannot take."""


def manifest_path(path: str | os.PathLike) -> Path:
    """``NAME.h5`` -> ``NAME.h5.json``; a manifest's own path stays as it is."""
    p = Path(path)
    return p if p.name.endswith(".h5" + MANIFEST_SUFFIX) else p.with_name(p.name + MANIFEST_SUFFIX)


@dataclass(frozen=True)
class Manifest:
    """Where a token file's datasets lie, checked against the file before any read."""

    path: Path
    """The data file (``.h5``), beside its manifest."""
    size: int
    vocab_size: int
    eod: int
    dtype: np.dtype
    n_tokens: int
    n_docs: int
    block_tokens: int
    tokens_offset: int
    doc_offsets_offset: int
    crc_offset: int

    @property
    def n_blocks(self) -> int:
        return -(-self.n_tokens // self.block_tokens)

    @classmethod
    def read(cls, path: str | os.PathLike) -> Manifest:
        where = manifest_path(path)
        try:
            rec = safeio.read_json(where, MAX_MANIFEST_BYTES, max_depth=4)
        except ConfigError as e:
            raise DataError(f"token manifest {where}: {e}") from None
        if rec is None:
            given = Path(path)
            what = ("no such file" if not given.exists() and not given.is_symlink() else
                    "a directory" if given.is_dir() else f"no manifest {where.name} beside it: not a packed token file")
            raise DataError(f"token data {given}: {what}; expected a token file written by 'hpcml data pack OUT.h5 "
                            f"SOURCES...' (OUT.h5 with OUT.h5.json beside it; text sources with --tokenizer bytes or "
                            f"a Hugging Face tokenizer directory)")
        if rec.get("format") != FORMAT:
            raise DataError(f"token manifest {where}: format {rec.get('format')!r}, expected {FORMAT!r}")
        name = rec.get("file")
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
            raise DataError(f"token manifest {where}: file {name!r}: expected a file name beside the manifest")
        ints = {}
        for k in ("size", "vocab_size", "eod", "n_tokens", "n_docs", "block_tokens", "tokens_offset",
                  "doc_offsets_offset", "crc_offset"):
            v = rec.get(k)
            if not is_int(v) or not 0 <= v < 1 << 62:
                raise DataError(f"token manifest {where}: {k}={v!r}: expected an int >= 0")
            ints[k] = v
        dtype = DTYPES.get(rec.get("dtype"))
        if dtype is None:
            raise DataError(f"token manifest {where}: dtype {rec.get('dtype')!r}: expected one of {sorted(DTYPES)}")
        m = cls(path=where.with_name(name), dtype=dtype, **ints)
        m._check(where)
        return m

    def _check(self, where: Path) -> None:
        bad = None
        if not 2 <= self.vocab_size <= 1 << (8 * self.dtype.itemsize):
            bad = f"vocab_size {self.vocab_size} does not fit {self.dtype.name} (2 to {1 << (8 * self.dtype.itemsize)})"
        elif not self.eod < self.vocab_size:
            bad = f"eod {self.eod} is not a token id of the vocabulary ({self.vocab_size})"
        elif self.n_tokens < 2 or self.n_docs < 1:
            bad = f"{self.n_tokens} tokens in {self.n_docs} documents: expected >= 2 tokens and >= 1 document"
        elif not 1 <= self.block_tokens <= 1 << 24:
            bad = f"block_tokens {self.block_tokens}: expected 1 to {1 << 24}"
        else:
            for name, at, n in (("tokens", self.tokens_offset, self.n_tokens * self.dtype.itemsize),
                                ("doc_offsets", self.doc_offsets_offset, (self.n_docs + 1) * 8),
                                ("block_crc32", self.crc_offset, self.n_blocks * 4)):
                if at + n > self.size:
                    bad = f"/{name} at bytes {at} to {at + n} passes the file's size {self.size}"
                    break
        if bad:
            raise DataError(f"token manifest {where}: {bad}")


class TokenDataset:
    """The sequences of one token file for training (see the module docstring); a
    ``TokenSource`` of :class:`hpcml.train.trainer.Trainer`."""

    def __init__(self, path: str | os.PathLike, *, seq_len: int, seed: int = 0) -> None:
        if not is_int(seq_len) or seq_len < 1:
            raise ConfigError(f"seq_len must be an int >= 1, got {seq_len!r}")
        self.m = Manifest.read(path)
        self.seq_len, self.seed = seq_len, seed
        self.windows = (self.m.n_tokens - 1) // seq_len
        if self.windows < 1:
            raise DataError(f"token file {self.m.path}: {self.m.n_tokens} tokens hold no sequence of {seq_len} + 1 "
                            f"tokens: pack more documents or train on shorter sequences")
        try:
            self._fd = safeio.open_fd(self.m.path)
        except FileNotFoundError:
            raise DataError(f"token file {self.m.path}: no such file (named by its manifest)") from None
        except ValueError as e:  # safeio's refusal names the file
            raise DataError(f"token file {e}") from None
        except OSError as e:
            raise DataError(f"token file {self.m.path}: {e.strerror or e}") from None
        if hasattr(os, "posix_fadvise"):  # sequences are read in a random order: no readahead of what is not read
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(self._fd).st_size
        if size != self.m.size:
            os.close(self._fd)
            raise DataError(f"token file {self.m.path} has {size} bytes, its manifest says {self.m.size}: not the "
                            f"file that was packed (copied in part, or replaced)")
        self._perm: tuple[int, np.ndarray] | None = None
        self._crcs: dict[int, np.ndarray] = {}

    @property
    def vocab_size(self) -> int:
        return self.m.vocab_size

    @property
    def eods(self) -> set[int]:
        """The end-of-document token id(s) (one per file; a mixture may have several)."""
        return {self.m.eod}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _pread(self, at: int, n: int) -> bytes:
        data = os.pread(self._fd, n, at)
        if len(data) != n:
            raise DataError(f"token file {self.m.path}: {len(data)} of {n} bytes at {at} (the file shrank)")
        return data

    def tokens(self, start: int, n: int) -> np.ndarray:
        """Tokens ``start .. start + n`` as int64: the blocks that hold them read in one ``pread``
        and each checked against its CRC-32 (every read: a file changed under a running job is
        caught too), their ids checked against the vocabulary."""
        if not 0 <= start <= start + n <= self.m.n_tokens:
            raise IndexError(f"tokens {start} to {start + n} of {self.m.n_tokens}")
        if n == 0:
            return np.zeros(0, np.int64)
        bt, size = self.m.block_tokens, self.m.dtype.itemsize
        a, b = start // bt, (start + n - 1) // bt + 1
        end = min(b * bt, self.m.n_tokens)
        data = memoryview(self._pread(self.m.tokens_offset + a * bt * size, (end - a * bt) * size))
        for k in range(b - a):
            if crc32(data[k * bt * size:(k + 1) * bt * size]) != self._crc(a + k):
                lo = (a + k) * bt
                raise DataError(f"token file {self.m.path}: block {a + k} "
                                f"(tokens {lo} to {min(lo + bt, self.m.n_tokens)}"
                                f") does not match its CRC-32: the file is corrupted; pack it again or restore it")
        raw = np.frombuffer(data, self.m.dtype, n, (start - a * bt) * size)
        if int(raw.max()) >= self.m.vocab_size:
            k = int(np.argmax(raw >= self.m.vocab_size))
            raise DataError(f"token file {self.m.path}: token id {int(raw[k])} at position {start + k} is outside "
                            f"the vocabulary of {self.m.vocab_size}")
        return raw.astype(np.int64)

    def _crc(self, block: int) -> int:
        """A block's CRC, its part of the table read once (16 Ki CRCs at a time: one read of the
        table per 16 Mi tokens, not one per sequence)."""
        k, i = divmod(block, CRC_CHUNK)
        part = self._crcs.get(k)
        if part is None:
            n = min(CRC_CHUNK, self.m.n_blocks - k * CRC_CHUNK)
            part = self._crcs[k] = np.frombuffer(self._pread(self.m.crc_offset + 4 * k * CRC_CHUNK, 4 * n), "<u4")
        return int(part[i])

    def verify(self, chunk: int = 1 << 24) -> None:
        """Every block's CRC and every id, a chunk at a time (``hpcml data info --verify``)."""
        for start in range(0, self.m.n_tokens, chunk):
            self.tokens(start, min(chunk, self.m.n_tokens - start))

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(self.windows))
        return self._perm[1]

    def sample_ids(self, step: int, n: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """``(epoch, window)`` of samples ``lo .. hi`` of ``step``'s global batch of ``n``."""
        hi = n if hi is None else hi
        return [self.window_of(g) for g in range(step * n + lo, step * n + hi)]

    def window_of(self, g: int) -> tuple[int, int]:
        """``(epoch, window)`` of this dataset's global sample ``g``."""
        epoch, k = divmod(g, self.windows)
        return epoch, int(self._permutation(epoch)[k])

    def rows(self, step: int, n: int, lo: int, hi: int):
        """Rows ``lo .. hi`` of ``step``'s global batch of ``n``: ``[hi - lo, seq_len + 1]`` int64
        (only those sequences are read)."""
        import torch

        out = np.empty((hi - lo, self.seq_len + 1), np.int64)
        windows = [w for _, w in self.sample_ids(step, n, lo, hi)]
        self.will_need(windows + [w for _, w in self.sample_ids(step + 1, n, lo, hi)])  # and the next step's
        for i, w in enumerate(windows):
            out[i] = self.tokens(w * self.seq_len, self.seq_len + 1)
        return torch.from_numpy(out)

    def will_need(self, windows: list[int]) -> None:
        """Ask the kernel for the blocks of ``windows`` at once (``POSIX_FADV_WILLNEED``): the reads
        go out in parallel and overlap the checks and the training step, instead of one at a time."""
        if not hasattr(os, "posix_fadvise"):
            return
        bt, size = self.m.block_tokens, self.m.dtype.itemsize
        for w in windows:
            a = w * self.seq_len // bt * bt
            b = min(-(-(w * self.seq_len + self.seq_len + 1) // bt) * bt, self.m.n_tokens)
            os.posix_fadvise(self._fd, self.m.tokens_offset + a * size, (b - a) * size, os.POSIX_FADV_WILLNEED)

    def global_batch(self, step: int, n: int):
        """``[n, seq_len + 1]`` int64 tokens for ``step`` (inputs are [:, :-1], targets [:, 1:])."""
        return self.rows(step, n, 0, n)

    def check_vocab(self, model_vocab: int) -> None:
        """ConfigError, before step 1, when the corpus's tokenizer has more ids than the model's embedding."""
        if self.m.vocab_size > model_vocab:
            raise ConfigError(f"token file {self.m.path} was packed for a vocabulary of {self.m.vocab_size} ids, the "
                              f"model embeds {model_vocab}: token ids past {model_vocab - 1} would index out of the "
                              f"embedding; give a model with vocab_size >= {self.m.vocab_size}")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass
