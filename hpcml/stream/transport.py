"""The stream's wire: ZeroMQ ``STREAM`` sockets carrying our own framing, every byte bounded.

Why not ZeroMQ's own messages (PUSH/PULL): libzmq holds every frame of a multipart message
before the application can read any, bounds frames per message nowhere, and counts its
high-water mark in whole messages, so a peer holding the campaign secret could make a
trainer hold any amount of memory. Here libzmq moves raw TCP bytes (``ZMQ_STREAM``: at most
``RCVHWM`` chunks of 8 KiB queued per connection) and this module frames them, checking
every length before it allocates:

    token (64 B) | n: u32 | len_0 .. len_{n-1}: u64 | pad to 64 B | frame_0 | pad | ... | frame_{n-1} | pad

1. **The token** opens every message: ``HMAC-SHA256(secret, "hpcml-stream/transport")``
   in hex, so the secret never goes on the wire. A connection whose first message does
   not start with it is closed after its first 68 bytes (one that begins a token and
   stops short, after :data:`HELLO_S`): a peer without the token gets nothing allocated,
   parsed or decoded. While the server does not read (its buffer full), what it sent
   waits in ZeroMQ's queue like anyone's: ``RCVHWM`` chunks per connection. The token is
   a gate, not a signature (it travels in clear): every message is still MAC'd with the
   secret (:mod:`hpcml.stream.message`).
2. **The lengths** are checked before anything is allocated: 3 to ``message.MAX_FRAMES``
   frames, each at most ``frame_bytes``, all at most ``message_bytes`` (plus the frames'
   64-byte alignment). A message that breaks them is a
   :class:`~hpcml.stream.message.MessageError` (counted, dropped) and its bytes are read
   and passed over, never kept; a table of more than :data:`SKIP_FRAMES` lengths, or a
   message that does not start with the token, closes its connection.
3. **One buffer per message**, frames 64-byte aligned views into it: a connection holds at
   most one incomplete message (``<= message_bytes``) plus libzmq's ``RCVHWM`` chunks
   (:mod:`hpcml.stream.budget`); one silent for :data:`STALL_S` with an unfinished message
   is closed and the message dropped (libzmq loses the close notice of a connection whose
   queue was full).
4. **Names.** Every connection gets a number of its own, so the server can charge what it
   holds to the connection that sent it.

A message is one ZeroMQ message on the sending side (:class:`Sender`: the producer packs
its frames into one buffer), so when a connection drops, libzmq drops the partly sent
message and the reconnected stream starts at a message boundary. Imports no torch:
simulations connect through :func:`push_socket`.
"""

from __future__ import annotations

import hashlib
import hmac
import resource
import struct
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import zmq

from hpcml.errors import ConfigError
from hpcml.stream import message

TOKEN_BYTES = 64
ALIGN = 64
#: The fixed part of a message's head: the token and the frame count.
FIXED = TOKEN_BYTES + 4
#: The routing id a sender gives its one connection (ZMQ_CONNECT_ROUTING_ID).
ROUTE = b"hpcml-trainer"
#: libzmq's raw engine hands over at most ``in_batch_size`` (8 KiB) a chunk; chunks are read
#: straight into a message when this much of it is still to come, else through a scratch buffer.
SCRATCH = 1 << 16
#: The longest length table read to pass over a message of too many frames (its connection
#: is closed past it: a table of 2**32 lengths is not worth reading).
SKIP_FRAMES = 4096
#: Seconds a connection that has begun its first token may take to finish it before it is
#: closed. One that has sent nothing is left open: a producer connects long before its first
#: output, and closing it as that output goes out would lose the message.
HELLO_S = 10.0
#: Seconds a connection may hold an unfinished message without a byte more, while the server
#: reads and nothing is queued, before it is closed and the message dropped (``stalled``):
#: libzmq drops the notice of a connection that closed while its queue was full, so a
#: vanished sender is found by its silence.
STALL_S = 30.0
#: Chunks one :meth:`Receiver.recv` reads at most before it gives the caller its turn.
MAX_CHUNKS = 2048


def token(secret: bytes) -> bytes:
    """The token of a campaign: derived from, never equal to, its secret."""
    return hmac.new(secret, b"hpcml-stream/transport", hashlib.sha256).hexdigest().encode()


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def head_bytes(n_frames: int) -> int:
    return _pad(FIXED + 8 * n_frames)


def frame_buffer(tok: bytes, lengths: Sequence[int]) -> tuple[np.ndarray, list[memoryview]]:
    """One message's buffer with its head written, and a writable view per frame to fill."""
    at = head_bytes(len(lengths))
    offsets = []
    for n in lengths:
        offsets.append(at)
        at += _pad(n)
    buf = np.empty(at, np.uint8)
    view = memoryview(buf)
    head = FIXED + 8 * len(lengths)
    struct.pack_into(f"<{TOKEN_BYTES}sI{len(lengths)}Q", buf, 0, tok, len(lengths), *lengths)
    buf[head:offsets[0] if offsets else at] = 0
    for o, n in zip(offsets, lengths):  # no byte of this process's memory goes out unwritten
        buf[o + n:o + _pad(n)] = 0
    return buf, [view[o:o + n] for o, n in zip(offsets, lengths)]


def pack(tok: bytes, frames: Sequence) -> np.ndarray:
    """The wire bytes of a message of ``frames`` (bytes-like), copied into one buffer."""
    views = [memoryview(f).cast("B") for f in frames]
    buf, out = frame_buffer(tok, [v.nbytes for v in views])
    for dst, src in zip(out, views):
        dst[:] = src
    return buf


def send_limits(sock: zmq.Socket, hwm: int | None, timeout_s: float | None) -> None:
    """A sending socket's queue (``SNDHWM`` messages) and how long a send and its close wait."""
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
    if timeout_s is not None:
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))


class Sender:
    """A producer's connection to one stream server: a ZeroMQ STREAM socket that sends whole
    messages (:meth:`send_buffer`) and reconnects by itself, keeping what it has queued."""

    def __init__(self, ctx: zmq.Context, secret: bytes, *, hwm: int | None = None, timeout_s: float | None = None
                 ) -> None:
        self.token = token(secret)
        self.sock = ctx.socket(zmq.STREAM)
        self.sock.setsockopt(zmq.RCVHWM, 4)  # connect/disconnect notices only; a server sends nothing else
        send_limits(self.sock, hwm, timeout_s)

    def connect(self, endpoint: str) -> None:
        self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, ROUTE)
        self.sock.connect(endpoint)

    def send_message(self, buf, views, flags: int = 0) -> None:
        """One message built by :func:`frame_buffer`: its whole buffer goes out (``views`` are
        for :class:`hpcml.stream.zmtp.Sender`, which sends the frames)."""
        self.send_buffer(buf, flags)

    def send_buffer(self, buf, flags: int = 0) -> None:
        """Queue one message's wire bytes (not copied: ``buf`` must not change afterwards)."""
        while True:  # drop the connect/disconnect notices, so they never fill the inbound queue
            try:
                self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        self.sock.send(ROUTE, flags | zmq.SNDMORE)
        self.sock.send(buf, flags, copy=False)

    def send_multipart(self, frames: Sequence, flags: int = 0, copy: bool = True) -> None:
        """Send ``frames`` as one message (copied into one buffer; ``copy`` is accepted for zmq's signature)."""
        self.send_buffer(pack(self.token, frames), flags)

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger)


def push_socket(ctx: zmq.Context, secret: bytes, *, hwm: int | None = None, timeout_s: float | None = None
                ) -> Sender:
    """A sender that passes a stream server's token check (connect it afterwards)."""
    return Sender(ctx, secret, hwm=hwm, timeout_s=timeout_s)


def bind(rx, host: str, port: int) -> str:
    """Bind ``rx.sock`` to ``host:port`` (0: a free port) and give its address; on failure
    ``rx`` is closed (no socket or thread left behind) and the ZMQError raised."""
    addr = f"tcp://{host}"
    try:
        if port:
            rx.sock.bind(f"{addr}:{port}")
        else:
            port = rx.sock.bind_to_random_port(addr)
    except zmq.ZMQError:
        rx.close()
        raise
    return f"{addr}:{port}"


class _Conn:
    __slots__ = ("peer", "head", "need", "lengths", "body", "view", "fill", "skip", "admitted", "opened", "seen",
                 "dead")

    def __init__(self, peer: int) -> None:
        self.peer, self.admitted, self.dead, self.opened = peer, False, False, 0.0  # opened: its first byte
        self.seen = time.monotonic()  # its last chunk
        self.skip = 0
        """Bytes still to pass over: the body of a refused message, read and not kept."""
        self.reset()

    def reset(self) -> None:
        self.head, self.need, self.lengths = bytearray(), FIXED, ()
        self.body, self.view, self.fill = None, None, 0


class Receiver:
    """The server's STREAM socket on a context of its own; :meth:`recv` gives whole, checked messages."""

    def __init__(self, secret: bytes, *, host: str, port: int, hwm: int, max_frame_bytes: int,
                 max_message_bytes: int) -> None:
        if hwm < 1:
            raise ConfigError(f"RCVHWM {hwm} chunks: expected >= 1")
        self._token = token(secret)
        self.frame_bytes = max_frame_bytes
        self.body_bytes = max_message_bytes + ALIGN * message.MAX_FRAMES
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.STREAM)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind(self, host, port)
        self._conns: dict[bytes, _Conn] = {}
        self._closed: dict[bytes, None] = {}  # the latest closed by this side: their late chunks and notices

        self._ready: deque[tuple[int, list[memoryview]] | message.MessageError] = deque()  # in arrival order
        self._scratch = memoryview(bytearray(SCRATCH))
        self._peers = 0
        self._swept = time.monotonic()
        self.admitted = 0
        """Connections that presented the token."""
        self.refused = 0
        """Connections closed before they presented it (a wrong token, or a token left unfinished)."""

    @property
    def connections(self) -> int:
        return len(self._conns)

    def held_bytes(self) -> int:
        """Bytes of incomplete messages held now (at most ``max_message_bytes`` a connection)."""
        return sum(c.body.nbytes for c in self._conns.values() if c.body is not None)

    def recv(self) -> tuple[int, list[memoryview]]:
        """The next whole message: (the connection's number, its frames); ``zmq.Again`` when no
        message is complete and nothing more is queued (or after :data:`MAX_CHUNKS` chunks). A
        refused message is a :class:`~hpcml.stream.message.MessageError` (counted by the caller)."""
        for _ in range(MAX_CHUNKS):
            if self._ready:
                break
            self._chunk()
        if not self._ready:
            raise zmq.Again()
        got = self._ready.popleft()
        if isinstance(got, message.MessageError):
            raise got
        return got

    def _chunk(self) -> None:
        rid = self.sock.recv(zmq.NOBLOCK)
        c = self._conns.get(rid)
        if c is not None:
            c.seen = time.monotonic()
        if c is not None and c.body is not None and c.body.nbytes - c.fill > SCRATCH:
            n = self.sock.recv_into(c.view[c.fill:c.fill + SCRATCH])
            if 0 < n <= SCRATCH:
                c.fill += n
                return
            data = self._scratch[:0]  # a notice (0), or a chunk too large for libzmq's raw engine
        else:
            n = self.sock.recv_into(self._scratch)
            data = self._scratch[:n]
        if n == 0:
            self._notice(rid, c)
        elif c is None:
            return
        elif n > SCRATCH:
            self._refuse(rid, c, "malformed", f"a chunk of {n} bytes, expected at most {SCRATCH}", close=True)
        else:
            self._feed(rid, c, data)

    def _notice(self, rid: bytes, c: _Conn | None) -> None:
        """libzmq's empty message: a connection opened (unknown id) or closed (known)."""
        if rid in self._closed:
            del self._closed[rid]
        elif c is None:
            self._peers += 1
            self._conns[rid] = _Conn(self._peers)
        else:
            del self._conns[rid]  # an incomplete message goes with it

    def sweep(self) -> None:
        """Close connections that began their first token more than HELLO_S ago and have not
        finished it, and those holding an unfinished message silent for STALL_S (dropped:
        ``stalled``); past the open-file limit, forget the longest silent (their close notices
        were lost: there cannot be more live ones). Call it only when nothing is queued
        (``recv`` raised ``zmq.Again``): a connection whose bytes wait unread is not late."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        for rid, c in list(self._conns.items()):
            if not c.admitted and c.opened and now - c.opened > HELLO_S:
                self.refused += 1
                self._close(rid, c)
            elif c.admitted and (c.head or c.body is not None or c.skip) and now - c.seen > STALL_S:
                self._ready.append(message.MessageError("stalled", f"connection {c.peer} sent no byte of its "
                                                        f"message for {now - c.seen:.0f} s (its sender gone?)"))
                self._close(rid, c)
        excess = len(self._conns) - resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        for rid in sorted(self._conns, key=lambda r: self._conns[r].seen)[:max(0, excess)]:
            self._close(rid, self._conns[rid])

    def _close(self, rid: bytes, c: _Conn) -> None:
        c.dead, c.head, c.body, c.view = True, bytearray(), None, None
        self._conns.pop(rid, None)
        self._closed[rid] = None  # ids are never reused: a late chunk of this one is ignored
        if len(self._closed) > 4096:
            del self._closed[next(iter(self._closed))]
        try:
            self.sock.send_multipart([rid, b""], zmq.NOBLOCK)  # closes the connection
        except zmq.ZMQError:
            pass

    def _refuse(self, rid: bytes, c: _Conn, reason: str, detail: str, *, close: bool = False, skip: int = 0) -> None:
        """A refused message: counted in order with the others; its body passed over (``skip``),
        or, where the framing cannot be followed, its connection closed."""
        self._ready.append(message.MessageError(reason, detail))
        c.reset()
        c.skip = skip
        if close:
            self._close(rid, c)

    def _feed(self, rid: bytes, c: _Conn, data: memoryview) -> None:
        pos, n = 0, data.nbytes
        while pos < n and not c.dead:
            if c.skip:
                take = min(c.skip, n - pos)
                c.skip -= take
                pos += take
            elif c.body is None:
                c.opened = c.opened or time.monotonic()
                take = min(c.need - len(c.head), n - pos)
                c.head += data[pos:pos + take]
                pos += take
                if len(c.head) == c.need:
                    self._head(rid, c)
            else:
                take = min(c.body.nbytes - c.fill, n - pos)
                c.view[c.fill:c.fill + take] = data[pos:pos + take]
                c.fill += take
                pos += take
            if c.body is not None and c.fill == c.body.nbytes:
                self._complete(c)

    def _head(self, rid: bytes, c: _Conn) -> None:
        if c.need == FIXED:
            if not hmac.compare_digest(bytes(c.head[:TOKEN_BYTES]), self._token):
                if c.admitted:  # a message of an admitted peer that does not start where one must
                    return self._refuse(rid, c, "malformed", "no token where a message starts", close=True)
                self.refused += 1
                return self._close(rid, c)
            if not c.admitted:
                c.admitted = True
                self.admitted += 1
            k = struct.unpack_from("<I", c.head, TOKEN_BYTES)[0]
            if k > SKIP_FRAMES:  # its length table is not worth reading: the connection goes
                return self._refuse(rid, c, "too_many_frames", f"{k} frames, expected at most {message.MAX_FRAMES}",
                                    close=True)
            c.need = head_bytes(k)
            return
        k = struct.unpack_from("<I", c.head, TOKEN_BYTES)[0]
        lengths = struct.unpack_from(f"<{k}Q", c.head, FIXED)
        total = sum(_pad(x) for x in lengths)
        if not 3 <= k <= message.MAX_FRAMES:
            return self._refuse(rid, c, "malformed" if k < 3 else "too_many_frames",
                                f"{k} frames, expected 3 to {message.MAX_FRAMES}", skip=total)
        if max(lengths) > self.frame_bytes or total > self.body_bytes:
            return self._refuse(rid, c, "oversized", f"frames of up to {max(lengths)} bytes (at most "
                                f"{self.frame_bytes}), {total} in all (at most {self.body_bytes})", skip=total)
        raw = np.empty(total + ALIGN, np.uint8)
        at = -raw.ctypes.data % ALIGN  # frames start on 64-byte boundaries: arrays as aligned as libzmq's
        c.lengths, c.body, c.fill = lengths, raw[at:at + total], 0
        c.view = memoryview(c.body)

    def _complete(self, c: _Conn) -> None:
        frames, at = [], 0
        for n in c.lengths:
            frames.append(c.view[at:at + n])
            at += _pad(n)
        self._ready.append((c.peer, frames))
        c.reset()

    def close(self) -> None:
        self.ctx.destroy(linger=0)  # every socket of this context, queued messages dropped
