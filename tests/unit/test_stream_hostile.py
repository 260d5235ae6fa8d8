"""A real StreamServer thread under hostile input and faults, over loopback ZeroMQ.

The fuzz test sends >= 10,000 messages -- random frames, truncated and re-MAC'd ones,
wrong MACs, many-frame messages, oversized frames, every poison header the attack found
(authenticated), incomplete samples that never finish, replays, and peers without the
secret -- interleaved with valid simulation output, and checks: the thread never dies,
every bad message is dropped exactly once with a reason, no bad message becomes a sample,
the valid samples arrive bit for bit, and the server's memory stays bounded.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from hpcml.errors import ConfigError, LaunchError
from hpcml.stream import Buffer, BufferConfig, framing, handshake, message, reading, transport
from hpcml.stream.handshake import HandshakeError
from hpcml.stream.sender import Sender
from hpcml.stream.server import ServerConfig, StreamServer

SECRET = b"s" * 32
CAMPAIGN = "fuzz"
SHAPE = (8, 6)
SERVER_DROPS = frozenset({"missing_params", "too_large", "wrong_fields", "misrouted", "stale_attempt", "bad_fragment",
                          "incomplete_cover", "internal_error", "partial_evicted", "wrong_shape"})
"""Drops of messages that decoded: they count as messages too."""
VALID_SIMS = range(40)
STEPS = range(12)
RSS_BOUND = 64 << 20
"""Growth of the test process's resident memory allowed over the whole fuzz run."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _header(**kw) -> dict:
    h = {"kind": "data", "campaign": CAMPAIGN, "sim": 1000, "attempt": 0, "rank": 0, "nranks": 1, "step": 0,
         "t": 0.5, "global_shape": list(SHAPE), "offset": [0, 0], "shape": list(SHAPE),
         "fields": [["T", "float32"]], "params": {"alpha": 0.25}}
    h.update(kw)
    return h


def _signed(header: dict, payloads=None, secret: bytes = SECRET) -> list[bytes]:
    """Frames MAC'd with ``secret`` (json.dumps writes NaN/Infinity as the attack would)."""
    if payloads is None:
        payloads = [np.zeros(SHAPE, np.float32)]
    text = json.dumps({**header, "nonce": os.urandom(16).hex()}).encode()
    frames = [message.MAGIC, text] + [np.ascontiguousarray(p).tobytes() for p in payloads]
    return frames + [message.mac(secret, frames)]


def _field(sim: int, step: int) -> np.ndarray:
    return (np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1000 * sim + step) / 7


# every header the attack found to break the server, and the others like them: all invalid
POISON = [
    _header(fields=[["u"]]), _header(fields=["u"]), _header(fields=[5]), _header(fields=[["u", "float32", "x"]]),
    _header(fields=[["T", "float16"]]), _header(fields=[[5, "float32"]]), _header(fields="T"), _header(fields=[]),
    _header(fields=[["T", "float32"], ["T", "float32"]]),
    _header(nranks=2, global_shape=[10**6, 10**6, 10**6], offset=[0, 0, 0], shape=[1, 1, 1]),  # np.empty bomb
    _header(nranks=2, global_shape=[10**12], offset=[0], shape=[48]),
    _header(sim=2**64), _header(sim=-1), _header(sim=1.5), _header(sim="3"), _header(sim=None), _header(sim=True),
    _header(step=10**30), _header(step=2**53), _header(step=-2), _header(attempt=2**64), _header(attempt=[0]),
    _header(t=float("nan")), _header(t=float("inf")), _header(t=-float("inf")), _header(t="0.5"), _header(t=None),
    _header(params={"alpha": float("nan")}), _header(params={"alpha": float("inf")}), _header(params={"alpha": "x"}),
    _header(params=[0.25]), _header(params={"alpha": True}), _header(params={"beta": 1.0}),  # missing alpha
    _header(nranks=0), _header(nranks=2**21), _header(nranks=10**30), _header(rank=1), _header(rank=-1),
    _header(global_shape=[], offset=[], shape=[]), _header(global_shape=[2] * 4, offset=[0] * 4, shape=[2] * 4),
    _header(global_shape=[8, "6"]), _header(global_shape=[8, 0]), _header(offset=[0]), _header(offset=[1, 0]),
    _header(shape=[8, 7]), _header(offset=[-1, 0]), _header(global_shape={"a": 1}),
    _header(kind="exec"), _header(kind=None), _header(kind=["data"]), _header(campaign="other"),
    _header(campaign=None), _header(kind="end", n_sent=-1), _header(kind="end", n_sent=10**30),
    {"kind": "campaign_done", "campaign": CAMPAIGN, "completed": [0], "failed": []},  # not a message kind (a file)
    {"campaign": CAMPAIGN},
]
RAW_HEADERS = [b"[]", b'"x"', b"5", b"null", b"{", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"sim": 1e999}',
               b'{"kind": "data", "sim": ' + b"9" * 5000 + b"}", b'{"kind": NaN}']


def _hostile(rng: np.random.Generator, i: int, sealed: bool = True) -> list[bytes]:
    """One bad message (category by ``i``), every one dropped with exactly one reason. ``sealed``:
    the server requires a MAC on every message (else a message without one is a valid message
    from a connection that proved the secret: cut short, it is cut in its payload too)."""
    kind = i % 8
    if kind == 0:  # random frames
        return [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 7)))]
    if kind == 1:  # a valid message cut short: a frame, payload bytes or the MAC removed
        f = _signed(_header(sim=int(rng.integers(1000, 2000))))
        cut = int(rng.integers(3))
        return [f[0], f[1], f[-1]] if cut == 0 else [f[0], f[1], f[2][:-4], f[-1]] if cut == 1 else \
            f[:-1] if sealed else [f[0], f[1], f[2][:-4]]
    if kind == 2:  # wrong MAC, or the wrong secret
        f = _signed(_header(sim=int(rng.integers(1000, 2000))), secret=b"z" * 32 if i % 16 == 2 else SECRET)
        return f if i % 16 == 2 else f[:-1] + [rng.bytes(16)]
    if kind in (3, 4):  # authenticated poison, with the payload its shape says where it says one
        h = POISON[i // 8 % len(POISON)]
        shape = h.get("shape")
        ok = isinstance(shape, list) and all(type(x) is int and 0 < x for x in shape) and math.prod(shape) < 4096
        return _signed(h, [np.zeros(shape if ok else SHAPE, np.float32)])
    if kind == 5:  # authenticated raw headers that are not the JSON asked for
        frames = [message.MAGIC, RAW_HEADERS[i // 8 % len(RAW_HEADERS)], np.zeros(SHAPE, np.float32).tobytes()]
        return frames + [message.mac(SECRET, frames)]
    if kind == 6:  # the header is fine, the payload is not what it says
        f = _signed(_header(sim=int(rng.integers(1000, 2000))), [np.zeros((8, 5), np.float32)])
        return f
    return [message.MAGIC] + [b""] * int(rng.integers(20, 400))  # many frames


@pytest.mark.parametrize("integrity", ["connection", "message"])
def test_fuzz_server_drops_every_bad_message_and_keeps_every_good_one(integrity):
    """``connection`` (the default): valid messages come without a MAC, as a Producer sends them
    to such a server; ``message``: every message must carry one."""
    cfg = ServerConfig(param_names=("alpha",), field_names=("T",), hwm=1000, end_grace_s=5, integrity=integrity,
                       max_frame_bytes=1 << 18, max_sample_bytes=1 << 20, max_partial_bytes=1 << 22)
    sealed = integrity == "message"
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1,
                       buffer=Buffer(BufferConfig(policy="fifo", capacity=10**5, watermark=0)), config=cfg).start()
    rss0 = _rss()
    ctx = zmq.Context()
    rng = np.random.default_rng(12)
    push = Sender(SECRET, hwm=0)  # hwm 0: never blocks, the order on one connection is kept
    push.connect(srv.endpoint)
    strangers = [ctx.socket(zmq.PUSH), Sender(b"y" * 32, hwm=1), Sender(SECRET, hwm=1)]
    strangers[2]._key = b"wrong".ljust(32)  # no secret: its answer is refused
    strangers[0].setsockopt(zmq.LINGER, 0)
    for s in strangers:
        s.connect(srv.endpoint)
    senders = [push, *strangers[1:]]
    try:
        sent = {"valid": 0, "hostile": 0, "replays": 0, "partial": 0, "stranger": 0, "oversized": 0}
        valid, replays, n = {}, [], 0
        for sim in VALID_SIMS:
            for step in STEPS:
                a, nr = _field(sim, step), 1 + sim % 2  # odd simulations: two ranks, split along x
                for r in range(nr):
                    lo, hi = r * SHAPE[0] // nr, (r + 1) * SHAPE[0] // nr
                    f = _signed(_header(sim=sim, step=step, t=step / 10, rank=r, nranks=nr, offset=[lo, 0],
                                        shape=[hi - lo, SHAPE[1]], params={"alpha": sim / 100}), [a[lo:hi]])
                    f = f if sealed or r % 2 else f[:-1]  # connection: with and without a MAC, both taken
                    push.send_multipart(f)
                    sent["valid"] += 1
                    if nr == 1 and step % 3 == 0:
                        replays.append(f)
                valid[sim, step] = a
                for _ in range(20):  # twenty bad ones after every good sample
                    push.send_multipart(_hostile(rng, n, sealed))
                    sent["hostile"] += 1
                    n += 1
                if step == 5:  # half a sample on another grid than the training's: refused (wrong_shape)
                    push.send_multipart(_signed(_header(sim=5000 + sim, step=step, nranks=2, rank=0,
                                                        global_shape=[256, 256], shape=[128, 256], offset=[0, 0]),
                                                [np.zeros((128, 256), np.float32)]))
                    sent["partial"] += 1
                try:  # valid messages, but no secret to answer the challenge: never delivered
                    strangers[n % 3].send_multipart(_signed(_header(sim=sim, step=100 + step)), zmq.NOBLOCK)
                    sent["stranger"] += 1
                except (zmq.Again, HandshakeError):
                    pass
        for k in range(4):  # raw TCP: 2 MB of junk, or a ZMTP greeting without the handshake, then frames
            host, port = srv.endpoint[len("tcp://"):].rsplit(":", 1)
            with socket.create_connection((host, int(port))) as raw:
                raw.settimeout(2)
                greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 16 + b"\0" + b"\0" * 31
                junk = greeting + b"\x01\x00" * (1 << 20) if k % 2 else os.urandom(2 << 20)
                try:
                    raw.sendall(junk)
                except OSError:  # the server hung up on it: what should happen
                    pass
            sent["stranger"] += 1
        big = Sender(SECRET)  # past max_frame_bytes: refused before a byte of it is kept
        big.connect(srv.endpoint)
        senders.append(big)
        for k in range(5):
            big.send_multipart(_signed(_header(sim=7000 + k, global_shape=[1 << 17], offset=[0], shape=[1 << 17]),
                                       [np.zeros(1 << 17, np.float32)]), zmq.NOBLOCK)
            sent["oversized"] += 1
        for f in replays:
            push.send_multipart(f)
        sent["replays"] = len(replays)
        push.send_multipart([message.MAGIC] + [b""] * 100_000)  # one message of 100,000 frames
        sent["hostile"] += 1
        t_last = time.perf_counter()
        received = sent["valid"] + sent["hostile"] + sent["partial"] + sent["replays"] + sent["oversized"]
        deadline = time.monotonic() + 120
        decode_drops = lambda: sum(v for k, v in srv.dropped.items() if k not in SERVER_DROPS)  # noqa: E731
        while srv.counters["messages"] + decode_drops() < received:
            assert time.monotonic() < deadline and srv._thread.is_alive(), (srv.counters, srv.dropped)
            time.sleep(0.05)
        time.sleep(0.5)  # anything else (strangers) would have arrived by now
        total = sum(sent.values())
        assert total >= 10_000, sent
        # the thread lives, nothing hostile was counted as data, each bad message dropped once
        assert srv._thread.is_alive() and srv.error is None
        drops = {k: v for k, v in srv.dropped.items() if k != "partial_evicted"}
        assert sum(drops.values()) == sent["hostile"] + sent["partial"] + sent["oversized"] and \
            "internal_error" not in drops, (drops, sent)
        assert drops["oversized"] == sent["oversized"] and srv._rx.refused >= 3 + 4, (drops, srv._rx.refused)
        late = sum(v for k, v in drops.items() if k in SERVER_DROPS)
        assert srv.counters["messages"] - late == sent["valid"] + sent["replays"]
        assert srv.counters["samples"] == len(valid) and srv.counters["duplicates"] == len(replays)
        assert sorted(srv.seen) == sorted(valid)
        assert drops["too_many_frames"] == n // 8 + 1
        assert {"malformed", "unauthenticated", "bad_header", "truncated", "wrong_campaign", "wrong_shape",
                "missing_params"} <= set(drops), drops
        # blocks of another grid (the bombs, the halves of 256 x 256 samples) were never held
        assert srv.ingest.assembly.nbytes <= cfg.max_partial_bytes and len(srv.ingest.assembly) == 0
        assert srv.dropped["wrong_shape"] >= sent["partial"] and "partial_evicted" not in srv.dropped
        got = srv.buffer.get(len(valid))
        assert len(got) == len(valid) and srv.buffer.get(1) is None
        for s in got:  # bit for bit, with their own times and parameters
            np.testing.assert_array_equal(s.fields[0], valid[s.sim, s.step])
            assert (s.t, s.params.tolist()) == (pytest.approx(s.step / 10), [np.float32(s.sim / 100)])
        growth = _rss() - rss0
        assert growth < RSS_BOUND, f"server RSS grew {growth / 2**20:.1f} MiB"
        print(f"\nfuzz: {total} messages {sent}; drops {drops}; "
              f"RSS growth {growth / 2**20:.1f} MiB; {time.perf_counter() - t_last:.2f} s after the last send")
        assert isinstance(strangers[1].error, HandshakeError) and isinstance(strangers[2].error, HandshakeError)
    finally:
        for s in senders:
            s.close(linger=0)
        ctx.destroy(linger=0)
        srv.stop()


def _server(**kw) -> StreamServer:
    cfg = ServerConfig(param_names=("alpha",), field_names=("T",), **kw)
    return StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1,
                        buffer=Buffer(BufferConfig(policy="fifo", capacity=64, watermark=1)), config=cfg).start()


def _wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def test_incomplete_sample_is_evicted_after_the_timeout_and_a_late_block_starts_anew():
    srv = _server(partial_timeout_s=0.5)
    push = Sender(SECRET)
    try:
        push.connect(srv.endpoint)
        half = _header(sim=3, nranks=2, shape=[4, 6])
        push.send_multipart(_signed(half, [np.ones((4, 6), np.float32)]))
        _wait(lambda: len(srv.ingest.assembly) == 1)
        _wait(lambda: srv.dropped.get("partial_evicted") == 1, timeout=5)
        assert len(srv.ingest.assembly) == 0 and srv.ingest.assembly.nbytes == 0 and srv.counters["samples"] == 0
        # the other half arriving late starts a new incomplete sample: never a sample of garbage
        push.send_multipart(_signed(_header(sim=3, nranks=2, rank=1, offset=[4, 0], shape=[4, 6]),
                                    [np.ones((4, 6), np.float32)]))
        _wait(lambda: srv.counters["messages"] == 2)
        assert srv.counters["samples"] == 0 and len(srv.ingest.assembly) == 1
    finally:
        push.close(linger=0)
        srv.stop()


def test_overlapping_blocks_are_never_a_sample():
    """Two ranks whose blocks overlap cover the area of the grid but leave a hole: dropped,
    not a sample with uninitialised memory in it."""
    srv = _server()
    push = Sender(SECRET)
    try:
        push.connect(srv.endpoint)
        for r in range(2):  # both send rows 0..3 of an 8-row grid
            push.send_multipart(_signed(_header(sim=4, nranks=2, rank=r, shape=[4, 6]), [np.ones((4, 6), np.float32)]))
        _wait(lambda: srv.dropped.get("incomplete_cover") == 1)
        assert srv.counters["samples"] == 0 and len(srv.ingest.assembly) == 0
    finally:
        push.close(linger=0)
        srv.stop()


def test_a_dead_server_thread_fails_every_loader_round_within_a_poll():
    """A bug (not input) that kills the thread: the buffer is failed, the loader raises
    LaunchError with the reason instead of waiting for data that will never come."""
    from mpi4py import MPI

    from hpcml.stream.loader import StreamLoader

    srv = _server()
    try:
        def boom() -> None:
            raise RuntimeError("injected fault")

        srv.ingest.assembly.sweep = boom
        loader = StreamLoader(srv, MPI.COMM_SELF, batch_size=4)
        t0 = time.perf_counter()
        with pytest.raises(LaunchError, match=r"this rank's: the stream server of trainer rank 0 died "
                                              r"\(RuntimeError: injected fault\)"):
            loader.next_batch()
        assert time.perf_counter() - t0 < 5 and srv.error == "RuntimeError: injected fault"
    finally:
        srv.stop()


@pytest.mark.parametrize("kw, error", [
    (dict(max_frame_bytes=0), "ServerConfig.max_frame_bytes=0: expected an integer number of bytes in 1..2**62"),
    (dict(max_partial_bytes=True), "ServerConfig.max_partial_bytes=True: expected an integer number of bytes in "
                                   "1..2**62"),
    (dict(max_sample_bytes=2 << 30), f"ServerConfig.max_sample_bytes={2 << 30} exceeds max_partial_bytes="
                                     f"{1 << 30}: one incomplete sample must fit the bound"),
    (dict(partial_timeout_s=0), "ServerConfig.partial_timeout_s=0: expected seconds > 0"),
])
def test_server_limits_are_validated(kw, error):
    with pytest.raises(ConfigError) as e:
        ServerConfig(field_names=("T",), **kw)
    assert str(e.value) == error


def _admitted(host: str, port: int, secret: bytes = SECRET) -> tuple[socket.socket, bytes, bytes]:
    """A raw connection that answered the challenge: (it, the server's greeting, its answer)."""
    s = socket.create_connection((host, port), timeout=5)
    hello = _exactly(s, handshake.HELLO_BYTES)
    answer, _ = handshake.answer(handshake.key(secret), hello)
    s.sendall(answer)
    head = _exactly(s, handshake.REPLY_BYTES)
    _exactly(s, handshake.info_length(head))
    return s, hello, answer


def _exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        assert got, f"closed after {len(out)} of {n} bytes"
        out += got
    return out


def _until_closed(s: socket.socket) -> bytes:
    out = b""
    try:
        while got := s.recv(64):
            out += got
    except ConnectionResetError:
        pass
    return out


def test_a_stranger_costs_no_message_and_a_replayed_answer_opens_nothing(monkeypatch):
    """No secret, no message: ZeroMQ's own greeting, another campaign's sender, a silent
    connection (closed after HELLO_S) and a valid answer replayed on a new connection are all
    refused; the key proven with is not the secret, nor the secret in hex."""
    monkeypatch.setattr(transport, "HELLO_S", 0.5)
    srv = _server()
    ctx = zmq.Context()
    other = Sender(b"t" * 32, hwm=1)  # another campaign's
    try:
        assert SECRET not in handshake.key(SECRET) and SECRET.hex().encode() not in handshake.token(SECRET)
        assert handshake.key(SECRET) != handshake.key(b"t" * 32)
        zmtp = ctx.socket(zmq.PUSH)  # ZeroMQ's own protocol: its greeting is no answer
        zmtp.linger = 0
        zmtp.connect(srv.endpoint)
        other.connect(srv.endpoint)
        for step in range(50):  # valid messages, signed with the secret, but no answer to the challenge
            try:
                zmtp.send_multipart(_signed(_header(sim=1, step=step)), zmq.NOBLOCK)
                other.send_multipart(_signed(_header(sim=1, step=step)), zmq.NOBLOCK)
            except (zmq.Again, HandshakeError):
                pass
        with pytest.raises(HandshakeError, match="refused this producer's proof"):
            other.wait_info(10)
        host, port = srv.endpoint[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as slow:  # the greeting, then nothing: closed after HELLO_S
            slow.settimeout(5)
            t0 = time.monotonic()
            assert len(_exactly(slow, handshake.HELLO_BYTES)) == handshake.HELLO_BYTES
            assert slow.recv(1) == b"" and 0.4 < time.monotonic() - t0 < 4
        first, hello, answer = _admitted(host, int(port))  # a captured answer ...
        with socket.create_connection((host, int(port))) as replay:  # ... replayed on a new connection
            replay.settimeout(5)
            hello2 = _exactly(replay, handshake.HELLO_BYTES)
            assert hello2 != hello  # a fresh challenge
            replay.sendall(answer + framing.pack(_signed(_header(sim=9))).tobytes())
            assert _until_closed(replay) in (b"", b"\0")  # refused (a reset may beat the refusal byte)
        first.close()
        ok = Sender(SECRET)
        ok.connect(srv.endpoint)
        ok.send_multipart(_signed(_header(sim=2)))
        _wait(lambda: srv.counters["samples"] == 1)
        ok.close()
        time.sleep(0.3)
        assert ok.undelivered == 0 and ok.info["fields"] == ["T"] and ok.info["campaign"] == CAMPAIGN
        assert srv.counters["messages"] == 1 and srv.dropped == {} and sorted(srv.seen) == [(2, 0)]
        assert srv._rx.refused >= 4 and srv._rx.admitted == 2 and srv._rx.held_bytes() == 0
    finally:
        other.close(linger=0)
        ctx.destroy(linger=0)
        srv.stop()


def test_concurrent_hostile_peers_do_not_starve_a_valid_one():
    srv = _server(hwm=8)
    ctx = zmq.Context()
    try:
        stop = threading.Event()

        def flood(k: int) -> None:
            s = Sender(SECRET, hwm=8)
            s.connect(srv.endpoint)
            while not stop.is_set():
                try:
                    s.send_multipart([message.MAGIC, b"{}", os.urandom(64 + k)], zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
            s.close(linger=0)

        threads = [threading.Thread(target=flood, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        # no MAC frame of 16 bytes and an empty header: malformed where a MAC is required, bad_header where
        # the connection's challenge was enough (integrity="connection", the default)
        _wait(lambda: srv.dropped.get("bad_header", 0) > 200, timeout=30)  # the flood is on
        ok = Sender(SECRET)
        ok.connect(srv.endpoint)
        for step in range(20):
            ok.send_multipart(_signed(_header(sim=2, step=step)))
        _wait(lambda: srv.counters["samples"] == 20, timeout=30)
        stop.set()
        for t in threads:
            t.join()
        assert srv.dropped["bad_header"] > 100 and srv._thread.is_alive()
        ok.close(linger=0)
    finally:
        ctx.destroy(linger=0)
        srv.stop()


def test_a_garbage_simulation_file_fails_the_loader_in_one_line_not_a_hang(tmp_path):
    """Issue 12: a file of random bytes among the simulations' files killed the file source's
    thread, and training waited for ever; now every loader round raises with the file named."""
    from mpi4py import MPI

    from hpcml.stream.files import FileSource, read_samples
    from hpcml.stream.loader import StreamLoader

    bad = tmp_path / "sim_00000.h5"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ConfigError) as info:
        read_samples(bad, ("T",), ("alpha",))
    assert str(info.value) == (f"simulation file {bad}: ValueError: not an HDF5 file; expected the kernels' HDF5 "
                               f"layout (/fields/<name>, /time, /step, attributes sim_id and params: docs/kernels.md)")
    src = FileSource([bad], rank=0, n_trainers=1, buffer=Buffer(BufferConfig(policy="fifo", capacity=8, watermark=1)),
                     field_names=("T",), param_names=("alpha",)).start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(LaunchError, match=rf"this rank's: trainer rank 0: simulation file {bad}: ValueError: not "
                                              rf"an HDF5 file"):
            StreamLoader(src, MPI.COMM_SELF, batch_size=2).next_batch()
        assert time.perf_counter() - t0 < 5 and src.stats()["error"].startswith(f"simulation file {bad}")
    finally:
        src.stop()


def test_a_simulation_file_whose_params_nest_deep_is_refused_in_one_line(tmp_path):
    """A simulation's HDF5 file is input: its ``params`` attribute nested 5,000 deep was a
    RecursionError out of ``json.loads`` (a traceback, the file source dead without a reason);
    now the file layer refuses it before parsing, and the error names the file."""
    import h5py

    from hpcml.stream.files import read_samples

    path = tmp_path / "sim_00000.h5"
    with h5py.File(path, "w") as f:
        f["fields/T"], f["time"], f["step"] = np.zeros((2, 4, 4), np.float32), [0.0, 1.0], [0, 1]
        f.attrs["sim_id"], f.attrs["params"] = 0, "[" * 5000
    with pytest.raises(ConfigError) as info:
        read_samples(path, ("T",), ("alpha",))
    assert str(info.value).startswith(f"simulation file {path}: FileRefused: attribute params: JSON nested more "
                                      f"than 64 deep"), str(info.value)


def test_refused_connections_leave_nothing_behind_and_a_bad_length_costs_only_its_message():
    """The framing alone (no server thread): strangers are closed and forgotten; a key holder's
    message of too many or too large frames is refused before anything is kept, its bytes passed
    over, and the next message on the same connection arrives whole."""
    rx = transport.Receiver(SECRET, host="127.0.0.1", port=0, max_frame_bytes=1 << 16, max_message_bytes=1 << 17)
    tx = Sender(SECRET)
    try:
        host, port = rx.endpoint[len("tcp://"):].rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port))) for _ in range(5)]
        for s in strangers:
            s.sendall(os.urandom(100))
        tx.connect(rx.endpoint)
        big = np.ones(1 << 15, np.float32)  # 128 KiB: past the frame limit
        tx.send_multipart([message.MAGIC, b"{}", big, bytes(16)])
        tx.send_multipart([message.MAGIC, b"{}"] + [b"x"] * 40 + [bytes(16)])  # 43 frames
        tx.send_multipart([message.MAGIC])  # 1 frame: no header (2 is an end marker without a MAC)
        tx.send_multipart([message.MAGIC, b'{"ok":1}', np.arange(5, dtype=np.float32), bytes(16)])
        got, t0 = [], time.monotonic()
        while len(got) < 4 and time.monotonic() - t0 < 10:
            try:
                got.append(rx.recv())
            except zmq.Again:
                time.sleep(0.01)
            except message.MessageError as e:
                got.append(e.reason)
        assert got[:3] == ["oversized", "too_many_frames", "malformed"], got
        peer, frames = got[3]
        assert bytes(frames[1]) == b'{"ok":1}' and np.frombuffer(frames[2], np.float32).tolist() == [0, 1, 2, 3, 4]
        assert all(f.obj is frames[0].obj for f in frames)  # one buffer per message
        assert np.frombuffer(frames[2], np.float32).ctypes.data % 64 == 0  # aligned views
        assert (rx.refused, rx.admitted, rx.connections, rx.held_bytes()) == (5, 1, 1, 0)
        for s in strangers:
            s.close()
    finally:
        tx.close(linger=0)
        rx.close()


def test_a_message_whose_sender_falls_silent_is_dropped_and_its_buffer_freed(monkeypatch):
    """A sender that vanished mid-message without a close (a node gone) is found by its
    silence: after STALL_S with nothing to read, its message is dropped (``stalled``,
    counted), its buffer freed and the connection closed."""
    monkeypatch.setattr(transport, "STALL_S", 0.3)
    rx = transport.Receiver(SECRET, host="127.0.0.1", port=0, max_frame_bytes=1 << 20, max_message_bytes=1 << 21)
    try:
        host, port = rx.endpoint[len("tcp://"):].rsplit(":", 1)
        wire = framing.pack([message.MAGIC, b"{}", np.ones(1 << 18, np.float32), bytes(16)])
        th = threading.Thread(target=lambda: [rx.wait(0.05) or _again(rx) for _ in range(40)])
        th.start()  # the server's side of the handshake
        s = _admitted(host, int(port))[0]
        th.join()
        with s:
            s.sendall(wire[: len(wire) // 2])  # half a message, then silence
            s.settimeout(5)
            errors, t0 = [], time.monotonic()
            while not errors and time.monotonic() - t0 < 5:
                try:
                    rx.recv()
                except zmq.Again:
                    assert rx.held_bytes() in (0, len(wire) - framing.head_bytes(4))
                    rx.sweep()
                    time.sleep(0.05)
                except message.MessageError as e:
                    errors.append(e.reason)
            assert errors == ["stalled"] and rx.held_bytes() == 0 and rx.connections == 0
            for _ in range(3):  # the socket in use again (as the server's loop uses it): the close goes out
                with pytest.raises(zmq.Again):
                    rx.recv()
            assert s.recv(1) == b""  # closed by the server
    finally:
        rx.close()


def _again(rx) -> None:
    try:
        rx.recv()
    except zmq.Again:
        pass


def test_bytes_below_the_low_water_mark_are_progress_not_silence(monkeypatch):
    """The server sleeps on a message until the rest of it is in the kernel (``SO_RCVLOWAT``),
    so a slow sender's bytes may wait there unread: they count as progress. While another
    message waits for memory, a holder that trickles on is kept; one that stops is closed."""
    a, b = socket.socketpair()
    with a, b:
        c = reading.Conn(a, 1, b"")
        c.seen = 0.0
        c.progress(10.0)
        assert (c.seen, c.queued) == (0.0, 0)  # nothing waiting: silent
        b.sendall(b"x" * 100)
        c.progress(11.0)
        assert (c.seen, c.queued) == (11.0, 100)
        c.progress(12.0)
        assert c.seen == 11.0  # nothing more since: silent again

    monkeypatch.setattr(transport, "IDLE_EVICT_S", 0.6)
    monkeypatch.setattr(transport, "MIN_RATE", 1)  # the rate rule out of the way: silence alone decides
    rx = transport.Receiver(SECRET, host="127.0.0.1", port=0, max_frame_bytes=1 << 21, max_message_bytes=1 << 21)
    big = framing.pack([message.MAGIC, b"{}", np.ones(375_000, np.float32)])  # 1.5 MB: two fit in memory, not 3
    try:
        host, port = rx.endpoint[len("tcp://"):].rsplit(":", 1)
        th = threading.Thread(target=lambda: [rx.wait(0.05) or _again(rx) for _ in range(60)])
        th.start()
        slow, other = [_admitted(host, int(port))[0] for _ in range(2)], _admitted(host, int(port))[0]
        th.join()
        for s in slow:
            s.sendall(big[:4096])  # its head and a little: its memory is taken
        for _ in range(10):
            _again(rx)
            time.sleep(0.02)
        assert rx.held_bytes() == 2 * (big.nbytes - framing.head_bytes(3))
        other.sendall(big)  # waits for memory
        t0, got = time.monotonic(), []
        while time.monotonic() - t0 < 2.5:  # trickling: 1 KiB every 0.2 s, far below the mark
            for s in slow:
                s.sendall(b"\0" * 1024)
            got += _drain(rx)
            rx.sweep()
            time.sleep(0.2)
        assert (rx.evicted, rx.connections, got) == (0, 3, [])
        t0 = time.monotonic()
        while "message" not in got and time.monotonic() - t0 < 5:  # silent now: closed, the other's message in
            got += [g if isinstance(g, str) else "message" for g in _drain(rx)]
            rx.sweep()
            time.sleep(0.05)
        assert got[-1] == "message" and set(got[:-1]) == {"stalled"} and rx.evicted == len(got) - 1 >= 1
        for s in [*slow, other]:
            s.close()
    finally:
        rx.close()


def _drain(rx) -> list:
    """What ``rx`` has whole now: messages, and the reasons of refusals."""
    out = []
    while True:
        try:
            out.append(rx.recv())
        except zmq.Again:
            return out
        except message.MessageError as e:
            out.append(e.reason)
