"""The streaming path in one process: wire format, routing, buffers, and a real ZeroMQ
server thread fed by real producers over loopback."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from hpcml.errors import ConfigError
from hpcml.stream import Buffer, BufferConfig, Producer, Sample, message, route
from hpcml.stream.server import ServerConfig, StreamServer

SECRET = b"k" * 32
CAMPAIGN = "test-campaign"


def _header(**kw):
    h = {"kind": "data", "campaign": CAMPAIGN, "sim": 3, "attempt": 0, "rank": 0, "nranks": 1, "step": 5, "t": 0.5,
         "global_shape": [4, 3], "offset": [0, 0], "shape": [4, 3], "fields": [["T", "float32"]],
         "params": {"alpha": 0.1}}
    h.update(kw)
    return h


def test_message_round_trip_is_exact():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    frames = message.encode(SECRET, _header(), [a])
    msg = message.decode(SECRET, [bytes(f) for f in frames], CAMPAIGN)
    assert msg.kind == "data" and msg.header["step"] == 5
    np.testing.assert_array_equal(msg.arrays["T"], a)
    assert msg.nbytes == 48


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f[:2] + [f[-1]], "unauthenticated"),  # a payload frame dropped: the MAC covers every frame
    (lambda f: [f[0], f[1], b"x" * 48, f[-1]], "unauthenticated"),      # payload tampered
    (lambda f: [b"nope"] + f[1:], "malformed"),
    (lambda f: f[:-1] + [b"short"], "malformed"),
])
def test_tampered_messages_are_rejected_with_a_reason(mutate, reason):
    frames = [bytes(f) for f in message.encode(SECRET, _header(), [np.zeros((4, 3), np.float32)])]
    with pytest.raises(message.MessageError) as e:
        message.decode(SECRET, mutate(frames), CAMPAIGN)
    assert e.value.reason == reason


@pytest.mark.parametrize("header, payload, reason", [
    (_header(), np.zeros((2, 3), np.float32), "truncated"),               # authenticated but short payload
    (_header(offset=[2, 0]), np.zeros((4, 3), np.float32), "bad_header"),  # box outside the grid
    (_header(campaign="other"), np.zeros((4, 3), np.float32), "wrong_campaign"),
    (_header(kind="exec"), np.zeros((4, 3), np.float32), "bad_header"),
    (_header(fields=[["T", "object"]]), np.zeros((4, 3), np.float32), "bad_header"),
    (_header(rank=1), np.zeros((4, 3), np.float32), "bad_header"),          # rank >= nranks
])
def test_authenticated_but_invalid_messages_are_rejected(header, payload, reason):
    with pytest.raises(message.MessageError) as e:
        message.decode(SECRET, [bytes(f) for f in message.encode(SECRET, header, [payload])], CAMPAIGN)
    assert e.value.reason == reason


def test_wrong_secret_is_unauthenticated():
    frames = [bytes(f) for f in message.encode(b"x" * 32, _header(), [np.zeros((4, 3), np.float32)])]
    with pytest.raises(message.MessageError, match="unauthenticated"):
        message.decode(SECRET, frames, CAMPAIGN)


def test_routing_is_stable_balanced_and_moves_little_on_rescale():
    sims = range(4000)
    r4 = [route(s, 4) for s in sims]
    assert r4 == [route(s, 4) for s in sims]
    counts = np.bincount(r4, minlength=4)
    assert counts.min() > 850 and counts.max() < 1150, counts
    moved = sum(route(s, 5) != a for s, a in zip(sims, r4))
    assert 0.15 < moved / 4000 < 0.25  # ~1/5 move to the new rank, nothing else moves
    assert all(route(s, 5) == 4 for s, a in zip(sims, r4) if route(s, 5) != a)
    with pytest.raises(ConfigError, match="n_trainers must be >= 1, got 0"):
        route(1, 0)


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


def _server(n_trainers=1, rank=0, policy="fifo", capacity=64, watermark=1):
    buf = Buffer(BufferConfig(policy=policy, capacity=capacity, watermark=watermark))
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=rank, n_trainers=n_trainers, buffer=buf,
                       config=ServerConfig(param_names=("alpha",), field_names=("T",), end_grace_s=5))
    return srv.start()


def _producers(srv, sim, attempt, field, nranks=2):
    """One producer per simulation rank, splitting ``field`` along x."""
    nx = field.shape[0]
    out = []
    for r in range(nranks):
        x0, x1 = r * nx // nranks, (r + 1) * nx // nranks
        p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=sim, attempt=attempt, rank=r,
                     nranks=nranks, params={"alpha": 0.5}, global_shape=field.shape, offset=(x0, 0),
                     local_shape=(x1 - x0, field.shape[1]))
        out.append((p, slice(x0, x1)))
    return out


def _wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def _send_all(prods, steps, field):
    for step in steps:
        for p, sl in prods:
            p.send(step, 0.1 * step, {"T": field[sl] + step})


def test_server_assembles_dedups_retries_and_ends():
    srv = _server()
    try:
        field = np.random.default_rng(0).random((6, 5)).astype(np.float32)
        # attempt 0 sends steps 1, 2 whole and only rank 0's half of step 3, then "dies"
        a0 = _producers(srv, 0, 0, field)
        _send_all(a0, (1, 2), field)
        a0[0][0].send(3, 0.3, {"T": field[a0[0][1]] + 3})
        _wait(lambda: srv.counters["samples"] == 2 and srv.counters["messages"] == 5)
        assert len(srv._partials) == 1
        # attempt 1 re-sends everything: steps 1, 2 are duplicates, the half of step 3 is discarded
        a1 = _producers(srv, 0, 1, field)
        _send_all(a1, (1, 2, 3), field)
        for p, _ in a1:
            p.close()
        _wait(lambda: srv.counters["samples"] == 3 and srv.counters["messages"] == 13)  # sockets interleave
        a0[1][0].send(3, 0.3, {"T": field[a0[1][1]] + 3})  # a late fragment of the dead attempt
        _wait(lambda: srv.counters["samples"] == 3 and srv.dropped.get("stale_attempt") == 1)
        assert srv.counters["duplicates"] == 2 and srv.counters["partial_discarded"] == 1
        assert sorted(srv.seen) == [(0, 1), (0, 2), (0, 3)]
        got = {s.step: s for s in srv.buffer.get(3)}
        for step in (1, 2, 3):  # assembled from both halves, bit for bit
            np.testing.assert_array_equal(got[step].fields[0], field + step)
            assert got[step].params.tolist() == [0.5] and got[step].t == pytest.approx(0.1 * step)
        assert not srv.buffer.ended
        from hpcml.stream.producer import message as _m  # campaign_done through a raw socket
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(srv.endpoint)
        push.send_multipart(_m.encode(SECRET, {"kind": "campaign_done", "campaign": CAMPAIGN, "completed": [0],
                                               "failed": []}))
        _wait(lambda: srv.buffer.ended)
        push.close()
    finally:
        srv.stop()


def test_server_counts_and_survives_bad_messages():
    srv = _server()
    try:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(srv.endpoint)
        good = [bytes(f) for f in message.encode(SECRET, _header(sim=0, nranks=1), [np.ones((4, 3), np.float32)])]
        push.send_multipart([b"garbage"])                                            # malformed
        push.send_multipart(good[:2] + [b"\0" * 48, good[-1]])                       # tampered: unauthenticated
        push.send_multipart([bytes(f) for f in message.encode(b"z" * 32, _header(sim=0), [np.ones((4, 3), np.float32)])])
        push.send_multipart([bytes(f) for f in message.encode(SECRET, _header(sim=0), [np.ones((2, 3), np.float32)])])
        push.send_multipart(good)
        _wait(lambda: srv.counters["samples"] == 1)
        assert srv.dropped == {"malformed": 1, "unauthenticated": 2, "truncated": 1}
        np.testing.assert_array_equal(srv.buffer.get(1)[0].fields[0], np.ones((4, 3)))
        push.close()
    finally:
        srv.stop()


def test_backpressure_blocks_producers_and_memory_stays_bounded():
    srv = _server(policy="fifo", capacity=2, watermark=1)
    try:
        field = np.zeros((512, 512), np.float32)  # 1 MiB messages
        p = _producers(srv, 0, 0, field, nranks=1)[0][0]
        p.send_timeout_s = 0.5
        p._sock.setsockopt(zmq.SNDTIMEO, 500)
        from hpcml.errors import LaunchError
        sent = 0
        with pytest.raises(LaunchError, match="took no data"):
            for step in range(200):
                p.send(step, 0.0, {"T": field})
                sent += 1
        # blocked after: buffer (2) + the server's held sample (1) + receive and send high-water marks
        # (8 + 4) + what the kernel's loopback socket buffers hold (a few MiB)
        assert len(srv.buffer) == 2 and sent < 24, sent
        assert srv.buffer.get(2) is not None  # room again: the stream resumes
        _wait(lambda: len(srv.buffer) == 2)
    finally:
        srv.stop()


def test_state_round_trip_and_rebalance_to_fewer_trainers():
    srvs = [_server(n_trainers=2, rank=r, policy="firo", capacity=16, watermark=16) for r in range(2)]
    try:
        sims = [s for s in range(8)]
        for s in sims:
            srv = srvs[route(s, 2)]
            field = np.full((4, 4), s, np.float32)
            _send_all(_producers(srv, s, 0, field, nranks=1), (1, 2), field)
        _wait(lambda: sum(v.counters["samples"] for v in srvs) == 16)
        states = [v.state() for v in srvs]
        assert sum(len(st["seen"]) for st in states) == 16
        one = _server(n_trainers=1, rank=0, policy="firo", capacity=32, watermark=1)
        try:
            one.load_state(states)
            assert len(one.seen) == 16 and len(one.buffer) == 16
            field = np.full((4, 4), 3, np.float32)
            _send_all(_producers(one, 3, 1, field, nranks=1), (1, 2, 3), field)  # a retry after the restart
            _wait(lambda: len(one.buffer) == 17)
            assert one.counters.get("duplicates", 0) == 2
            keys = sorted((s.sim, s.step) for s in one.buffer.get(17))
            assert keys == sorted([(s, k) for s in sims for k in (1, 2)] + [(3, 3)])
        finally:
            one.stop()
    finally:
        for v in srvs:
            v.stop()


def test_quiesce_takes_in_what_was_sent_past_capacity_before_a_stop_save():
    """A stop save must hold every sample a finished simulation sent: those still queued
    in the socket when the buffer is full are taken in, past its capacity."""
    srv = _server(policy="fifo", capacity=2, watermark=1)
    try:
        field = np.zeros((64, 64), np.float32)
        p = _producers(srv, 0, 0, field, nranks=1)[0][0]
        for step in range(6):  # 6 samples into a buffer of 2: 4 wait in ZeroMQ's queues
            p.send(step, 0.0, {"T": field + step})
        p.close()  # the simulation finished: everything has left it
        _wait(lambda: len(srv.buffer) == 2)
        srv.quiesce(quiet_s=0.3, timeout_s=10)
        assert len(srv.buffer) == 6 and srv.counters["samples"] == 6
        assert sorted(s.step for s in srv.buffer.get(6)) == list(range(6))
    finally:
        srv.stop()


def test_restore_never_drops_samples_to_fit_the_capacity():
    """Two trainer ranks' buffers restored onto one rank with room for fewer: all come back."""
    srvs = [_server(n_trainers=2, rank=r, policy="fifo", capacity=8, watermark=8) for r in range(2)]
    try:
        for s in range(4):
            field = np.full((4, 4), s, np.float32)
            _send_all(_producers(srvs[route(s, 2)], s, 0, field, nranks=1), (1, 2), field)
        _wait(lambda: sum(len(v.buffer) for v in srvs) == 8)
        states = [v.state() for v in srvs]
    finally:
        for v in srvs:
            v.stop()
    one = _server(n_trainers=1, rank=0, policy="fifo", capacity=4, watermark=1)
    try:
        one.load_state(states)
        assert len(one.buffer) == 8 and one.counters["samples"] == 8  # counters follow what this rank owns
    finally:
        one.stop()
    again = [_server(n_trainers=2, rank=r, policy="fifo", capacity=8, watermark=8) for r in range(2)]
    try:
        for v in again:  # the same trainer count: each rank's own counters continue
            v.load_state(states)
        assert [v.counters["samples"] for v in again] == [st.counters["samples"] for st in srvs]
    finally:
        for v in again:
            v.stop()


@pytest.mark.parametrize("policy", ["fifo", "firo", "reservoir"])
def test_a_stop_keeps_the_batch_a_rank_held(policy):
    """The loader stops on a request (in its per-step agreement; here one rank, COMM_SELF)
    and the batch it had taken goes back into the buffer: the stop save holds it."""
    from mpi4py import MPI

    from hpcml.stream import StreamLoader

    srv = _server(policy=policy, capacity=8, watermark=1)
    try:
        field = np.zeros((4, 4), np.float32)
        _send_all(_producers(srv, 0, 0, field, nranks=1), (1, 2, 3, 4, 5), field)
        _wait(lambda: len(srv.buffer) == 5)
        asked = {"stop": False}
        loader = StreamLoader(srv, MPI.COMM_SELF, 2, should_stop=lambda: asked["stop"])
        trained = loader.next_batch()
        assert trained is not None and not loader.stopped
        asked["stop"] = True
        assert loader.next_batch() is None and loader.stopped  # a stream that has not ended
        kept = {(s.sim, s.step) for s in srv.buffer._items}
        left = {(0, k) for k in range(1, 6)} - ({(s.sim, s.step) for s in trained} if policy != "reservoir" else set())
        assert kept == left  # nothing taken and untrained is lost
        assert srv.buffer.stats.served == 2 and srv.buffer.stats.batches == 1
    finally:
        srv.stop()
