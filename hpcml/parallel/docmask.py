"""Attention within documents of packed sequences (Megatron's ``reset_attention_mask``).

A corpus packs documents end to end, separated by an end-of-document token, so a training
sequence spans several. With document masking, a position attends only to earlier positions
of its own document: the first tokens of a document are not conditioned on the unrelated
text before them. The mask is built once per forward and shared by every layer (a boolean
``[B, 1, rows, S]``: SDPA takes it as is); a context-parallel core asks for the rows of the
queries it holds. Rotary positions are relative, so a document attends as if it stood alone.
"""

from __future__ import annotations

import torch

from hpcml.errors import ConfigError


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[B, S] tokens -> [B, S] document index of each position: the count of end-of-document
    tokens strictly before it (the end token belongs to the document it ends)."""
    ends = (tokens == eod).to(torch.int32)
    return (torch.cumsum(ends, dim=1) - ends).to(torch.int32)


class DocMask:
    """The causal, same-document mask of ``doc_ids`` [B, S] (every position of the sequence,
    whichever positions a rank holds), cut by query rows on demand and cached per forward."""

    def __init__(self, doc_ids: torch.Tensor) -> None:
        if doc_ids.dim() != 2:
            raise ConfigError(f"doc_ids of shape {tuple(doc_ids.shape)}: expected [batch, sequence]")
        self.doc_ids = doc_ids
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def seq_len(self) -> int:
        return self.doc_ids.shape[1]

    def rows(self, start: int, n: int) -> torch.Tensor:
        """[B, 1, n, S] bool: query ``start + i`` may attend key ``j`` (``j <= start + i``, same document)."""
        key = (start, n)
        mask = self._rows.get(key)
        if mask is None:
            if start < 0 or n < 1 or start + n > self.seq_len:
                raise ConfigError(f"doc mask rows {start}..{start + n}: outside the sequence of {self.seq_len}")
            d = self.doc_ids
            q = torch.arange(start, start + n, device=d.device)[:, None]
            causal = torch.arange(self.seq_len, device=d.device)[None, :] <= q
            same = d[:, start:start + n, None] == d[:, None, :]
            mask = self._rows[key] = (same & causal)[:, None]
        return mask
