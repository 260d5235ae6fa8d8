"""Helpers shared by the MPI tests."""

from __future__ import annotations

import pytest
from mpi4py import MPI


def needs_world(*sizes: int):
    """Skip unless the world size is one of ``sizes`` (the same decision on every rank)."""
    size = MPI.COMM_WORLD.Get_size()
    return pytest.mark.skipif(size not in sizes, reason=f"needs world size in {sizes}, have {size}")
