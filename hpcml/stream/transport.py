"""The stream's default wire, the server side: plain non-blocking TCP, every byte bounded.

One listening socket and every connection on one ``selectors`` loop (epoll), in the server's
thread. A message is read straight into the one buffer it will live in (``recv_into`` of
whatever the kernel holds, up to :data:`ROUND_BYTES` a connection a round), so a MiB costs a
copy out of the kernel, not a call per 8 KiB. Bounds, in the order a byte meets them:

1. **Strangers.** A new connection gets a fresh challenge and must answer it within
   :data:`HELLO_S` (:mod:`hpcml.stream.handshake`); until then it is *pending*: at most
   :attr:`Receiver.pending_max` at once (more wait in the kernel's accept queue, and one
   pending past :data:`PENDING_GRACE_S` is closed to make room), its 64 answer bytes the only
   ones read. A wrong answer is refused and closed. No number of strangers can take the file
   descriptors that producers and checkpoints need.
2. **Connections.** At start the open-file limit is raised to what the system allows; producers
   hold at most ``fd_limit - RESERVE_FDS - pending_max`` connections (:attr:`max_connections`),
   past which the longest silent one is closed (an honest producer reconnects and resends).
3. **The length table** is checked before anything is allocated: 3 to ``message.MAX_FRAMES``
   frames, each at most ``frame_bytes``, all at most ``message_bytes``; a message that breaks
   them is a :class:`~hpcml.stream.message.MessageError` (counted, dropped) and its bytes are
   read and passed over, never kept (a table of any length is summed as it streams by).
4. **Memory.** One buffer per message in flight, at most ``message_bytes`` a connection and
   :attr:`max_held_bytes` for all of them: a message that does not fit waits (its connection
   unread, its bytes in the kernel) until others complete; while one waits, a holder silent
   for :data:`IDLE_EVICT_S` is closed. One silent for :data:`STALL_S` with an unfinished
   message is closed anyway (``stalled``).
5. **Fairness.** Every ready connection gets up to :data:`ROUND_BYTES` per round.

Each message is acknowledged once :meth:`Receiver.recv` has handed it to the server
(:mod:`hpcml.stream.framing`); a connection that closes before that is counted
(:attr:`cut`, when mid-message), and its producer sends again what was not acknowledged.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections import deque

from zmq import Again

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.stream import handshake, message
from hpcml.stream.budget import raise_fd_limit
from hpcml.stream.framing import ACK, ALIGN
from hpcml.stream.pool import BufferPool
from hpcml.stream.reading import ROUND_MESSAGES, S_BODY, S_HEAD, S_WAIT, SCRATCH, Conn, MessageReader

logger = log.get_logger(__name__)

#: Seconds a new connection has to answer the challenge.
HELLO_S = 5.0
#: Connections that have not answered yet, at most: an eighth of the open-file limit, within
#: these bounds (while that many wait, new ones stay in the kernel's accept queue, unless the
#: oldest has had :data:`PENDING_GRACE_S`: it is then closed).
PENDING_MIN, PENDING_MAX = 128, 4096
#: Seconds a pending connection is safe from being crowded out: a producer answers in one round
#: trip, a loaded node's in well under this.
PENDING_GRACE_S = 1.0
#: File descriptors kept free of connections: checkpoints, logs, the loader's files.
RESERVE_FDS = 128
#: Seconds a connection may hold an unfinished message without a byte more, while the server
#: reads, before it is closed and the message dropped (``stalled``).
STALL_S = 30.0
#: While a message waits for memory, a holder of an unfinished one silent this long is closed,
#: and so is one whose message has taken longer than this plus its size at :data:`MIN_RATE`.
IDLE_EVICT_S = 2.0
#: Bytes a second below which a message holding memory others wait for is too slow.
MIN_RATE = 1 << 20
#: While messages flow, a connection's acknowledgement goes out once this many of its messages are
#: unacknowledged (a Producer holds ``hwm`` = 4 by default): each one is a loopback send that cost
#: as much as the rest of a message's reading. All that are due go out before the server waits.
ACK_EVERY = 2
#: ... or once the oldest of them has waited this long (a producer's close waits for them all).
ACK_DELAY_S = 0.005


def listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A non-blocking listening socket on ``host:port`` (0: a free port) and its address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    port = sock.getsockname()[1]
    return sock, f"tcp://{'[' + host + ']' if family == socket.AF_INET6 else host}:{port}"


class Receiver(MessageReader):
    """The server's listening socket and its connections; :meth:`recv` gives whole, checked messages."""

    def __init__(self, secret: bytes, *, host: str, port: int, max_frame_bytes: int, max_message_bytes: int,
                 max_held_bytes: int | None = None, info: bytes = b"{}") -> None:
        self.frame_bytes = max_frame_bytes
        self.body_bytes = max_message_bytes + ALIGN * message.MAX_FRAMES
        self.max_held_bytes = max(2 * self.body_bytes, max_held_bytes or 0)
        """All connections' unfinished messages together hold at most this much."""
        if len(info) > handshake.MAX_INFO_BYTES:
            raise ConfigError(f"stream handshake info of {len(info)} bytes: expected at most "
                              f"{handshake.MAX_INFO_BYTES}")
        self._key, self._info = handshake.key(secret), info
        self.fd_limit = raise_fd_limit()
        self.pending_max = min(max(PENDING_MIN, self.fd_limit // 8), PENDING_MAX)
        """Connections that have not answered the challenge yet, at most."""
        self.max_connections = max(1, self.fd_limit - RESERVE_FDS - self.pending_max)
        """Producer connections this server holds at once."""
        self.sock, self.endpoint = listen(host, port)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._pending: dict[int, Conn] = {}  # fd -> connection, oldest first
        self._conns: dict[int, Conn] = {}
        self._waiting: deque[Conn] = deque()  # admitted, their next message waiting for memory
        self._ready: deque[tuple[Conn | None, tuple[int, list[memoryview]] | message.MessageError]] = deque()
        self._ack_due: dict[int, Conn] = {}
        self._events: list | None = None
        self._scratch = memoryview(bytearray(SCRATCH))
        self._pool = BufferPool(align=ALIGN)
        self._peers = 0
        self._swept = self._reading = time.monotonic()
        self._capped_logged = 0.0
        self._paused = False
        self._accept_after = 0.0
        self.held = 0
        self.admitted = 0
        """Connections that answered the challenge."""
        self.refused = 0
        """Connections closed before they answered it (a wrong answer, none in time, crowded out)."""
        self.evicted = 0
        """Admitted connections closed to make room (connections or memory) or for stalling."""
        self.cut = 0
        """Connections that closed in the middle of a message (its producer sends it again)."""

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def held_bytes(self) -> int:
        """Bytes of unfinished messages held now (at most :attr:`max_held_bytes`)."""
        return self.held

    # -- the server's loop ---------------------------------------------------------------------
    def wait(self, timeout_s: float) -> None:
        """Block until some socket is ready (or ``timeout_s``); :meth:`recv` reads them."""
        if not self._ready and self._events is None:
            self.flush()  # nothing more to read now: no producer waits on an acknowledgement while we wait
            self._resume_accepting()
            self._events = self._sel.select(timeout_s)

    def recv(self) -> tuple[int, list[memoryview]]:
        """The next whole message: (the connection's number, its frames, views into one aligned
        buffer); ``zmq.Again`` when none is complete. A refused message is a MessageError."""
        got = self.poll()
        if got is None:
            raise Again()
        return got

    def poll(self) -> tuple[int, list[memoryview]] | None:
        """:meth:`recv`, None when no message is complete (the server's loop: no exception a round)."""
        if not self._ready:
            self._round()
            if not self._ready:
                return None
        c, got = self._ready.popleft()
        if c is not None and c.sock.fileno() >= 0:  # acknowledged once the server has it in hand
            if c.taken == c.acked:
                c.owed_since = time.monotonic()
            c.taken += 1
            self._ack_due[c.sock.fileno()] = c  # the count goes out at the next flush
        if isinstance(got, message.MessageError):
            raise got
        return got

    def _pause_accepting(self, for_s: float = 0.0) -> None:
        """Leave new connections in the kernel's queue until a pending one answers or ages
        (and at least ``for_s``: out of descriptors)."""
        self._accept_after = time.monotonic() + for_s
        if not self._paused:
            self._sel.unregister(self.sock)
            self._paused = True

    def _resume_accepting(self) -> None:
        now = time.monotonic()
        if self._paused and now >= self._accept_after and (len(self._pending) < self.pending_max or now - next(
                iter(self._pending.values())).opened >= PENDING_GRACE_S):
            self._sel.register(self.sock, selectors.EVENT_READ, None)
            self._paused = False

    def _round(self) -> None:
        self._resume_accepting()
        events = self._events if self._events is not None else self._sel.select(0)
        self._events = None
        now = time.monotonic()
        if now - self._reading > 1.0:  # the server did not read (backpressure): nobody was silent meanwhile
            for c in self._conns.values():
                c.seen += now - self._reading
                c.started += now - self._reading
        self._reading = now
        for i, (k, _) in enumerate(events):
            if len(self._ready) >= ROUND_MESSAGES:  # the rest are served first next round, none starved
                self._events = events[i:]
                break
            if k.data is None:
                self._accept()
            elif (fd := k.data.sock.fileno()) >= 0 and (self._conns.get(fd) or self._pending.get(fd)) is k.data:
                self._read(k.data)
        self._place_waiting()
        self.flush(ACK_EVERY)

    def flush(self, every: int = 1) -> None:
        """Send what is due to producers -- acknowledgements, the rest of a handshake reply -- as
        far as their sockets take it; an acknowledgement once ``every`` messages or
        :data:`ACK_DELAY_S` wait for it (1: all now; :meth:`wait`, and the server when it stops reading)."""
        now = time.monotonic() if every > 1 else 0.0
        for fd, c in list(self._ack_due.items()):
            owed = c.taken - c.acked
            if owed and (owed >= every or c.out or now - c.owed_since >= ACK_DELAY_S):
                c.out += ACK.pack(c.taken)
                c.acked = c.taken
            if not c.out:
                if c.taken == c.acked:
                    del self._ack_due[fd]
                continue  # its acknowledgement later
            try:
                n = c.sock.send(c.out)
            except BlockingIOError:
                continue  # its next round
            except OSError:
                self._drop(c)
                continue
            del c.out[:n]
            if not c.out and c.taken == c.acked:
                del self._ack_due[fd]

    def _send(self, c: Conn, data: bytes) -> None:
        """Queue ``data`` for ``c`` behind what it already waits for, and send what its socket takes."""
        c.out += data
        self._ack_due[c.sock.fileno()] = c

    def _accept(self) -> None:
        for _ in range(256):
            crowded = len(self._pending) >= self.pending_max
            if crowded and time.monotonic() - next(iter(self._pending.values())).opened < PENDING_GRACE_S:
                return self._pause_accepting()
            try:
                sock, _addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    self._refuse(next(iter(self._pending.values())))  # a descriptor for the next
                    continue
                logger.warning("stream server: accept failed (%s): not accepting for a second", e)
                return self._pause_accepting(1.0)
            if crowded:
                self._refuse(next(iter(self._pending.values())))  # crowded out: a producer would have answered
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            first, nonce = handshake.hello()
            try:
                sock.send(first)  # 48 bytes into an empty send buffer
            except OSError:
                sock.close()
                continue
            self._peers += 1
            c = Conn(sock, self._peers, nonce)
            self._pending[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _place_waiting(self) -> None:
        """Give memory to the messages that wait for it, in order of arrival."""
        while self._waiting:
            c = self._waiting[0]
            if c.sock.fileno() < 0:
                self._waiting.popleft()
                continue
            if self.held + c.total > self.max_held_bytes:
                return
            self._waiting.popleft()
            self._sel.register(c.sock, selectors.EVENT_READ, c)
            self._give_memory(c)

    def _give_memory(self, c: Conn) -> None:
        """The one buffer ``c``'s message is read into (its bytes counted as held)."""
        c.body, c.fill, c.state, c.started = self._pool.take(c.total), 0, S_BODY, time.monotonic()
        c.view = memoryview(c.body)
        self.held += c.total
        if not c.total:
            self._complete(c)

    def _admit(self, c: Conn, nonce_p: bytes | None) -> bool:
        fd = c.sock.fileno()
        del self._pending[fd]
        if nonce_p is None:
            try:
                c.sock.send(b"\0")
            except OSError:
                pass
            self.refused += 1
            self._close(c)
            return False
        self._send(c, handshake.reply(self._key, c.nonce, nonce_p, self._info))
        if len(self._conns) >= self.max_connections:
            self._make_room()
        self._conns[fd] = c
        self.admitted += 1
        c.head, c.state = bytearray(), S_HEAD
        return True

    def _make_room(self) -> None:
        now = time.monotonic()
        if now - self._capped_logged > 60:
            self._capped_logged = now
            logger.warning("stream server holds its cap of %d producer connections (open-file limit %d): the "
                           "longest silent is closed for each new one; raise the limit (ulimit -n) or add "
                           "trainer ranks", self.max_connections, self.fd_limit)
        victim = min(self._conns.values(), key=lambda c: (c.busy(), c.seen))
        self.evicted += 1
        self._close(victim)

    def _drop(self, c: Conn) -> None:
        """The peer closed (or broke) the connection."""
        if c.sock.fileno() in self._conns and c.busy():
            self.cut += 1
            logger.info("stream connection %d closed in the middle of a message (%d of %d bytes in): its producer "
                        "sends it again", c.peer, c.fill, c.total)
        self._close(c)

    def _refuse(self, c: Conn) -> None:
        self.refused += 1
        self._close(c)

    def _close(self, c: Conn, *, evicted: bool = False) -> None:
        fd = c.sock.fileno()
        if fd < 0:
            return
        self.evicted += evicted
        self._pending.pop(fd, None)
        self._conns.pop(fd, None)
        self._ack_due.pop(fd, None)
        if c.body is not None:
            self.held -= c.body.nbytes
        c.body, c.view, c.head = None, None, bytearray()
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def sweep(self) -> None:
        """Once a second: close pending connections past :data:`HELLO_S`, stalled messages'
        connections, and -- while a message waits for memory -- holders silent for
        :data:`IDLE_EVICT_S`. Call it when nothing is queued (``recv`` raised ``zmq.Again``)."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        for c in [c for c in self._pending.values() if now - c.opened > HELLO_S]:
            self._refuse(c)
        waiting = any(c.sock.fileno() >= 0 for c in self._waiting)
        for c in list(self._conns.values()):
            if c.body is not None and now - c.seen > IDLE_EVICT_S:
                c.progress(now)  # bytes in the kernel below the low-water mark are not silence
            silent, slow = now - c.seen, c.body is not None and now - c.started > IDLE_EVICT_S + c.total / MIN_RATE
            if c.busy() and c.state != S_WAIT and (silent > STALL_S or (waiting and c.body is not None
                                                                          and (silent > IDLE_EVICT_S or slow))):
                why = (f"sent no byte of its message for {silent:.0f} s (its sender gone?)" if silent > STALL_S else
                       f"held {c.total} bytes of memory others waited for, {c.fill} of them filled in "
                       f"{now - c.started:.0f} s")
                self._ready.append((None, message.MessageError("stalled", f"connection {c.peer} {why}")))
                self._close(c, evicted=True)
        self._place_waiting()

    def stats(self) -> dict:
        return {"admitted": self.admitted, "refused": self.refused, "evicted": self.evicted, "cut": self.cut,
                "connections": len(self._conns), "pending": len(self._pending), "held_bytes": self.held,
                "max_held_bytes": self.max_held_bytes, "max_connections": self.max_connections,
                "pending_max": self.pending_max,
                "fd_limit": self.fd_limit}

    def close(self) -> None:
        self.flush()  # what the server took is acknowledged before it goes: not sent again to the next
        for c in [*self._pending.values(), *self._conns.values(), *self._waiting]:
            self._close(c)
        self._sel.close()
        self.sock.close()
        self._pool = BufferPool(align=ALIGN)  # its free buffers go now, not with the server object
