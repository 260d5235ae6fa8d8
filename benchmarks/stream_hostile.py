"""What a hostile message costs a stream server, against what a valid one costs and the raw limit.

    python benchmarks/stream_hostile.py --json

A StreamServer thread runs in this process; an attacker process sends ``--n`` messages of
one kind at a time, and the server's CPU time (every thread of this process: the server and
ZeroMQ's I/O thread; minus the idle polling rate) over the messages it handled is the cost
per message. Kinds, all ~2 MB on the wire:

- ``stranger_tcp``: a raw TCP peer writing 2 MB of junk;
- ``stranger_key``: a Sender with another campaign's secret sending a 2 MB message (its answer
  to the challenge refused at its first 64 bytes: one connection each);
- ``wrong_mac``: a peer with the secret sending 2 MB whose MAC is wrong -- the MAC pass is the cost;
- ``poison``: an authenticated header the decoder refuses (e.g. ``fields=[["u"]]``);
- ``many_frames``: a message announcing 1,000,000 empty frames, from a peer with the secret
  (refused at its length table, which streams by summed, never kept);
- ``valid``: a valid 2 MB sample, accepted (MAC, checks, buffer) -- the reference.

Limits: ``raw_zmq`` (a plain PULL socket receiving the 2 MB message, nothing checked) and
``memcpy`` of 2 MB; ``raw_many_frames``: a plain PULL socket's ``recv_multipart`` of the
1,000,000-frame message (what a server without the frame bound pays).

Memory (``--queue``, issue 24): a peer holding the secret opens ``--conns`` connections and
queues messages of ``--frame-mib`` MiB frames while the training buffer is full (the server
has stopped reading: backpressure), and the server's peak RSS growth is measured against
what its limits allow, ``conns x queued_bytes`` (:mod:`hpcml.stream.budget`). Rows:
``default`` (``hwm`` 8, no ``max_peer_bytes``), ``budget`` (``max_peer_bytes`` of
``--peer-mib`` per connection, by default the least allowed: two of the largest valid
message) with one-frame messages as in the issue, and ``budget_19_frames``: the same budget
against messages of 19 frames of the frame limit, which no valid message is (libzmq's own
multipart messages held them whole: +576 MiB at 4 MiB frames before the framed transport).
The issue's own figures are ``--conns 8 --frame-mib 64``: 3.6 GB before.

    python benchmarks/stream_hostile.py --queue --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECRET = b"b" * 32
CAMPAIGN = "bench"
MB2 = 2 << 20
SHAPE = (512, 1024)  # float32: 2 MiB


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _header(**kw) -> dict:
    h = {"kind": "data", "campaign": CAMPAIGN, "sim": 0, "attempt": 0, "rank": 0, "nranks": 1, "step": 0, "t": 0.0,
         "global_shape": list(SHAPE), "offset": [0, 0], "shape": list(SHAPE), "fields": [["T", "float32"]],
         "params": {"a": 1.0}}
    return {**h, **kw}


def _attack(kind: str, endpoint: str, n: int) -> None:
    """Child process: send ``n`` messages of ``kind``."""
    import zmq

    from hpcml.stream import message
    from hpcml.stream.sender import Sender

    field = np.ones(SHAPE, np.float32)
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    if kind == "stranger_tcp":
        junk = os.urandom(MB2)
        for _ in range(n):
            with socket.create_connection((host, int(port))) as s:
                try:
                    s.sendall(junk)
                except OSError:
                    pass
        return
    ctx = zmq.Context()
    if kind == "stranger_key":
        for _ in range(n):
            s = Sender(b"guess" * 8)
            s.connect(endpoint)
            s.send_multipart([field])
            while s.error is None:  # refused once: the sender gives up (a final error)
                time.sleep(0.002)
            s.close(linger=0)
        ctx.term()
        return
    s = ctx.socket(zmq.PUSH) if kind.startswith("raw") else Sender(SECRET)
    s.connect(endpoint)
    for i in range(n):
        if kind == "valid":
            frames = message.encode(SECRET, _header(step=i), [field])
        elif kind == "wrong_mac":
            frames = message.encode(SECRET, _header(step=i), [field])[:-1] + [b"\0" * 16]
        elif kind == "poison":
            frames = message.encode(SECRET, _header(fields=[["u"]]), [field])
        elif kind in ("many_frames", "raw_many_frames"):
            frames = [b""] * 1_000_000
        else:  # raw_zmq
            frames = [field]
        s.send_multipart(frames, copy=kind != "raw_zmq")
    s.close(linger=-1)
    ctx.term()


def _idle_rate(seconds: float = 1.0) -> float:
    c0, t0 = _cpu(), time.perf_counter()
    time.sleep(seconds)
    return (_cpu() - c0) / (time.perf_counter() - t0)


def _measure_server(kind: str, n: int) -> dict:
    from hpcml.stream import Buffer, BufferConfig
    from hpcml.stream.server import ServerConfig, StreamServer

    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1,
                       buffer=Buffer(BufferConfig(policy="reservoir", capacity=4, watermark=0)),
                       config=ServerConfig(param_names=("a",), field_names=("T",), hwm=4)).start()
    handled = lambda: srv.counters["messages"] + sum(srv.dropped.values())  # noqa: E731
    try:
        idle = _idle_rate()  # this server's own polling, subtracted below
        proc = mp.get_context("fork").Process(target=_attack, args=(kind, srv.endpoint, n))
        c0, t0 = _cpu(), time.perf_counter()
        proc.start()
        strangers = kind.startswith("stranger")
        while (proc.is_alive() if strangers else handled() < n):
            time.sleep(0.002)
        proc.join()
        if strangers:
            time.sleep(0.2)  # the server's share of the last connections
        wall = time.perf_counter() - t0
        cpu = _cpu() - c0 - idle * wall
        return {"kind": kind, "n": n, "server_cpu_ms_per_msg": 1e3 * cpu / n, "wall_s": wall,
                "accepted": srv.counters["samples"], "dropped": dict(srv.dropped),
                "thread_alive": srv._thread.is_alive()}
    finally:
        srv.stop()


def _measure_raw(kind: str, n: int, idle: float) -> dict:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("fork").Process(target=_attack, args=(kind, f"tcp://127.0.0.1:{port}", n))
    c0, t0 = _cpu(), time.perf_counter()
    proc.start()
    for _ in range(n):
        s.recv_multipart(copy=False)
    wall = time.perf_counter() - t0
    cpu = _cpu() - c0 - idle * wall
    proc.join()
    ctx.destroy(linger=0)
    return {"kind": kind, "n": n, "server_cpu_ms_per_msg": 1e3 * cpu / n, "wall_s": wall}


def _memcpy(n: int = 50) -> dict:
    a, b = np.ones(MB2 // 4, np.float32), np.empty(MB2 // 4, np.float32)
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(b, a)
    return {"kind": "memcpy", "n": n, "server_cpu_ms_per_msg": 1e3 * (time.perf_counter() - t0) / n}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _flood(endpoint: str, frames: int, frame_bytes: int, first_step: int, sent, done) -> None:
    """Child process: one connection queueing messages of ``frames`` frames until its sender blocks."""
    import zmq

    from hpcml.stream import message
    from hpcml.stream.sender import Sender

    s = Sender(SECRET, hwm=1)
    s.connect(endpoint)
    n = frame_bytes // 4
    field = np.ones(n, np.float32)
    h = _header(global_shape=[n], offset=[0], shape=[n])
    idle, f = time.monotonic(), None
    while time.monotonic() - idle < 10.0:  # blocked for 10 s: the server holds all it will hold
        if f is None:  # encoded once, retried until it goes
            f = message.encode(SECRET, {**h, "step": first_step + sent.value}, [field])
            f = f if frames == 1 else [f[0]] + [field] * (frames - 1)
        try:
            s.send_multipart(f, zmq.NOBLOCK, copy=False)
            sent.value, idle, f = sent.value + 1, time.monotonic(), None
        except zmq.Again:
            time.sleep(0.02)
    done.value = 1
    time.sleep(600)  # hold the connection open until killed


def _queue_attack(row: str, conns: int, frames: int, frame_mib: int, peer_bytes: int | None) -> dict:
    """Peak RSS growth of a server whose buffer is full while ``conns`` connections queue."""
    from hpcml.stream import Buffer, BufferConfig, Sample, message
    from hpcml.stream.sender import Sender
    from hpcml.stream.server import ServerConfig, StreamServer

    frame = frame_mib << 20
    buf = Buffer(BufferConfig(policy="fifo", capacity=1, watermark=0))
    buf.put(Sample(0, 0, 0.0, np.zeros(1, np.float32), np.zeros((1, 1), np.float32)))  # full
    cfg = ServerConfig(param_names=("a",), field_names=("T",), hwm=8, max_frame_bytes=frame, max_sample_bytes=frame,
                       max_partial_bytes=frame, max_peer_bytes=peer_bytes)
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1, buffer=buf, config=cfg).start()
    lim, procs = srv.limits, []
    try:
        plug = Sender(SECRET)  # a sample the full buffer refuses: the server stops reading
        plug.connect(srv.endpoint)
        plug.send_multipart(message.encode(SECRET, _header(global_shape=[1], offset=[0], shape=[1]),
                                           [np.ones(1, np.float32)]))
        while srv.counters["samples"] < 1:
            time.sleep(0.01)
        plug.close(linger=0)
        time.sleep(0.2)
        rss0, peak = _rss(), 0
        fork = mp.get_context("fork")
        sent, done = [fork.Value("i", 0) for _ in range(conns)], [fork.Value("i", 0) for _ in range(conns)]
        procs = [fork.Process(target=_flood, args=(srv.endpoint, frames, frame, 1000 * (i + 1), sent[i], done[i]),
                              daemon=True) for i in range(conns)]
        for pr in procs:
            pr.start()
        t0 = time.monotonic()
        while not all(d.value for d in done) and time.monotonic() - t0 < 600:  # each blocked for 10 s
            peak = max(peak, _rss() - rss0)
            time.sleep(0.02)
        peak = max(peak, _rss() - rss0)
        st = srv.stats()
        return {"row": row, "conns": conns, "frames_per_msg": frames, "frame_mib": frame_mib,
                "messages_sent": sum(v.value for v in sent),
                "peer_budget_mib": lim.peer_bytes / 2**20, "peers_admitted": st["peers"]["admitted"],
                "rss_growth_peak_mib": peak / 2**20,
                "queued_bytes_mib": lim.queued_bytes / 2**20, "dropped": dict(st["dropped"]),
                "bound_mib": conns * lim.queued_bytes / 2**20, "bound_formula": "conns x queued_bytes"}
    finally:
        for pr in procs:
            pr.kill()
        srv.stop()


def _queue_rows(args) -> list[dict]:
    from hpcml.stream.budget import peer_limits

    frame = args.frame_mib << 20
    least = 2 * peer_limits(hwm=8, max_frame_bytes=frame, max_sample_bytes=frame, n_fields=1, shape=None,
                            max_peer_bytes=None).message_bytes
    budget = least if args.peer_mib is None else args.peer_mib << 20
    rows = [_queue_attack("default", args.conns, 1, args.frame_mib, None)]
    for frames in args.frames:
        rows.append(_queue_attack("budget" if frames == 1 else "budget_19_frames", args.conns, frames,
                                  args.frame_mib, budget))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="messages per kind (many-frame kinds: n // 50)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--queue", action="store_true", help="only the memory attack of issue 24 (queued messages)")
    p.add_argument("--conns", type=int, default=8, help="--queue: the attacker's connections")
    p.add_argument("--frame-mib", type=int, default=4, help="--queue: MiB per frame (the issue: 64)")
    p.add_argument("--peer-mib", type=int, default=None,
                   help="--queue: max_peer_bytes in MiB (default: the least allowed, two of the largest valid message)")
    p.add_argument("--frames", type=lambda v: [int(x) for x in v.split(",")], default=[1, 19],
                   help="--queue: frames per message of the budget rows (default 1,19; 19 x 64 MiB x 8 is 9 GiB)")
    args = p.parse_args(argv)
    if args.queue:
        rows = _queue_rows(args)
        out = {"queue_attack": rows}
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        over = [r["row"] for r in rows if r["rss_growth_peak_mib"] > r["bound_mib"] + 16]
        if over:
            sys.exit(f"stream_hostile: the server held more than its budget: {over}")
        return out
    idle = _idle_rate()  # this process with no server: subtracted from the raw rows
    rows = [_memcpy()]
    for kind in ("raw_zmq", "raw_many_frames"):
        rows.append(_measure_raw(kind, max(2, args.n // 50) if "many" in kind else args.n, idle))
    for kind in ("valid", "wrong_mac", "poison", "stranger_key", "stranger_tcp", "many_frames"):
        rows.append(_measure_server(kind, max(2, args.n // 50) if "many" in kind else args.n))
    by = {r["kind"]: r["server_cpu_ms_per_msg"] for r in rows}
    out = {"idle_cpu_fraction": idle, "rows": rows,
           "ratios": {f"{k}/valid": by[k] / by["valid"] for k in by if k != "valid"},
           "many_frames/raw_many_frames": by["many_frames"] / by["raw_many_frames"]}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    bad = [r["kind"] for r in rows if r.get("accepted") and r["kind"] != "valid" or r.get("thread_alive") is False]
    if bad:
        sys.exit(f"stream_hostile: hostile input accepted or fatal: {bad}")
    return out


if __name__ == "__main__":
    main()
