"""The search priced in forked shares (``hpcml plan`` on the cores it may use): the same best layouts
as one process, every share's work done even when a child fails, and no fork where one is unsafe."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from hpcml.plan import forked
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.search import FRAMEWORK_CP_KINDS, search

CHILDREN = r"""
import json, os, signal, sys
from hpcml.plan import forked
parent = os.getpid()
def work(i):
    if os.getpid() == parent or i == 1:
        return {"i": i, "pid": os.getpid()}
    if i == 2:
        raise RuntimeError("a share that fails")
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"i": i, "pid": os.getpid(), "big": "x" * 200}  # i == 4: over the reply's bound below
forked.MAX_REPLY = 100
print(json.dumps({"parent": parent, "safe": forked.fork_safe(), "out": forked.fork_map(work, 5)}))
"""


def test_each_share_runs_in_its_own_child_and_a_failed_child_gives_none():
    """A fresh interpreter (no thread of pytest's): shares 1-4 forked; a child that raises, is killed
    or replies more than the bound gives None (the caller does that share), and nothing hangs."""
    out = subprocess.run([sys.executable, "-c", CHILDREN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["safe"] is True
    here, one, *failed = r["out"]
    assert here == {"i": 0, "pid": r["parent"]}
    assert one["i"] == 1 and one["pid"] != r["parent"]
    assert failed == [None, None, None]


def test_no_fork_beside_another_thread():
    """A thread may hold a lock a child would inherit locked: every share is then the caller's."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    try:
        assert not forked.fork_safe()
        assert forked.fork_map(lambda i: {"i": i}, 3) == [{"i": 0}, None, None]
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("framework", ["torchtitan", "megatron"])
def test_shares_find_the_best_one_process_finds(monkeypatch, framework):
    """Llama 3 70B on 512 H100s: the best five (layouts, step times, memory) of 2 and 3 shares are one
    process's, the layouts counted the same; fitting and unpriced may differ (each share's own bar)."""
    base = PlanLayout(model="llama3-70b", gpus=512, gpu="h100-80gb", seq_len=8192, global_batch=512,
                      framework=framework, degrees_checked=False)
    one = search(base, cp_kinds=FRAMEWORK_CP_KINDS[framework])
    monkeypatch.setattr("hpcml.plan.search.PARALLEL_MIN_GROUPS", 10)
    for workers in (2, 3):
        many = search(base, cp_kinds=FRAMEWORK_CP_KINDS[framework], workers=workers)
        assert len(one.best) == 5 and [p.layout for p in many.best] == [p.layout for p in one.best]
        assert [(p.step_s, p.memory_gib, p.dp_bytes) for p in many.best] == \
            [(p.step_s, p.memory_gib, p.dp_bytes) for p in one.best]
        assert (many.candidates, many.refused) == (one.candidates, one.refused)
        assert many.fitting >= 5 and many.fitting + many.unpriced <= one.candidates


def test_a_share_whose_child_failed_is_priced_here(monkeypatch):
    """A child that fails (here: every child's reply lost) costs time, not layouts."""
    base = PlanLayout(model="llama3-70b", gpus=512, gpu="h100-80gb", seq_len=8192, global_batch=512,
                      degrees_checked=False)
    one = search(base)
    monkeypatch.setattr("hpcml.plan.search.PARALLEL_MIN_GROUPS", 10)
    monkeypatch.setattr("hpcml.plan.search.fork_map", lambda work, n: [work(0), *([None] * (n - 1))])
    lost = search(base, workers=2)
    assert [p.layout for p in lost.best] == [p.layout for p in one.best]
    assert lost.fitting >= one.fitting


def test_a_fork_refused_by_the_system_leaves_the_share_to_the_caller(monkeypatch):
    """A login node's process limit (``fork`` raises EAGAIN): no child, every share priced here."""
    def refused():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(forked, "fork_safe", lambda: True)
    monkeypatch.setattr(forked.os, "fork", refused)
    assert forked.fork_map(lambda i: {"i": i}, 3) == [{"i": 0}, None, None]
    base = PlanLayout(model="llama3-70b", gpus=512, gpu="h100-80gb", seq_len=8192, global_batch=512,
                      degrees_checked=False)
    one = search(base)
    monkeypatch.setattr("hpcml.plan.search.PARALLEL_MIN_GROUPS", 10)
    assert [p.layout for p in search(base, workers=2).best] == [p.layout for p in one.best]
