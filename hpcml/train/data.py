"""Deterministic synthetic token data: the same global batch for a step on every layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcml.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SyntheticTokens:
    """Token sequences from a fixed random Markov chain: learnable, so the loss falls.

    ``global_batch(step, n)`` depends only on (seed, step), never on the layout: every rank
    draws the whole global batch and keeps its slice, so any layout trains on exactly the
    samples a single process does.
    """

    vocab_size: int
    seq_len: int
    seed: int = 0
    branching: int = 4
    """Successors each token may have; fewer means a lower reachable loss."""

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or self.seq_len < 1 or self.branching < 1:
            raise ConfigError(f"SyntheticTokens needs vocab_size >= 2, seq_len >= 1, branching >= 1; got "
                              f"{self.vocab_size}, {self.seq_len}, {self.branching}")

    def _table(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab_size, (self.vocab_size, self.branching), generator=g)

    def global_batch(self, step: int, n: int) -> torch.Tensor:
        """``[n, seq_len + 1]`` int64 tokens for ``step`` (inputs are [:, :-1], targets [:, 1:])."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        table = self._table()
        out = torch.empty(n, self.seq_len + 1, dtype=torch.int64)
        out[:, 0] = torch.randint(0, self.vocab_size, (n,), generator=g)
        choices = torch.randint(0, self.branching, (n, self.seq_len), generator=g)
        for t in range(self.seq_len):
            out[:, t + 1] = table[out[:, t], choices[:, t]]
        return out
