"""The attention mask of one forward: causal, within documents of packed sequences
(Megatron's ``reset_attention_mask``), with ALiBi's linear biases (Press et al., 2022).

A corpus packs documents end to end, separated by an end-of-document token, so a training
sequence spans several. With document masking, a position attends only to earlier positions
of its own document: the first tokens of a document are not conditioned on the unrelated
text before them. Rotary positions are relative, so a document attends as if it stood alone.
ALiBi adds ``-slope_h * (i - j)`` to head h's score of query i on key j: a bias per head, so a
view of the mask narrows its heads as tensor and Ulysses' parallelism split them.

The mask is built once per forward and shared by every layer of a stage (each distinct rows,
heads and dtype once: SDPA saves it for backward, so a copy per layer would cost memory); a
context-parallel core asks for the rows of the queries it holds. Without biases it is boolean
``[B, 1, rows, S]``; with them float ``[B or 1, heads, rows, S]``, ``-inf`` where masked.
"""

from __future__ import annotations

import torch

from hpcml.errors import ConfigError


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[B, S] tokens -> [B, S] document index of each position: the count of end-of-document
    tokens strictly before it (the end token belongs to the document it ends)."""
    ends = (tokens == eod).to(torch.int32)
    return (torch.cumsum(ends, dim=1) - ends).to(torch.int32)


class AttentionMask:
    """The causal mask of a sequence of ``seq_len`` positions (every position, whichever a rank
    holds): within the documents of ``doc_ids`` [B, S] if given, with ALiBi ``slopes`` [heads]
    if given; cut by query rows (and, with slopes, by heads) on demand, cached per forward."""

    def __init__(self, doc_ids: torch.Tensor | None = None, *, seq_len: int | None = None,
                 slopes: torch.Tensor | None = None, device: torch.device | str | None = None) -> None:
        if doc_ids is not None and doc_ids.dim() != 2:
            raise ConfigError(f"doc_ids of shape {tuple(doc_ids.shape)}: expected [batch, sequence]")
        if doc_ids is None and seq_len is None:
            raise ConfigError("an attention mask needs doc_ids or seq_len")
        if doc_ids is not None and seq_len is not None and seq_len != doc_ids.shape[1]:
            raise ConfigError(f"doc_ids of {doc_ids.shape[1]} positions for a sequence of {seq_len}")
        self.doc_ids = doc_ids
        self.device = doc_ids.device if doc_ids is not None else torch.device(device or "cpu")
        self.seq_len = doc_ids.shape[1] if seq_len is None else seq_len
        self.slopes = slopes
        self.head_range = (0, 0 if slopes is None else slopes.numel())
        """(first, count): the heads a view's cores hold, in the model's numbering."""
        self._cache: dict[tuple, torch.Tensor] = {}

    def heads(self, index: int, count: int) -> AttentionMask:
        """The view for part ``index`` of ``count`` equal parts of this view's heads (a tensor-
        parallel rank's, then a Ulysses rank's); the same mask without biases."""
        if self.slopes is None or count == 1:
            return self
        first, n = self.head_range
        if n % count or not 0 <= index < count:
            raise ConfigError(f"heads part {index} of {count}: {n} heads do not split so")
        view = object.__new__(AttentionMask)
        view.__dict__.update(self.__dict__)  # the cache stays shared with the whole mask
        view.head_range = (first + index * n // count, n // count)
        return view

    def rows(self, start: int, n: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """The mask of queries ``start .. start + n - 1`` over every key: boolean [B, 1, n, S]
        (True: attend) without biases; with them, ``dtype`` [B or 1, heads, n, S]."""
        if start < 0 or n < 1 or start + n > self.seq_len:
            raise ConfigError(f"attention mask rows {start}..{start + n}: outside the sequence of {self.seq_len}")
        biased = self.slopes is not None
        key = (start, n, self.head_range, dtype if biased else torch.bool)
        mask = self._cache.get(key)
        if mask is None:
            mask = self._cache[key] = self._build(start, n, dtype) if biased else self._allowed(start, n)
        return mask

    def _allowed(self, start: int, n: int) -> torch.Tensor:
        """[B or 1, 1, n, S] bool: query ``start + i`` may attend key ``j`` (``j <= start + i``, same document)."""
        device = self.device
        q = torch.arange(start, start + n, device=device)[:, None]
        allowed = torch.arange(self.seq_len, device=device)[None, :] <= q
        if self.doc_ids is not None:
            d = self.doc_ids
            allowed = allowed & (d[:, start:start + n, None] == d[:, None, :])
        return allowed[None, None] if self.doc_ids is None else allowed[:, None]

    def _build(self, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        first, count = self.head_range
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # the products exact for 2^-k slopes
        slopes = self.slopes[first:first + count].to(self.device, wide)
        rel = torch.arange(self.seq_len, device=self.device, dtype=wide)[None, :] \
            - torch.arange(start, start + n, device=self.device, dtype=wide)[:, None]  # j - i, <= 0 where causal
        rel = rel.masked_fill(~self._allowed(start, n), float("-inf"))  # [B or 1, 1, n, S]; slopes are > 0
        return (slopes[None, :, None, None] * rel).to(dtype)  # one pass over the [B or 1, heads, n, S] mask
