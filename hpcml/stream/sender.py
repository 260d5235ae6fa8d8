"""A producer's connection to one stream server: plain TCP, a thread that sends and resends.

:meth:`Sender.send_buffer` queues one message (the producer's one buffer, not copied) and
returns, so the simulation computes while its output goes out; it blocks once ``hwm``
messages are held (queued or sent and not yet acknowledged): the trainer's backpressure.
The caller's thread hands a message to the kernel itself when nothing is ahead of it (no
thread switch per message: one cost half the sender's CPU) and takes the acknowledgements
once ``hwm`` messages are held (a read after every message cost ~5% of it); the thread
connects, answers the server's challenge
(:mod:`hpcml.stream.handshake`), sends what the socket did not take at once, and waits for
acknowledgements when someone waits for them (a full ``hwm``, a close)
(:mod:`hpcml.stream.framing`). When the
connection drops it reconnects and sends again exactly the messages the server had not
acknowledged, so a cut connection loses nothing this process still holds (a message the
server took but whose acknowledgement was cut arrives twice: the trainer drops the copy).
A refused proof is final (:class:`~hpcml.stream.handshake.HandshakeError`): no reconnecting.
Imports no torch.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

from zmq import NOBLOCK, Again

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.stream import framing, handshake

logger = log.get_logger(__name__)

#: Seconds a connection attempt and its handshake may take.
CONNECT_S = 10.0
#: Seconds to wait for the server's first bytes once the kernel has taken the connection: it
#: waits in the server's accept queue, which a flood of strangers fills. The server takes them at
#: ``pending_max`` (>= 128) a ``PENDING_GRACE_S`` (1 s), so its 4,096-deep queue drains in <= 32 s:
#: waiting keeps this producer's place, and giving up after CONNECT_S put it at the back again --
#: under a sustained flood, for ever.
HELLO_WAIT_S = 60.0
#: Bytes one ``send`` call hands the kernel at most.
SEND_MAX = 4 << 20


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of ``tcp://HOST:PORT`` (``[v6]`` hosts too), or a ConfigError naming it."""
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if rest == endpoint or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"stream endpoint {endpoint!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


class Sender:
    """Sends whole messages to one server over TCP; reconnects and resends what was not taken."""

    def __init__(self, secret: bytes, *, hwm: int | None = None, timeout_s: float | None = None) -> None:
        self._key = handshake.key(secret)
        self.hwm = hwm or 0
        """Messages held here (queued or unacknowledged) before a send blocks; 0: no bound."""
        self.timeout_s = 600.0 if timeout_s is None else timeout_s
        self._cv = threading.Condition()
        self._items: deque[list[memoryview]] = deque()  # every message not acknowledged yet, in order (its parts)
        self._next = 0  # index in _items of the next to send on this connection
        self._off = 0  # bytes of it already sent
        self._taken = 0  # acknowledgements on this connection, applied
        self._ack_to = 0  # the highest count the server sent on this connection (may run ahead of _next:
        #                   a refused message is acknowledged once its head is read, before its body is sent)
        self._sock: socket.socket | None = None  # the connection (handshake done); used under _cv only
        self._acks = bytearray()  # acknowledgement bytes read, not yet a whole count
        self._blocked = 0  # callers waiting for room (the thread then reads acknowledgements)
        self._closing = self._stop = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._addr: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self.info: dict | None = None
        """What the server said of itself and its samples at the handshake."""
        self.error: handshake.HandshakeError | None = None
        """Why this sender gave up (a refused proof), or None."""
        self.connections = 0
        self.resent = 0
        """Messages sent again after a connection dropped before they were acknowledged."""
        self.undelivered = 0
        """Messages the server had not acknowledged when :meth:`close` gave up."""

    # -- the caller's side ------------------------------------------------------------------
    def connect(self, endpoint: str) -> None:
        self._addr = parse_endpoint(endpoint)
        self._thread = threading.Thread(target=self._run, name="hpcml-stream-sender", daemon=True)
        self._thread.start()

    def wait_info(self, timeout_s: float) -> dict | None:
        """The server's handshake info, waiting for the first handshake up to ``timeout_s``;
        None if none finished in time. Raises the sender's final error."""
        with self._cv:
            self._cv.wait_for(lambda: self.info is not None or self.error is not None, timeout_s)
            if self.error is not None:
                raise self.error
            return self.info

    def send_message(self, buf, views, flags: int = 0) -> None:
        """One message built by :func:`framing.frame_buffer` (``views`` serve the zmtp wire)."""
        self.send_buffer(buf, flags)

    def send_frames(self, frames: Sequence) -> None:
        """One message of ``frames``, none copied (:func:`framing.parts`)."""
        self.send_parts(framing.parts(frames))

    def send_multipart(self, frames: Sequence, flags: int = 0, copy: bool = True) -> None:
        """Send ``frames`` as one message (copied into one buffer; ``copy`` is accepted for zmq's signature)."""
        self.send_buffer(framing.pack(frames), flags)

    def send_buffer(self, buf, flags: int = 0) -> None:
        """Queue one message's wire bytes (not copied: ``buf`` must not change afterwards);
        ``zmq.Again`` if ``hwm`` are held for ``timeout_s`` (at once with ``NOBLOCK``)."""
        self.send_parts([buf], flags)

    def send_parts(self, parts: Sequence, flags: int = 0) -> None:
        """Queue one message given as the consecutive pieces of its wire bytes (sent with one
        ``sendmsg``, none copied: none may change until the server acknowledged it)."""
        item = [memoryview(p).cast("B") for p in parts]
        with self._cv:
            if self._full():
                self._take_acks()  # what the server acknowledged meanwhile makes room
            if self._full():
                if flags & NOBLOCK:
                    raise Again()
                self._blocked += 1
                self._wake()  # the thread reads acknowledgements while someone waits for them
                try:
                    if not self._cv.wait_for(lambda: not self._full(), self.timeout_s):
                        raise Again()
                finally:
                    self._blocked -= 1
            if self.error is not None:
                raise self.error
            self._items.append(item)
            if self._next == len(self._items) - 1:  # nothing ahead of it: to the kernel from this thread
                self._push()
                if not self.hwm or len(self._items) >= self.hwm:  # acknowledgements read once they make room:
                    self._take_acks()  # a read after every message cost ~5% of the sender's CPU
            backlog = self._next < len(self._items)
            self._cv.notify_all()  # a thread waiting for something to send before it reconnects
        if backlog:
            self._wake()

    def _full(self) -> bool:
        return bool(self.hwm) and len(self._items) >= self.hwm and self.error is None

    def _push(self) -> None:
        """Send what the socket takes now, from the next unsent message on (lock held)."""
        sock = self._sock
        while sock is not None and self._next < len(self._items):
            item = self._items[self._next]
            try:
                self._off += sock.sendmsg(_rest(item, self._off))
            except BlockingIOError:
                return
            except OSError:
                return self._broken(sock)
            if self._off < sum(p.nbytes for p in item):
                return
            self._next += 1
            self._off = 0
            self._pop_acked()

    def _take_acks(self) -> None:
        """Take the acknowledgements waiting on the socket, without waiting (lock held)."""
        sock = self._sock
        if sock is None:
            return
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            return self._broken(sock)
        if not data:
            return self._broken(sock)
        self._acks += data
        self._count_acks()

    def _last_acks(self, sock: socket.socket) -> None:
        """What the server acknowledged on ``sock`` before the connection went, still in the
        kernel (a reset leaves the received bytes readable), taken before it is closed (lock
        held): those messages are not sent again on the next connection."""
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:  # BlockingIOError too: nothing more
                return
            if not data:
                return
            self._acks += data
            self._count_acks()

    def _count_acks(self) -> None:
        n = len(self._acks) // 8 * 8
        if n:
            taken = framing.ACK.unpack_from(self._acks, n - 8)[0]
            del self._acks[:n]
            if self._ack_to < taken <= self._taken + len(self._items):  # else stale, or not our server's count
                self._ack_to = taken
                self._pop_acked()

    def _broken(self, sock: socket.socket) -> None:
        """``sock`` failed (lock held): the thread closes it, reconnects and resends what was not acknowledged."""
        if self._sock is sock:
            self._sock = None
            self._wake()

    def close(self, linger: int | None = None) -> None:
        """Wait until the server took every message (at most ``timeout_s``, or ``linger`` ms as
        ZeroMQ counts it: 0 none, -1 for ever), then stop; :attr:`undelivered` says what it did not take."""
        wait = self.timeout_s if linger is None else None if linger < 0 else linger / 1000
        with self._cv:
            self._closing = True
            self._wake()
            if self._thread is not None:
                self._cv.wait_for(lambda: not self._items or self.error is not None, wait)
            self._stop = True
            self.undelivered = len(self._items)
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._thread is None or not self._thread.is_alive():  # else it still selects on them: left open
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake, or closed

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._cv:
                if self._stop or (self._closing and not self._items):
                    return
            try:
                sock = self._open()
            except handshake.HandshakeError as e:
                if e.final:
                    return self._fail(e)
                sock = None
            except OSError:
                sock = None
            if sock is None:
                time.sleep(backoff)
                backoff = min(1.0, 2 * backoff)
                continue
            backoff = 0.05
            try:
                self._pump(sock)  # a cut: what was not acknowledged goes again on the next connection
            finally:
                with self._cv:
                    if self._sock is sock:
                        self._sock = None
                    self._last_acks(sock)
                sock.close()
            with self._cv:  # closed while idle (the server made room): reconnect when there is something to send
                self._cv.wait_for(lambda: self._items or self._stop or self._closing)

    def _fail(self, e: handshake.HandshakeError) -> None:
        with self._cv:
            self.error = e
            self._cv.notify_all()
        logger.error("stream sender to %s:%s gave up: %s", *self._addr, e)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self._addr, timeout=CONNECT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(HELLO_WAIT_S)
            hello = _recv_exact(sock, handshake.HELLO_BYTES)
            sock.settimeout(CONNECT_S)
            answer, nonce_p = handshake.answer(self._key, hello)
            sock.sendall(answer)
            head = _recv_exact(sock, 1)
            if head != b"\1":
                handshake.info_length(head)  # a refusal: raises, final
            head += _recv_exact(sock, handshake.REPLY_BYTES - 1)
            info = handshake.check_reply(self._key, hello[len(handshake.HELLO):], nonce_p, head,
                                         _recv_exact(sock, handshake.info_length(head)))
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        with self._cv:
            self.resent += min(self._next, len(self._items)) if self.connections else 0
            self._next = self._off = self._taken = self._ack_to = 0
            self._acks = bytearray()
            self._sock = sock
            self.info = info
            self.connections += 1
            self._cv.notify_all()
        return sock

    def _pump(self, sock: socket.socket) -> None:
        """Send what the caller's thread left and read acknowledgements when someone waits for
        them, until the connection drops or the sender stops. A socket error or hang-up ends it
        whatever is asked for (``poll`` reports those always)."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        mask = -1
        while True:
            with self._cv:
                if self._stop or (self._closing and not self._items) or self._sock is not sock:
                    return
                self._push()
                waited = self._closing or self._blocked > 0
                if waited:
                    self._take_acks()
                if self._sock is not sock:
                    return
                want = (select.POLLIN if waited else 0) | (select.POLLOUT if self._next < len(self._items) else 0)
            if want != mask:
                poller.register(sock, want)  # again: a modify
                mask = want
            for fd, ev in poller.poll(1000):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    with self._cv:
                        self._take_acks()  # what the server acknowledged before it went is not sent again
                    return

    def _pop_acked(self) -> None:
        """Drop the messages the server acknowledged that have left whole (caller holds the lock)."""
        k = min(self._ack_to - self._taken, self._next)
        if k <= 0:
            return
        for _ in range(k):
            self._items.popleft()
        self._next -= k
        self._taken += k
        self._cv.notify_all()


def _rest(parts: list[memoryview], off: int) -> list[memoryview]:
    """What is left of ``parts`` past byte ``off`` (at most ``SEND_MAX`` bytes of it)."""
    out, room = [], SEND_MAX
    for p in parts:
        if off >= p.nbytes:
            off -= p.nbytes
            continue
        out.append(p[off:off + room])
        room -= out[-1].nbytes
        off = 0
        if not room:
            break
    return out


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"the server closed the connection after {len(out)} of {n} handshake bytes")
        out += got
    return bytes(out)
