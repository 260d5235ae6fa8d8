"""Checkpoint logic that needs no MPI: ownership planning, coverage, chunking, encodings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcml.ckpt import format as fmt
from hpcml.ckpt.plan import ChunkMeta, assign_owners, check_coverage
from hpcml.ckpt.writer import storage_chunk


def meta(name, offset, shape, nbytes):
    return ChunkMeta(name, (8, 8), offset, shape, "float32", nbytes)


def test_replicas_written_once_and_bytes_balanced():
    # 4 ranks hold the same two replicated tensors (DDP) and one private shard each
    rep = [meta("a", (0, 0), (8, 8), 256), meta("b", (0, 0), (8, 8), 256)]
    per_rank = [rep + [meta(f"s{r}", (r * 2, 0), (2, 8), 64)] for r in range(4)]
    owner = assign_owners(per_rank)
    assert len(owner) == 6
    assert {owner[("a", (0, 0), (8, 8))], owner[("b", (0, 0), (8, 8))]} == {0, 1}  # spread, not both on rank 0
    assert all(owner[(f"s{r}", (r * 2, 0), (2, 8))] == r for r in range(4))  # only the holder can write a shard
    assert assign_owners(per_rank) == owner  # deterministic: every rank computes the same


def test_coverage():
    assert check_coverage((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert check_coverage((4, 4), [((0, 0), (2, 4))]) == "8 elements not covered"
    assert check_coverage((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))]) == "4 elements covered more than once"


@pytest.mark.parametrize("shape,itemsize,expected", [
    ((4096, 4096), 4, (512, 512)),     # 64 MiB -> 1 MiB chunks
    ((64, 64), 4, (16, 16)),           # small: 1 KiB chunks, so 4-way row or column reads align
    ((64,), 4, (64,)),
    ((), 4, None),
])
def test_storage_chunks(shape, itemsize, expected):
    assert storage_chunk(shape, itemsize) == expected


def test_bf16_is_stored_as_its_bit_pattern():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    arr = fmt.to_numpy(t)
    assert arr.dtype == np.uint16 and arr.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    assert torch.equal(fmt.from_numpy(arr, "bfloat16"), t)
    assert fmt.storage(torch.bfloat16) == (np.uint16, "bfloat16")
    with pytest.raises(TypeError, match="cannot checkpoint dtype torch.complex64"):
        fmt.storage(torch.complex64)


def test_names():
    assert fmt.step_dir(1000) == "step_00001000" and fmt.shard_name(3) == "rank_00003.h5"
    assert fmt.STEP_RE.match("step_00001000") and not fmt.STEP_RE.match("step_00001000.tmp")
