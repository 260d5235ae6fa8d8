"""Several token files trained on at once, each for its share of the samples.

``Mixture([(a, 0.7), (b, 0.3)])`` serves every global batch from its datasets by weight.
Which dataset a global sample ``g`` comes from is fixed by ``g`` alone: samples go in blocks
of ``block`` (default 1,000), in each of which dataset ``k`` has ``n_k`` of the places (its
weight's share, the remainders going to the largest fractions, so the shares are exact per
block) at positions of a seeded permutation of the block. A dataset's ``i``-th sample is its
own global sample ``i`` (:class:`~hpcml.data.tokens.TokenDataset`: its own epochs, its own
order), and ``i`` -- how many earlier samples it served -- is ``(g div block) n_k`` plus its
places before ``g`` in the block: closed form, so any step, on any layout or after a resume,
reads what an uninterrupted run reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcml.data.tokens import TokenDataset
from hpcml.errors import ConfigError
from hpcml.numeric import is_int, is_real


class Mixture:
    """Token datasets mixed by weight (see the module docstring); a trainer's token source."""

    def __init__(self, parts: Sequence[tuple[TokenDataset, float]], *, seed: int = 0, block: int = 1000) -> None:
        if not parts:
            raise ConfigError("a mixture needs at least one dataset")
        weights = [w for _, w in parts]
        bad = [w for w in weights if not is_real(w) or not 0 < w < float("inf")]
        if bad:
            raise ConfigError(f"mixture weights {weights}: expected positive numbers")
        lens = {d.seq_len for d, _ in parts}
        if len(lens) != 1:
            raise ConfigError(f"mixture datasets opened with sequence lengths {sorted(lens)}: expected one")
        if not is_int(block) or not len(parts) <= block <= 1 << 20:
            raise ConfigError(f"mixture block {block!r}: expected an int from {len(parts)} to {1 << 20}")
        self.datasets = [d for d, _ in parts]
        self.seq_len, self.seed, self.block = lens.pop(), seed, block
        share = np.asarray(weights, float) / sum(weights) * block
        n = np.floor(share).astype(int)
        for k in np.argsort(-(share - n), kind="stable")[:block - n.sum()]:  # largest remainders
            n[k] += 1
        if (n == 0).any():
            raise ConfigError(f"mixture weights {weights}: "
                              f"dataset(s) {np.flatnonzero(n == 0).tolist()} get no place in "
                              f"a block of {block}; raise their weight or the block")
        self.counts = n
        rng = np.random.default_rng([seed, 0x6D6978])  # the block's places, the same in every block
        self._owner = rng.permutation(np.repeat(np.arange(len(n)), n))
        self._rank = np.zeros(block, np.int64)  # a place's index among its dataset's places in the block
        for k in range(len(n)):
            self._rank[self._owner == k] = np.arange(n[k])

    @property
    def vocab_size(self) -> int:
        return max(d.vocab_size for d in self.datasets)

    @property
    def eods(self) -> set[int]:
        return set().union(*(d.eods for d in self.datasets))

    def check_vocab(self, model_vocab: int) -> None:
        for d in self.datasets:
            d.check_vocab(model_vocab)

    def source(self, g: int) -> tuple[int, int]:
        """Global sample ``g``: (the dataset it comes from, that dataset's own sample index)."""
        b, p = divmod(g, self.block)
        k = int(self._owner[p])
        return k, b * int(self.counts[k]) + int(self._rank[p])

    def sample_ids(self, step: int, n: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
        """``(dataset, epoch, window)`` of samples ``lo .. hi`` of ``step``'s global batch of ``n``."""
        hi = n if hi is None else hi
        out = []
        for g in range(step * n + lo, step * n + hi):
            k, i = self.source(g)
            out.append((k, *self.datasets[k].window_of(i)))
        return out

    def rows(self, step: int, n: int, lo: int, hi: int):
        import torch

        out = np.empty((hi - lo, self.seq_len + 1), np.int64)
        ids = self.sample_ids(step, n, lo, hi)
        for k, d in enumerate(self.datasets):
            d.will_need([w for j, _, w in ids if j == k])
        for r, (k, _, w) in enumerate(ids):
            out[r] = self.datasets[k].tokens(w * self.seq_len, self.seq_len + 1)
        return torch.from_numpy(out)

    def global_batch(self, step: int, n: int):
        return self.rows(step, n, 0, n)


def open_tokens(specs: Sequence[str], *, seq_len: int, seed: int = 0) -> TokenDataset | Mixture:
    """Token files as a training source: one ``FILE``, or several ``FILE[:WEIGHT]`` mixed by
    weight (default 1; a ``:`` not followed by a number is part of the name). File ``k``'s own
    order is seeded by ``seed + k``."""
    if not specs:
        raise ConfigError("no token file given: expected FILE or FILE:WEIGHT")
    parts = []
    for k, spec in enumerate(specs):
        path, _, weight = spec.rpartition(":")
        if not path or not weight.replace(".", "", 1).isdigit():  # no weight given (or a ':' in the path)
            path, weight = spec, "1"
        parts.append((TokenDataset(path, seq_len=seq_len, seed=seed + k), float(weight)))
    return parts[0][0] if len(parts) == 1 else Mixture(parts, seed=seed)


def end_of_document(data: TokenDataset | Mixture) -> int:
    """The end-of-document token of ``data``, the one document masking splits on; ConfigError
    when its files end documents with different tokens (packed with other tokenizers)."""
    if len(data.eods) != 1:
        raise ConfigError(f"the token files end their documents with different tokens {sorted(data.eods)}: pack "
                          f"them with one tokenizer to mask attention by document")
    return next(iter(data.eods))
