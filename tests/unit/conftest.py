"""Every unit test leaves the process's signal dispositions as it found them.

A test that runs an entry point in-process (``workflows/llm_pretrain.py``'s ``main``, the
corpus's references) ends with :func:`hpcml.stop.finished`, which ignores the walltime
signals for good; an ignored signal stays ignored across ``exec``, so every later test's
subprocess (a generated job script whose timer traps SIGUSR1) would inherit it and hang.
"""

from __future__ import annotations

import signal

import pytest

from hpcml import stop

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_AT_START = {s: signal.getsignal(s) for s in _SIGNALS}
"""Taken when pytest loads this file: before any fixture (a module-scoped one building
references may run an entry point to its end) or test has run."""


@pytest.fixture(autouse=True)
def _signals_restored():
    yield
    for s, handler in _AT_START.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)
    stop.clear()


@pytest.fixture
def fp64():
    """A test in float64 (torch's default dtype), restored after: the exact comparisons."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)
