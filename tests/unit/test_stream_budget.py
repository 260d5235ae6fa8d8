"""Issue 24: what one producer connection -- a peer holding the campaign secret -- can make a
stream server hold outside the training buffer, in bytes (:mod:`hpcml.stream.budget`).

Real sockets over loopback, no fakes: what a connection makes the server hold while the buffer is
full is capped per connection, whatever it sends -- valid messages, or messages announcing more
and larger frames than a valid one (measured as the server process's resident memory, in a
fresh interpreter, the attacker in another process) --
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

from hpcml.errors import ConfigError
from hpcml.stream import Buffer, BufferConfig, Producer, budget, message
from hpcml.stream.assembly import Assembler, sample_bytes
from hpcml.stream.sender import Sender
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
    def queued(lim) -> int:  # one message, its frames aligned
        return lim.message_bytes + 64 * message.MAX_FRAMES

    two = ServerConfig(field_names=("T", "U"), shape=(64, 64))  # a field of the grid in float64: 32 KiB
    lim = two.limits
    assert (lim.frame_bytes, lim.message_bytes) == (65536, 2 * 32768 + HEADER)  # a header frame is larger
    assert lim.peer_bytes == 8 * lim.message_bytes and lim.held_bytes == budget.HELD_BYTES == 256 << 20
    assert lim.queued_bytes == queued(lim) < 2 * 1024 * 1024
    two_msgs = 2 * (2 * 2048 + HEADER) + 5  # 16 x 16 x 2 fields in float64: 4 KiB a message besides its header
    least = ServerConfig(field_names=("T", "U"), shape=(16, 16), max_peer_bytes=two_msgs)
    assert (least.limits.peer_bytes, least.limits.messages) == (two_msgs, 2)
    # no shape: the largest sample max_sample_bytes lets in, as one float64 block; max_frame_bytes caps it
    free = ServerConfig(field_names=("T",), max_sample_bytes=1 << 20, max_partial_bytes=1 << 20).limits
    assert (free.frame_bytes, free.message_bytes) == (2 << 20, (2 << 20) + HEADER)
    assert free.queued_bytes == queued(free)
    capped = ServerConfig(field_names=("T",), max_frame_bytes=1 << 19, max_sample_bytes=1 << 20).limits
    assert (capped.frame_bytes, capped.message_bytes) == (1 << 19, (1 << 19) + HEADER)


@pytest.mark.parametrize("kw, error", [
    (dict(max_peer_bytes=1000), f"ServerConfig.max_peer_bytes=1000 holds fewer than 2 messages of {32768 + HEADER} "
                                f"bytes (the largest valid one: 1 field(s) of 32768 bytes and a header of up to 65536):"
                                f" expected at least {2 * (32768 + HEADER)}"),
    (dict(max_peer_bytes=0), "ServerConfig.max_peer_bytes=0: expected None or an integer number of bytes in 1..2**62"),
    (dict(hwm=1), "ServerConfig needs 0 <= port < 65536, hwm >= 2, end_grace_s >= 0; got 0, 1, 30.0"),
    (dict(max_held_bytes=1000), f"ServerConfig.max_held_bytes=1000 holds fewer than 2 messages of "
                                f"{32768 + HEADER + 64 * message.MAX_FRAMES} bytes (the largest valid one, aligned): "
                                f"expected at least {2 * (32768 + HEADER + 64 * message.MAX_FRAMES)}"),
])
def test_a_budget_that_cannot_hold_two_messages_is_refused_with_its_numbers(kw, error):
    with pytest.raises(ConfigError) as e:
        ServerConfig(field_names=("T",), shape=(64, 64), **kw)
    assert str(e.value) == error


def test_hwm_2_delivers_every_message():
    """The least budget, two messages (a read-ahead of a few chunks), delivers every message."""
    srv = _server(hwm=2)
    push = Sender(SECRET)
    try:
        push.connect(srv.endpoint)
        for step in range(50):
            push.send_multipart(message.encode(SECRET, _header(step=step), [np.full(1, step, np.float32)]))
        _wait(lambda: srv.counters["samples"] == 50)
        assert sorted(s.step for s in srv.buffer.get(50)) == list(range(50)) and srv.dropped == {}
    finally:
        push.close(linger=0)
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
    abuser = Sender(SECRET, hwm=100)
    try:
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
        abuser.close(linger=0)
        srv.stop()


# -- what a connection holds while the buffer is full, whatever it sends --------------------------
ATTACK = """
import sys, time, zmq, numpy as np
from hpcml.stream import message
from hpcml.stream.handshake import HandshakeError
from hpcml.stream.sender import Sender
from tests.unit.test_stream_budget import SECRET, _header
endpoint, conns, frame, attack = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
n = frame // 4
if attack in ("valid", "stranger"):  # the largest valid message, on another grid than the first sample's
    frames = message.encode(SECRET, _header(sim=1, global_shape=[n], shape=[n]), [np.ones(n, np.float32)])
else:  # MAX_FRAMES frames of the largest frame each: MAX_FRAMES - 2 times a valid message
    frames = [message.MAGIC, b"{}"] + [np.ones(n, np.float32)] * (message.MAX_FRAMES - 3) + [bytes(16)]
socks = [Sender(SECRET if attack != "stranger" else b"s" * 32, hwm=1) for _ in range(conns)]
for s in socks:
    s.connect(endpoint)
sent, last = 0, [time.monotonic()] * conns
while min(time.monotonic() - t for t in last) < 2.0:  # until every connection is blocked for 2 s
    for i, s in enumerate(socks):
        try:
            s.send_multipart(frames, zmq.NOBLOCK)
            sent, last[i] = sent + 1, time.monotonic()
        except (zmq.Again, HandshakeError):
            time.sleep(0.005)
print(sent, flush=True)
sys.stdin.read()  # stay connected until the server has read everything
"""


def _queue_scenario(conns: int, frame: int, attack: str) -> dict:
    """In a fresh interpreter (clean resident memory): a server whose buffer is full, and another
    process with ``conns`` connections queueing ``attack`` messages until all of them are
    blocked; then the buffer frees and every queued message must be read once and dropped."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    srv = _server(max_frame_bytes=frame, max_sample_bytes=frame, max_partial_bytes=frame, capacity=1)
    plug = Sender(SECRET)  # one sample to fill the buffer, one the server then holds
    child = None
    try:
        plug.connect(srv.endpoint)
        for step in range(2):
            plug.send_multipart(message.encode(SECRET, _header(step=step), [np.ones(1, np.float32)]))
        _wait(lambda: srv.counters["samples"] == 2)
        rss0, peak = rss(), 0
        child = subprocess.Popen([sys.executable, "-c", ATTACK, srv.endpoint, str(conns), str(frame), attack],
                                 cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        os.set_blocking(child.stdout.fileno(), False)
        out, t0 = b"", time.monotonic()
        while not out.endswith(b"\n"):
            assert child.poll() is None and time.monotonic() - t0 < 60, child.returncode
            try:
                out += os.read(child.stdout.fileno(), 100)
            except BlockingIOError:
                pass
            peak = max(peak, rss() - rss0)
            time.sleep(0.01)
        time.sleep(0.3)
        peak = max(peak, rss() - rss0)
        held = srv._rx.held_bytes()
        sent = int(out)
        srv.buffer.get(1)  # room: the held sample goes in, the queued messages are read
        reason = {"valid": "wrong_shape", "many_frames": "oversized"}.get(attack)
        _wait(lambda: srv.dropped.get(reason, 0) == sent if reason else srv._rx.refused >= conns, timeout=30)
        time.sleep(0.2)
        lim = srv.limits
        return {"growth": peak, "sent": sent, "dropped": srv.dropped, "messages": srv.counters["messages"],
                "held_while_full": held, "queued_bytes": lim.queued_bytes,
                "refused": srv._rx.refused,
                "message_bytes": lim.message_bytes}
    finally:
        if child is not None:
            child.kill()
            child.wait()
        plug.close(linger=0)
        srv.stop()


def _run_scenario(conns: int, frame: int, attack: str) -> dict:
    code = (f"import json; from tests.unit.test_stream_budget import _queue_scenario; "
            f"print(json.dumps(_queue_scenario({conns}, {frame}, {attack!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("attack", ["valid", "many_frames", "stranger"])
def test_what_a_connection_holds_while_the_buffer_is_full_is_capped_whatever_it_sends(attack):
    """The issue's attack, scaled down: 6 connections of 1 MiB messages while the buffer is full,
    valid ones or ones of 19 frames of 1 MiB (which libzmq's own multipart messages would have
    held whole: +576 MiB at 4 MiB frames before), or valid ones without the secret. The server's
    memory grows by at most connections x ``queued_bytes`` (a stranger's by its answer alone);
    every queued message is read once the buffer frees and dropped, none twice, and every
    stranger refused."""
    conns, frame = 6, 1 << 20
    run = _run_scenario(conns, frame, attack)
    if attack == "stranger":
        assert run["dropped"] == {} and run["refused"] >= conns and run["messages"] == 2, run
        assert run["growth"] <= 8 << 20, run
        return
    reason = "wrong_shape" if attack == "valid" else "oversized"
    assert run["dropped"] == {reason: run["sent"]} and run["sent"] >= conns, run
    # decoded messages: the plug's two samples and, when valid, every queued one (refused ones never are)
    assert run["messages"] == 2 + (run["sent"] if attack == "valid" else 0), run
    assert run["growth"] <= conns * run["queued_bytes"] + (8 << 20), run
    assert run["held_while_full"] <= conns * run["message_bytes"] * (attack == "valid"), run
    print(f"\nheld while full, {conns} connections of {frame >> 20} MiB {attack} messages: "
          f"{run['growth'] / 2**20:.1f} MiB (bound {conns * run['queued_bytes'] / 2**20:.1f} MiB)")


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
