"""Issue 24: what one producer connection -- a peer holding the campaign secret -- can make a
stream server hold outside the training buffer, in bytes (:mod:`hpcml.stream.budget`).

Real ZeroMQ over loopback, no fakes: messages queued while the buffer is full are capped per
connection (measured as the server process's resident memory, in a fresh interpreter each),
incomplete samples are charged to the connection that opened them and dropped past its
budget, and an honest simulation still delivers every sample exactly once beside an abuser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from hpcml.errors import ConfigError
from hpcml.stream import Buffer, BufferConfig, Producer, message, transport
from hpcml.stream.assembly import Assembler, sample_bytes
from hpcml.stream.server import ServerConfig, StreamServer

SECRET = b"k" * 32
CAMPAIGN = "budget"
ROOT = Path(__file__).resolve().parents[2]
HEADER = message.MAX_HEADER_BYTES + len(message.MAGIC) + message.MAC_BYTES
"""What a message may carry besides its fields."""


def _wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def _header(**kw) -> dict:
    return {"kind": "data", "campaign": CAMPAIGN, "sim": 0, "attempt": 0, "rank": 0, "nranks": 1, "step": 0,
            "t": 0.0, "global_shape": [1], "offset": [0], "shape": [1], "fields": [["T", "float32"]],
            "params": {"alpha": 0.5}, **kw}


# -- the limits, from the config alone ------------------------------------------------------------
def test_limits_are_sized_from_the_schema_and_the_budget():
    two = ServerConfig(field_names=("T", "U"), shape=(64, 64))  # a field of the grid in float64: 32 KiB
    lim = two.limits
    assert (lim.frame_bytes, lim.message_bytes) == (65536, 2 * 32768 + HEADER)  # a header frame is larger
    assert (lim.depth, lim.peer_bytes, lim.queued_bytes) == (8, 8 * lim.message_bytes, 8 * lim.message_bytes)
    three = ServerConfig(field_names=("T", "U"), shape=(64, 64), max_peer_bytes=3 * lim.message_bytes + 5)
    assert (three.limits.depth, three.limits.peer_bytes) == (3, 3 * lim.message_bytes + 5)
    # no shape: the largest sample max_sample_bytes lets in, as one float64 block; max_frame_bytes caps it
    free = ServerConfig(field_names=("T",), max_sample_bytes=1 << 20, max_partial_bytes=1 << 20).limits
    assert (free.frame_bytes, free.message_bytes, free.depth) == (2 << 20, (2 << 20) + HEADER, 8)
    capped = ServerConfig(field_names=("T",), max_frame_bytes=1 << 19, max_sample_bytes=1 << 20).limits
    assert (capped.frame_bytes, capped.message_bytes) == (1 << 19, (1 << 19) + HEADER)


@pytest.mark.parametrize("kw, error", [
    (dict(max_peer_bytes=1000), f"ServerConfig.max_peer_bytes=1000 holds fewer than 2 messages of {32768 + HEADER} "
                                f"bytes (the largest valid one: 1 field(s) of 32768 bytes and a header of up to 65536):"
                                f" expected at least {2 * (32768 + HEADER)}"),
    (dict(max_peer_bytes=0), "ServerConfig.max_peer_bytes=0: expected None or an integer number of bytes in 1..2**62"),
    (dict(hwm=1), "ServerConfig needs 0 <= port < 65536, hwm >= 2, end_grace_s >= 0; got 0, 1, 30.0"),
])
def test_a_budget_that_cannot_hold_two_messages_is_refused_with_its_numbers(kw, error):
    with pytest.raises(ConfigError) as e:
        ServerConfig(field_names=("T",), shape=(64, 64), **kw)
    assert str(e.value) == error


def test_hwm_2_delivers_every_message():
    """libzmq's credential message takes one receive slot of an authenticated connection for good:
    RCVHWM 1 delivered nothing at all, so the least hwm is 2 (and it delivers)."""
    srv = _server(hwm=2)
    ctx = zmq.Context()
    try:
        push = transport.push_socket(ctx, SECRET)
        push.connect(srv.endpoint)
        for step in range(50):
            push.send_multipart(message.encode(SECRET, _header(step=step), [np.full(1, step, np.float32)]))
        _wait(lambda: srv.counters["samples"] == 50)
        assert sorted(s.step for s in srv.buffer.get(50)) == list(range(50)) and srv.dropped == {}
    finally:
        ctx.destroy(linger=0)
        srv.stop()


# -- incomplete samples: charged to the connection that opened them ------------------------------
def test_assembler_charges_the_opener_and_evicts_from_the_largest_holder():
    n = 8 * 8
    evicted = []
    asm = Assembler(1, max_bytes=4 * 5 * n, timeout_s=60, peer_bytes=3 * 5 * n,
                    on_evict=lambda key, p, why: evicted.append((key, p.peer)))
    half = dict(nranks=2, global_shape=(8, 8), shape=(4, 8), t=0.0, params=np.zeros(1, np.float32),
                arrays=[np.ones((4, 8), np.float32)])
    assert asm.add((9, 0, 0), rank=0, offset=(0, 0), peer="honest", **half) is None  # the oldest of all
    for step in range(3):
        assert asm.add((1, 0, step), rank=0, offset=(0, 0), peer="abuser", **half) is None
    assert asm.held == {"honest": sample_bytes(1, (8, 8)), "abuser": 3 * 5 * n} and asm.nbytes == 4 * 5 * n
    with pytest.raises(message.MessageError, match=r"^peer_budget: connection abuser holds 960 bytes of incomplete "
                                                   r"samples, another of 320 would pass max_peer_bytes=960$"):
        asm.add((1, 0, 3), rank=0, offset=(0, 0), peer="abuser", **half)
    assert len(asm) == 4 and evicted == []  # refused before anything was allocated or evicted
    # the memory bound: the largest holder's oldest goes, not the honest peer's older sample
    assert asm.add((2, 0, 0), rank=0, offset=(0, 0), peer="other", **half) is None
    assert evicted == [((1, 0, 0), "abuser")] and asm.held["abuser"] == 2 * 5 * n
    # a block of another connection completes the honest sample: the opener's charge is released
    assert asm.add((9, 0, 0), rank=1, offset=(4, 0), peer="rank1", **half) is not None
    assert "honest" not in asm.held and "rank1" not in asm.held and asm.nbytes == sum(asm.held.values()) == 3 * 5 * n


def test_an_abusive_peer_is_capped_and_an_honest_simulation_delivers_every_sample_once():
    """One authenticated connection opens 30 incomplete samples of the whole grid with half
    blocks; a two-rank simulation streams 8 steps beside it. The abuser holds exactly what its
    budget fits (12 samples), the other 18 blocks are dropped and counted, and every honest
    sample arrives once, bit for bit, none evicted (its ranks' connections have budgets of
    their own)."""
    shape, steps = (128, 128), range(8)
    whole = sample_bytes(1, shape)  # 81,920 bytes held per incomplete sample
    budget = 12 * whole + 100
    srv = _server(shape=shape, max_peer_bytes=budget, capacity=64)
    ctx = zmq.Context()
    try:
        abuser = transport.push_socket(ctx, SECRET, hwm=100)
        abuser.connect(srv.endpoint)
        for step in range(30):
            abuser.send_multipart(message.encode(SECRET, _header(sim=7, step=step, nranks=2, global_shape=list(shape),
                                                                 offset=[0, 0], shape=[64, 128]),
                                                 [np.ones((64, 128), np.float32)]))
        _wait(lambda: srv.counters["messages"] == 30)
        ranks = [Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=3, attempt=0, rank=r,
                          nranks=2, params={"alpha": 0.25}, global_shape=shape, offset=(64 * r, 0),
                          local_shape=(64, 128)) for r in range(2)]
        fields = {step: np.arange(128 * 128, dtype=np.float32).reshape(shape) + step for step in steps}
        for step in steps:
            for r, p in enumerate(ranks):
                p.send(step, step / 10, {"T": fields[step][64 * r:64 * r + 64]})
        for p in ranks:
            p.close()
        _wait(lambda: srv.counters["samples"] == len(steps))
        assert srv.dropped == {"peer_budget": 30 - 12}
        assert list(srv.ingest.assembly.held.values()) == [12 * whole] and 12 * whole <= budget
        assert srv.stats()["peers"]["partial_bytes_max"] == 12 * whole
        assert sorted(srv.seen) == [(3, s) for s in steps] and srv.counters["duplicates"] == 0
        for s in srv.buffer.get(len(steps)):
            np.testing.assert_array_equal(s.fields[0], fields[s.step])
        assert srv.buffer.get(1) is None
    finally:
        ctx.destroy(linger=0)
        srv.stop()


# -- messages queued inside ZeroMQ while the buffer is full --------------------------------------
def _queue_scenario(conns: int, frame: int, peer_bytes: int | None) -> dict:
    """In a fresh interpreter (clean resident memory): a server whose buffer is full, ``conns``
    connections of one peer queueing ``frame``-byte messages until ZeroMQ blocks them all; then
    the buffer frees and every queued message must be read once and dropped."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    srv = _server(max_frame_bytes=frame, max_sample_bytes=frame, max_partial_bytes=frame, max_peer_bytes=peer_bytes,
                  capacity=1)
    ctx = zmq.Context()
    try:
        plug = transport.push_socket(ctx, SECRET)  # one sample to fill the buffer, one the server then holds
        plug.connect(srv.endpoint)
        for step in range(2):
            plug.send_multipart(message.encode(SECRET, _header(step=step), [np.ones(1, np.float32)]))
        _wait(lambda: srv.counters["samples"] == 2)
        rss0, peak, sent = rss(), 0, 0
        payload = np.ones(frame // 4, np.float32)  # sent without a copy: the senders add nothing here
        socks = [transport.push_socket(ctx, SECRET, hwm=1) for _ in range(conns)]
        for s in socks:
            s.connect(srv.endpoint)
        last = [time.monotonic()] * conns
        while min(time.monotonic() - t for t in last) < 2.0:  # until every connection is blocked for 2 s
            for i, s in enumerate(socks):
                frames = message.encode(SECRET, _header(sim=1, step=sent, global_shape=[frame // 4],
                                                        shape=[frame // 4]), [payload])
                try:
                    s.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    sent, last[i] = sent + 1, time.monotonic()
                except zmq.Again:
                    time.sleep(0.005)
            peak = max(peak, rss() - rss0)
        time.sleep(0.3)
        peak = max(peak, rss() - rss0)
        srv.buffer.get(1)  # room: the held sample goes in, the queued messages are read
        _wait(lambda: srv.dropped.get("wrong_shape", 0) == sent)  # another grid than the first sample's
        time.sleep(0.2)
        lim = srv.limits
        return {"growth": peak, "sent": sent, "dropped": srv.dropped, "messages": srv.counters["messages"],
                "depth": lim.depth, "peer_bytes": lim.peer_bytes, "message_bytes": lim.message_bytes}
    finally:
        ctx.destroy(linger=0)
        srv.stop()


def _run_scenario(conns: int, frame: int, peer_bytes: int | None) -> dict:
    code = (f"import json; from tests.unit.test_stream_budget import _queue_scenario; "
            f"print(json.dumps(_queue_scenario({conns}, {frame}, {peer_bytes})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_queued_bytes_per_connection_are_capped_while_the_buffer_is_full():
    """The issue's attack, scaled down: 6 connections of 1 MiB messages while the buffer is full.
    With hwm 8 and no budget each connection queues 7 messages (~44 MiB); with the least
    budget (two messages, 2.1 MiB) one each (~7.6 MiB), never more than connections x budget. Every queued message is read once the buffer frees and dropped, none twice."""
    conns, frame = 6, 1 << 20
    before = _run_scenario(conns, frame, None)
    least = 2 * (frame + HEADER)
    after = _run_scenario(conns, frame, least)
    assert (before["depth"], after["depth"], after["peer_bytes"]) == (8, 2, least)
    for run in (before, after):  # each queued message read exactly once, after the plug's two samples
        assert run["dropped"] == {"wrong_shape": run["sent"]} and run["messages"] == run["sent"] + 2
    assert after["growth"] <= conns * after["peer_bytes"], after
    assert before["growth"] >= conns * 5 * frame, before  # what the budget takes away: ~7 messages each
    assert after["growth"] <= before["growth"] / 3, (before, after)
    print(f"\nqueued while full, {conns} connections of {frame >> 20} MiB messages: hwm 8 "
          f"{before['growth'] / 2**20:.1f} MiB, budget {least / 2**20:.2f} MiB/connection "
          f"{after['growth'] / 2**20:.1f} MiB (bound {conns * least / 2**20:.1f} MiB)")


def _server(*, capacity: int = 64, **kw) -> StreamServer:
    cfg = ServerConfig(param_names=("alpha",), field_names=("T",), **kw)
    return StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1,
                        buffer=Buffer(BufferConfig(policy="fifo", capacity=capacity, watermark=1)), config=cfg).start()


def test_train_surrogate_passes_the_grid_to_the_server_and_it_bounds_a_connection():
    """``train_surrogate(shape=)`` reaches ``ServerConfig.shape``; with it a connection's budget
    is a few samples of that grid, without it ``hwm`` samples of ``max_sample_bytes``."""
    from hpcml.train.surrogate_job import _with_shape

    assert _with_shape({"end_grace_s": 10.0}, (64, 32)) == {"end_grace_s": 10.0, "shape": (64, 32)}
    assert _with_shape({"shape": (8, 8)}, (64, 32)) == {"shape": (8, 8)}  # the server's own wins
    assert _with_shape(None, None) == {}
    with pytest.raises(ConfigError, match=r"^train_surrogate\(shape=\['a'\]\): expected the grid as integers$"):
        _with_shape(None, ["a"])
    bounded = ServerConfig(field_names=("T",), param_names=("k",), **_with_shape(None, (64, 32))).limits
    open_ = ServerConfig(field_names=("T",), param_names=("k",)).limits
    assert bounded.peer_bytes <= 8 * (64 * 32 * 8 + HEADER), bounded
    assert open_.peer_bytes >= 8 << 30, open_
