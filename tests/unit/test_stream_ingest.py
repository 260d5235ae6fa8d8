"""The exactly-once rules without sockets: thousands of generated messages through
:class:`hpcml.stream.ingest.Ingest` in milliseconds -- assembly, deduplication, retries,
the schema (fields, parameters, one grid), the memory bound, and the end of the stream
with its accounting (:class:`hpcml.stream.ending.EndTracker`)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hpcml.contract import DoneRecord
from hpcml.stream.ingest import Ingest
from hpcml.stream.message import Message, MessageError
from hpcml.stream.schema import SampleSchema

SHAPE = (6, 4)


def _ingest(rank=0, n_trainers=1, grace=5.0, **kw) -> Ingest:
    return Ingest(rank=rank, n_trainers=n_trainers, schema=SampleSchema(("u",), ("a",)),
                  max_sample_bytes=kw.get("max_sample_bytes", 1 << 20),
                  max_partial_bytes=kw.get("max_partial_bytes", 1 << 20), partial_timeout_s=60.0, end_grace_s=grace)


def _block(sim, step, rank=0, nranks=1, attempt=0, shape=SHAPE, params=None, fields=("u",), value=None):
    rows = shape[0] // nranks
    lo = rank * rows
    n = shape[0] - lo if rank == nranks - 1 else rows
    local = (n, *shape[1:])
    a = np.full(local, value if value is not None else 1000.0 * sim + step, np.float32)
    h = {"kind": "data", "sim": sim, "attempt": attempt, "rank": rank, "nranks": nranks, "step": step, "t": step / 10,
         "global_shape": list(shape), "offset": [lo] + [0] * (len(shape) - 1), "shape": list(local),
         "params": params if params is not None else {"a": sim / 10}}
    return Message(h, {f: a for f in fields})


def _end(sim, rank, nranks, n_sent, attempt=0):
    return Message({"kind": "end", "sim": sim, "attempt": attempt, "rank": rank, "nranks": nranks, "n_sent": n_sent})


def test_thousands_of_messages_with_retries_duplicates_and_reorders_give_each_sample_once():
    ing, rng = _ingest(), np.random.default_rng(3)
    msgs = []
    for sim in range(40):
        nranks = 1 + sim % 3
        steps = range(1, 26)
        first = [_block(sim, s, r, nranks) for s in steps for r in range(nranks)]
        if sim % 5 == 0:  # attempt 0 dies half way, attempt 1 re-sends everything
            msgs += first[: len(first) // 2]
            msgs += [_block(sim, s, r, nranks, attempt=1) for s in steps for r in range(nranks)]
        else:
            msgs += first
        msgs += [_end(sim, r, nranks, len(steps), attempt=1 if sim % 5 == 0 else 0) for r in range(nranks)]
    sims = np.array([m.header["sim"] for m in msgs])
    when = np.empty(len(msgs))
    for sim in range(40):  # random arrival times, increasing within each simulation
        idx = np.flatnonzero(sims == sim)
        when[idx] = np.sort(rng.random(len(idx)))
    order = np.argsort(when, kind="stable")
    t0 = time.perf_counter()
    samples, drops = [], 0
    for i in order:  # simulations interleaved at random, each one's messages in order (one pipe each)
        try:
            s = ing.message(msgs[i])
        except MessageError:
            drops += 1
            continue
        if s is not None:
            samples.append(s)
    dt = time.perf_counter() - t0
    keys = [(s.sim, s.step) for s in samples]
    assert len(keys) == len(set(keys)) == 40 * 25 and drops == 0
    for s in samples:  # bit for bit, whatever the decomposition
        assert s.fields.shape == (1, *SHAPE) and np.all(s.fields == 1000.0 * s.sim + s.step)
    ing.ends.campaign_done(DoneRecord(completed=list(range(40)), failed=[], streamed={i: 25 for i in range(40)}))
    assert ing.ended() == (True, [])
    acc = ing.accounting()
    assert acc["expected"] == acc["ingested"] == {i: 25 for i in range(40)}
    # the 8 retried simulations' attempt 0 completed 12 steps each before dying: their copies were dropped
    assert ing.counters["duplicates"] == 8 * 12 and ing.counters["partial_discarded"] == 5  # the multi-rank ones
    assert dt < 5.0, dt  # (about 0.1 s here)


def test_the_schema_refuses_other_fields_parameters_and_grids_naming_the_simulations():
    ing = _ingest()
    assert ing.message(_block(0, 1)) is not None  # fixes the grid: 6 x 4
    with pytest.raises(MessageError, match=r"wrong_shape: simulation 3's grid is 8 x 4, simulation 0's 6 x 4"):
        ing.message(_block(3, 1, shape=(8, 4)))
    with pytest.raises(MessageError,
                       match=r"wrong_fields: simulation 4 sends fields \['v'\], the trainer takes \['u'\]"):
        ing.message(_block(4, 1, fields=("v",)))
    with pytest.raises(MessageError, match=r"missing_params: simulation 5's parameters \['b'\] lack \['a'\]"):
        ing.message(_block(5, 1, params={"b": 1.0}))
    with pytest.raises(MessageError, match="bad_header: parameters .* overflow float32"):
        ing.message(_block(6, 1, params={"a": 1e300}))
    # a sample that never completes fixes nothing: a bomb's first block cannot lock the grid
    fresh = _ingest(max_sample_bytes=1 << 10)
    with pytest.raises(MessageError, match="too_large"):
        fresh.message(_block(9, 1, nranks=2, shape=(10**4, 10**4)))
    assert fresh.schema.shape is None and fresh.message(_block(0, 1)) is not None and fresh.schema.shape == SHAPE


def test_incomplete_samples_stay_within_the_memory_bound_the_oldest_evicted():
    sample = 4 * 64 * 64 + 64 * 64  # float32 fields plus the coverage mask
    ing = _ingest(max_partial_bytes=10 * sample)
    for sim in range(25):  # half a sample each, never finished
        assert ing.message(_block(sim, 1, rank=0, nranks=2, shape=(64, 64))) is None
        assert ing.assembly.nbytes <= 10 * sample
    assert len(ing.assembly) == 10 and ing.dropped == {"partial_evicted": 15}
    assert sorted(k[0] for k in ing.assembly.partials) == list(range(15, 25))  # the newest kept


def test_the_end_waits_for_what_the_done_record_says_then_counts_what_is_missing():
    ing = _ingest(grace=0.3)
    for step in range(1, 4):
        ing.message(_block(0, step))
    assert ing.ended() == (False, [])  # no done record yet
    ing.ends.campaign_done(DoneRecord(completed=[0, 1], failed=[2], streamed={0: 5, 1: 0}))
    ended, waiting = ing.ended()
    assert (ended, waiting) == (False, [0])  # 3 of 5 in; simulation 1 streamed nothing: nothing to wait for
    ing.message(_block(0, 4))
    time.sleep(0.35)
    assert ing.ended() == (True, [0])  # the grace is over: it ends without the fifth
    assert ing.accounting() == {"expected": {0: 5, 1: 0}, "ingested": {0: 4, 1: 0}, "silent": []}


def test_a_simulation_that_closed_no_producer_is_silent_and_waited_for_by_nobody():
    ing = _ingest(grace=60)
    ing.message(_block(0, 1))
    ing.ends.campaign_done(DoneRecord(completed=[0, 3], failed=[], streamed={0: 1}, silent=[3]))
    assert ing.ended() == (True, []) and ing.accounting()["silent"] == [3]  # not waited for: said, not hidden


def test_end_markers_settle_a_simulation_whose_count_the_driver_does_not_know():
    ing = _ingest(grace=60)
    ing.message(_block(7, 1, rank=0, nranks=2))
    ing.ends.campaign_done(DoneRecord(completed=[7], failed=[]))  # a user's done file: no counts
    assert ing.ended() == (False, [7]) and ing.accounting()["expected"] == {7: None}
    ing.message(_end(7, 0, 2, 1))  # rank 0 sent one message: one sample expected, none whole yet
    assert ing.ended() == (False, [7]) and ing.accounting() == {"expected": {7: 1}, "ingested": {7: 0}, "silent": []}
    ing.message(_block(7, 1, rank=1, nranks=2))
    assert ing.ended() == (True, []) and ing.accounting()["ingested"] == {7: 1}


def test_routing_and_stale_attempts_are_refused():
    ing = _ingest(rank=1, n_trainers=2)
    with pytest.raises(MessageError, match="misrouted: simulation 2 routes to trainer rank 0, not 1"):
        ing.message(_block(2, 1))
    ing.message(_block(3, 1, attempt=2))
    with pytest.raises(MessageError, match="stale_attempt: simulation 3 attempt 1 after attempt 2"):
        ing.message(_block(3, 2, attempt=1))


def test_state_round_trips_onto_another_trainer_count():
    one = _ingest(n_trainers=1)
    for sim in range(4):
        for step in (1, 2):
            one.message(_block(sim, step))
        one.message(_end(sim, 0, 1, 2))
    meta = one.state_meta()
    two = [_ingest(rank=r, n_trainers=2) for r in range(2)]
    for r, ing in enumerate(two):
        keep = lambda sim, r=r: sim % 2 == r  # noqa: E731
        ing.seen.update(k for k in one.seen if keep(k[0]))
        ing.load_meta(meta, keep, history=r == 0)
        ing.restored()
        ing.ends.campaign_done(DoneRecord(completed=[0, 1, 2, 3], failed=[], streamed={i: 2 for i in range(4)}))
        assert ing.ended() == (True, []) and ing.schema.shape == SHAPE
        assert ing.accounting()["ingested"] == {s: 2 for s in range(4) if s % 2 == r}
    assert two[0].counters["messages"] == one.counters["messages"] and two[1].counters["messages"] == 0
