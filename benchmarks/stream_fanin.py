"""Fan-in: thousands of producer connections into one trainer rank, every sample once, fairly served.

    python benchmarks/stream_fanin.py --json                       # 4,000 connections
    python benchmarks/stream_fanin.py --json --connections 1000 --messages 20

One StreamServer thread (trainer rank 0 of 1, a consumer thread draining its buffer as a
trainer would) in this process; ``--procs`` client processes open ``--connections``
connections between them, each a one-rank simulation of its own that answers the server's
challenge and, once every connection has (so all stream at once), streams ``--messages``
samples of a ``--nx`` x ``--nx`` float32 field (GMAC'd, which a server of either integrity
takes) with at most ``--window`` unacknowledged, then its end marker. The
clients multiplex their sockets on one ``selectors`` loop each (4,000 Producer threads would
measure Python's threads, not the server). Last line: ``connections``, ``samples_expected``,
``samples_ingested``, ``duplicates``, ``intake_mb_s``, ``min_share_over_fair`` (while every
connection is active -- from the first poll at which each has delivered a sample to the last
before any has finished -- the least-served connection's samples over an equal share),
``server_rss_mib`` (peak resident memory of this process), the server's ``fd_limit`` and
``max_connections``; exit 1 on a missing or duplicated sample.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CAMPAIGN = "fanin"


def _client(endpoint: str, key_file: str, first: int, n: int, messages: int, nx: int, window: int,
            go_file: str = "") -> None:
    """Child process: ``n`` connections, simulations ``first .. first+n-1``, multiplexed; each
    answers the challenge, then holds its samples until ``go_file`` exists (every connection of
    every client admitted: all stream at once)."""
    from hpcml.stream import framing, handshake, message, read_secret
    from hpcml.stream.sender import parse_endpoint

    secret = read_secret(key_file)
    key = handshake.key(secret)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    addr = parse_endpoint(endpoint)
    field = np.random.default_rng(first).random((nx, nx), dtype=np.float32)
    sel = selectors.DefaultSelector()

    class C:  # one simulation's connection
        def __init__(self, sim: int) -> None:
            self.sim, self.step, self.acked, self.inflight = sim, 0, 0, 0
            self.out, self.got, self.nonce_p, self.hello = memoryview(b""), bytearray(), b"", b""
            self.state = "hello"
            self.sock = socket.socket()
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as a Producer's Sender does
            self.sock.setblocking(False)
            self.sock.connect_ex(addr)
            sel.register(self.sock, selectors.EVENT_READ, self)

        def message(self) -> bytes:
            if self.step < messages:
                h = {"kind": "data", "campaign": CAMPAIGN, "sim": self.sim, "attempt": 0, "rank": 0, "nranks": 1,
                     "step": self.step, "t": float(self.step), "global_shape": [nx, nx], "offset": [0, 0],
                     "shape": [nx, nx], "fields": [["T", "float32"]], "params": {"a": float(self.sim)}}
                frames = message.encode(secret, h, [field])
            else:
                frames = message.encode(secret, {"kind": "end", "campaign": CAMPAIGN, "sim": self.sim, "attempt": 0,
                                                 "rank": 0, "nranks": 1, "n_sent": messages})
            self.step += 1
            return framing.pack(frames).tobytes()

    retries = [0]
    for i in range(n):  # each registers itself with the selector, which holds it
        C(first + i)
    live, started = n, not go_file
    while live:
        if not started and os.path.exists(go_file):
            started = True
            for k in list(sel.get_map().values()):
                sel.modify(k.fileobj, selectors.EVENT_READ | selectors.EVENT_WRITE, k.data)
        for k, ev in sel.select(1.0 if started else 0.05):
            c = k.data
            if ev & selectors.EVENT_READ:
                try:
                    data = c.sock.recv(65536)
                except BlockingIOError:
                    data = None
                except ConnectionError:
                    data = b""
                if data == b"" and c.state != "send":  # crowded out before it answered: again, as a Sender does
                    sel.unregister(c.sock)
                    c.sock.close()
                    c.__init__(c.sim)
                    retries[0] += 1
                    continue
                if data == b"":
                    raise SystemExit(f"simulation {c.sim}: the server closed its connection ({c.state})")
                if data:
                    c.got += data
                    if c.state == "hello" and len(c.got) >= handshake.HELLO_BYTES:
                        c.hello, c.got = bytes(c.got[:handshake.HELLO_BYTES]), c.got[handshake.HELLO_BYTES:]
                        answer, c.nonce_p = handshake.answer(key, c.hello)
                        c.sock.sendall(answer)
                        c.state = "reply"
                    if c.state == "reply" and len(c.got) >= handshake.REPLY_BYTES:
                        m = handshake.info_length(bytes(c.got[:handshake.REPLY_BYTES]))
                        if len(c.got) >= handshake.REPLY_BYTES + m:
                            handshake.check_reply(key, c.hello[len(handshake.HELLO):], c.nonce_p,
                                                  bytes(c.got[:handshake.REPLY_BYTES]),
                                                  bytes(c.got[handshake.REPLY_BYTES:handshake.REPLY_BYTES + m]))
                            c.got, c.state = c.got[handshake.REPLY_BYTES + m:], "send"
                    if c.state == "send" and len(c.got) >= 8:
                        whole = len(c.got) // 8 * 8
                        taken = framing.ACK.unpack_from(c.got, whole - 8)[0]
                        c.inflight -= taken - c.acked
                        c.acked, c.got = taken, c.got[whole:]
                        if c.acked == messages + 1:
                            sel.unregister(c.sock)
                            c.sock.close()
                            live -= 1
                            continue
            if c.state != "send" or not started:
                continue
            while True:  # fill the window, then wait for acknowledgements or room in the socket
                if not c.out and c.inflight < window and c.step <= messages:
                    c.out = memoryview(c.message())
                    c.inflight += 1
                if not c.out:
                    break
                try:
                    c.out = c.out[c.sock.send(c.out):]
                except BlockingIOError:
                    break
            sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.out else 0), c)
    print(json.dumps({"cpu_s": time.process_time(), "reconnects": retries[0]}), flush=True)


def _rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=4000)
    p.add_argument("--messages", type=int, default=30, help="samples per connection")
    p.add_argument("--nx", type=int, default=32, help="each sample a float32 field of nx x nx")
    p.add_argument("--procs", type=int, default=4, help="client processes")
    p.add_argument("--window", type=int, default=2, help="unacknowledged messages per connection (Producer.hwm)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from hpcml.stream import Buffer, BufferConfig, new_secret, read_secret
    from hpcml.stream.server import ServerConfig, StreamServer

    with tempfile.TemporaryDirectory(prefix="hpcml-fanin-") as d:
        key_file = str(Path(d) / "k")
        new_secret(key_file)
        buf = Buffer(BufferConfig(policy="fifo", capacity=4096, watermark=1))
        srv = StreamServer(campaign=CAMPAIGN, secret=read_secret(key_file), rank=0, n_trainers=1, buffer=buf,
                           config=ServerConfig(param_names=("a",), field_names=("T",), shape=(args.nx, args.nx),
                                               end_grace_s=5)).start()
        cap = srv.stats()["peers"]
        expected = args.connections * args.messages
        got = [0]

        def consume() -> None:  # as a trainer: batches of 64
            while got[0] < expected:
                b = buf.get(min(64, expected - got[0]), timeout=0.1)  # the last batch may be short
                got[0] += len(b or [])
        snaps: list[tuple[float, np.ndarray]] = []
        done = threading.Event()

        def watch() -> None:  # samples per simulation, four times a second
            while not done.is_set():
                with srv._lock:
                    per = srv.ingest.per_sim
                    snaps.append((time.perf_counter(), np.array([per.get(s, 0) for s in range(args.connections)])))
                time.sleep(0.25)
        threads = [threading.Thread(target=consume), threading.Thread(target=watch, daemon=True)]
        for t in threads:
            t.start()
        share = -(-args.connections // args.procs)
        go_file = Path(d) / "go"
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.stream_fanin import _client; "
            f"_client({srv.endpoint!r}, {key_file!r}, {i * share}, {min(share, args.connections - i * share)}, "
            f"{args.messages}, {args.nx}, {args.window}, {str(go_file)!r})")], stdout=subprocess.PIPE, text=True)
            for i in range(args.procs) if i * share < args.connections]
        deadline = time.monotonic() + 120  # every connection answers the challenge, then all stream at once
        while srv.stats()["peers"]["admitted"] < args.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        go_file.touch()
        outs = [pr.communicate()[0] for pr in procs]
        threads[0].join(timeout=120)
        wall = time.perf_counter() - t0
        done.set()
        stats = srv.stats()
        srv.stop()
        counts = np.array([srv.ingest.per_sim.get(s, 0) for s in range(args.connections)])
        # the window in which every connection is active: each has delivered, none has finished
        live = [(t, c) for t, c in snaps if c.min() >= 1 and c.max() < args.messages]
        fair, by_client = None, []
        if len(live) >= 2:
            delta = live[-1][1] - live[0][1]
            fair = float(delta.min() / delta.mean()) if delta.mean() > 0 else None
            by_client = [float(delta[i:i + share].mean() / delta.mean()) for i in range(0, args.connections, share)]
        nbytes = stats["samples"] * args.nx * args.nx * 4
        out = {"benchmark": "stream_fanin", "connections": args.connections, "messages_per_connection": args.messages,
               "sample_bytes": args.nx * args.nx * 4, "samples_expected": expected,
               "samples_ingested": int(stats["samples"]), "duplicates": int(stats["duplicates"]),
               "missing": int(expected - counts.sum()), "sims_short": int((counts < args.messages).sum()),
               "dropped": stats["dropped"], "wall_s": wall, "intake_mb_s": nbytes / 1e6 / stats["intake_s"]
               if stats["intake_s"] else 0.0, "samples_s": stats["samples"] / stats["intake_s"] if stats["intake_s"]
               else 0.0, "min_share_over_fair": fair, "client_share_over_fair": by_client,
               "fair_window_s": live[-1][0] - live[0][0] if len(live) >= 2
               else 0.0, "server_rss_mib": _rss_peak_mib(), "fd_limit": cap["fd_limit"],
               "max_connections": cap["max_connections"], "pending_max": cap["pending_max"],
               "admitted": stats["peers"]["admitted"],
               "refused": stats["peers"]["refused"], "evicted": stats["peers"]["evicted"],
               "client_exit": [pr.returncode for pr in procs], "client_cpu_s": [
                   json.loads(o.strip().splitlines()[-1])["cpu_s"] if o.strip() else None for o in outs],
               "client_reconnects": sum(json.loads(o.strip().splitlines()[-1])["reconnects"] for o in outs
                                        if o.strip())}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    ok = out["missing"] == 0 and out["duplicates"] == 0 and not any(out["client_exit"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
