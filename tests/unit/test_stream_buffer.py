"""The training buffers' policies (fifo, firo, reservoir) in one process."""

from __future__ import annotations

import numpy as np
import pytest

from hpcml.errors import ConfigError
from hpcml.stream import Buffer, BufferConfig, Sample


def _sample(i: int) -> Sample:
    return Sample(sim=i, step=0, t=0.0, params=np.zeros(1, np.float32), fields=np.full((1, 2, 2), i, np.float32))


def test_fifo_serves_in_order_and_applies_backpressure():
    b = Buffer(BufferConfig(policy="fifo", capacity=4, watermark=2))
    for i in range(4):
        assert b.put(_sample(i), timeout=0)
    assert not b.put(_sample(9), timeout=0)  # full: the server must wait
    assert [s.sim for s in b.get(2)] == [0, 1]
    assert b.put(_sample(4), timeout=0)
    assert [s.sim for s in b.get(2)] == [2, 3]
    assert b.get(1) is None  # 1 left < watermark 2 while the stream is live
    b.end()
    assert [s.sim for s in b.get(1)] == [4] and b.exhausted(1)
    assert b.stats.reuse_hist == {1: 5}


def test_firo_draws_randomly_without_reuse_and_drains():
    b = Buffer(BufferConfig(policy="firo", capacity=16, watermark=8, seed=1))
    for i in range(16):
        b.put(_sample(i))
    got = [s.sim for s in b.get(4)] + [s.sim for s in b.get(4)]
    assert len(set(got)) == 8 and got != sorted(got)  # random out, never twice
    got += [s.sim for s in b.get(4)]  # 8 left = the watermark: still served
    assert b.get(4) is None  # 4 left < watermark 8 while the stream is live
    b.end()
    rest = []
    while (batch := b.get(4)) is not None:
        rest += [s.sim for s in batch]
    assert sorted(got + rest) == list(range(16))


def test_reservoir_reuses_and_evicts():
    b = Buffer(BufferConfig(policy="reservoir", capacity=4, watermark=4, seed=0))
    for i in range(4):
        b.put(_sample(i))
    for _ in range(5):
        assert len(b.get(2)) == 2
    assert len(b) == 4 and sum(s.reuse for s in b._items) == 10
    assert b.put(_sample(100), timeout=0)  # never blocks: evicts
    assert len(b) == 4 and b.stats.evicted == 1 and 100 in [s.sim for s in b._items]


def test_buffer_config_errors_name_the_values():
    with pytest.raises(ConfigError, match="capacity 4, watermark 5"):
        BufferConfig(capacity=4, watermark=5)
    with pytest.raises(ConfigError, match="'lifo' unknown"):
        BufferConfig(policy="lifo")


def test_a_policy_switched_during_the_run_serves_by_it_and_a_restore_keeps_it():
    """PBT explores a member's buffer policy (issue 45): the samples held stay; from the switch
    on batches follow the new policy; the switch is in the saved state and a restore into a
    buffer configured otherwise keeps it; an unknown policy is refused in one line."""
    from hpcml.train.pbt import perturbed

    b = Buffer(BufferConfig(policy="reservoir", capacity=4, watermark=0, seed=1))
    for i in range(3):
        b.put(_sample(i))
    b.get(2)  # reservoir: used and kept
    assert len(b) == 3
    b.set_policy("fifo")
    assert [s.sim for s in b.get(2)] == [0, 1] and len(b) == 1  # FIFO now: the oldest, removed
    arrays, meta = b.state()
    again = Buffer(BufferConfig(policy="reservoir", capacity=4, watermark=0))
    again.load_state(arrays, meta)
    assert again.config.policy == "fifo" and len(again) == 1 and again.state()[1]["policy_set"] == "fifo"
    plain = Buffer(BufferConfig(policy="firo", capacity=4, watermark=0))
    plain.load_state(*Buffer(BufferConfig(policy="fifo")).state())
    assert plain.config.policy == "firo"  # a policy never switched is the config's on restore
    with pytest.raises(ConfigError, match="buffer policy 'lifo' unknown: expected one of fifo, firo, reservoir"):
        b.set_policy("lifo")
    draws = {perturbed("buffer_policy", "firo", np.random.default_rng([1, r, 0, 1]), (0.8, 1.25)) for r in range(20)}
    assert draws == {"fifo", "reservoir"}  # always another policy, both drawn
    assert perturbed("warmup", 4, np.random.default_rng(0), (0.8,)) == 3  # whole steps
