"""Rotary position embeddings: the angle tables, their application, and Llama 3's frequency
scaling (``rope_type: llama3`` in a Hugging Face config; torchtitan's Llama 3 models use it).

Llama 3.1's scaling leaves the high frequencies (wavelengths shorter than
``original_max_seq / high_freq_factor``) as they are, divides the low ones (longer than
``original_max_seq / low_freq_factor``) by ``factor``, and blends linearly in between, by
``(original_max_seq / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``
(Meta's published reference; transformers' ``_compute_llama3_parameters``). The tables are
built in float64 and stored in float32, so every layout and both conventions get the same
angles.
"""

from __future__ import annotations

import math

import torch

Llama3 = tuple[float, float, float, int]
"""(factor, low_freq_factor, high_freq_factor, original_max_seq)."""


def inv_freq(head_dim: int, theta: float, llama3: Llama3 | None = None) -> torch.Tensor:
    """The rotation frequency of each of the ``head_dim / 2`` pairs (float64)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if llama3 is None:
        return inv
    factor, low, high, original = llama3
    wavelen = 2 * math.pi / inv
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv / factor + smooth * inv  # 1: high band, unchanged; 0: low band, / factor
    return torch.where(wavelen < original / high, inv, torch.where(wavelen > original / low, inv / factor, scaled))


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                llama3: Llama3 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim / 2] of each position's angles."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq(head_dim, theta, llama3))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of ``x`` [B, S, H, D] by the angles of its positions (cos/sin [S, D/2])."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)
