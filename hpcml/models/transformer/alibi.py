"""ALiBi's head slopes (Press, Smith and Lewis, ICLR 2022; BLOOM's and MPT's positions).

Head h of n adds ``-m_h * (i - j)`` to the score of query i on key j, with the geometric
sequence ``m_h = 2 ** (-8 (h + 1) / n)`` when n is a power of two. Otherwise the paper takes
the sequence of the nearest lower power of two, p, and then every other slope of the
sequence for 2p, as many as are missing (what BLOOM and MPT's ``alibi_bias_max=8`` compute).
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """[n_heads] float64 slopes, head 0 first."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-max_bias * (h + 1) / n) for h in range(n)]

    p = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = geometric(p) + geometric(2 * p)[0::2][:n_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)
