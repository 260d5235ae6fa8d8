"""ZeRO++'s block quantization (hpcml.parallel.zeropp): int8 values, one scale a block, each
value within half a step of its block; zeros and padding survive."""

from __future__ import annotations

import torch

from hpcml.parallel.zeropp import dequantize, quantize


def test_each_value_comes_back_within_half_a_step_of_its_block():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(100) * 1e-3, torch.randn(100) * 10.0, torch.zeros(37)])  # 3 scales, a ragged end
    q, scale = quantize(x, 64)
    assert q.dtype == torch.int8 and q.numel() == 256 and scale.numel() == 4
    assert int(q.abs().max()) == 127  # each block's largest value maps onto the end of the range
    back = dequantize(q, scale, x.numel(), torch.float64)
    step = scale.repeat_interleave(64)[:x.numel()].double()
    assert back.dtype == torch.float64 and back.shape == x.shape
    assert bool(((back - x.double()).abs() <= 0.5 * step + 1e-12).all())
    assert bool((back[-37:] == 0).all())  # an all-zero block stays zero (its scale 1, not 0/0)
    # a small block beside a large one keeps its own resolution (not the large block's)
    assert float((back[:64] - x[:64]).abs().max()) < 1e-4  # (the large blocks' half step: ~0.1)


def test_a_block_of_one_value_is_exact_up_to_rounding():
    q, scale = quantize(torch.tensor([3.0, -1.5]), 1)
    assert q.tolist() == [127, -127]
    assert dequantize(q, scale, 2, torch.float32).tolist() == [3.0, -1.5]
