"""How one connection's bytes become messages: the framed wire's state machine, per connection.

A connection is in one state at a time and reads only what that state wants, so no byte
of a message is read before its length table has been checked (:mod:`hpcml.stream.framing`):

    S_HELLO  the 64 answer bytes of the challenge (pending; :mod:`hpcml.stream.handshake`)
    S_HEAD   the first 64 bytes of a head (every head has at least that many): magic, frame
             count and the first 7 lengths, with their padding (a message of up to 7 frames
             in one read)
    S_TABLE  the rest of the frame lengths: a short table whole, a long one streamed by and summed
    S_TPAD   the table's padding, passed over; then the message is refused or queued
    S_WAIT   waiting for memory (:attr:`Receiver.max_held_bytes`): its connection unread
    S_BODY   read straight into the message's one buffer, in as few calls as the kernel allows
    S_SKIP   a refused message's bytes, read into scratch and passed over

:class:`MessageReader` is the reading half of :class:`hpcml.stream.transport.Receiver`,
which owns the sockets, admission, memory and eviction.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time

import numpy as np

from hpcml.stream import handshake, message
from hpcml.stream.framing import ALIGN, FIXED, MAGIC, head_bytes, pad, padded

#: Bytes read from one connection in one round at most (the others' turn comes first).
ROUND_BYTES = 4 << 20
#: The scratch buffer: bytes passed over (refused messages, padding) and long length tables.
SCRATCH = 1 << 18
#: When a message's bytes run out mid-body, the socket wakes the server again only once this many
#: more (or the rest, if fewer) are in (``SO_RCVLOWAT``; the kernel caps it at half its largest
#: receive buffer, ``tcp_rmem``): a round per message, not per segment. Bytes the kernel holds
#: below the mark count as progress all the same (:meth:`Conn.progress`).
LOWAT = 16 << 20
#: Messages (or refusals) one :meth:`Receiver.recv` round yields at most before it returns.
ROUND_MESSAGES = 256
S_HELLO, S_HEAD, S_TABLE, S_TPAD, S_WAIT, S_BODY, S_SKIP = range(7)


class Conn:
    __slots__ = ("sock", "peer", "state", "nonce", "head", "frames", "left", "lengths", "total", "body", "view",
                 "fill", "skip", "opened", "seen", "taken", "acked", "owed_since", "out", "started", "lowat", "queued")

    def __init__(self, sock: socket.socket, peer: int, nonce: bytes) -> None:
        self.sock, self.peer, self.nonce, self.state = sock, peer, nonce, S_HELLO
        self.opened = self.seen = self.started = time.monotonic()
        self.head, self.frames, self.left, self.lengths, self.total = bytearray(), 0, 0, (), 0
        self.body, self.view, self.fill, self.skip, self.taken = None, None, 0, 0, 0
        self.acked, self.out = 0, bytearray()  # the count sent so far; bytes due to the producer (a reply, acks)
        self.owed_since = 0.0  # when the oldest message not yet acknowledged was taken
        self.lowat = 1  # the socket's SO_RCVLOWAT now
        self.queued = 0  # bytes the kernel held for it when last asked (:meth:`progress`)

    def need(self) -> int:
        """Bytes the head-collecting states want next (no byte of the message after them is read)."""
        if self.state == S_HELLO:
            return handshake.ANSWER_BYTES - len(self.head)
        if self.state == S_HEAD:
            return ALIGN - len(self.head)
        if self.frames <= message.MAX_FRAMES:  # S_TABLE: the whole (short) table at once
            return 8 * self.frames - len(self.head)
        return min(8 * self.left - len(self.head), SCRATCH - 8)  # a long one streams by

    def progress(self, now: float) -> None:
        """Count bytes waiting in the kernel below the low-water mark as bytes sent: a slow
        sender whose message is not yet at the mark is not silent."""
        try:
            queued = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            return
        if queued > self.queued:
            self.seen = now
        self.queued = queued

    def busy(self) -> bool:
        """In the middle of a message."""
        return self.state in (S_TABLE, S_TPAD, S_BODY, S_SKIP, S_WAIT) or (self.state == S_HEAD and bool(self.head))


class MessageReader:
    """Reads admitted connections' messages into ``_ready`` (the Receiver provides the sockets,
    ``_admit``, ``_drop``, ``_close``, ``_give_memory`` and the memory queue ``_waiting``)."""

    def _read(self, c: Conn) -> None:
        got, ready, sock, want = 0, self._ready, c.sock, 0
        while got < ROUND_BYTES and len(ready) < ROUND_MESSAGES:
            state = c.state
            if state == S_BODY:  # straight into the message's buffer
                want = c.total - c.fill
                room = c.view[c.fill:c.fill + min(want, ROUND_BYTES)]
            elif state == S_WAIT:
                break
            else:
                room = self._scratch[:min(c.skip, SCRATCH) if state in (S_SKIP, S_TPAD) else c.need()]
            try:
                n = sock.recv_into(room)
            except BlockingIOError:
                if state == S_BODY:
                    _lowat(c, min(want, LOWAT))
                break
            except OSError:
                n = 0
            if not n:
                return self._drop(c)
            got += n
            if state == S_BODY:
                c.fill += n
                if n == want:  # one message a connection a round: the others' turn comes first
                    self._complete(c)
                    break
            elif not self._took(c, room[:n]):
                return
        if got:
            c.seen, c.queued = time.monotonic(), 0

    def _took(self, c: Conn, data: memoryview) -> bool:
        """Account ``data`` just read for ``c``; False once ``c`` is closed."""
        n = data.nbytes
        if c.state in (S_SKIP, S_TPAD):
            c.skip -= n
            if not c.skip:
                self._taken(c) if c.state == S_SKIP else self._decide(c)
        elif c.state == S_TABLE and c.frames > message.MAX_FRAMES:  # summed as it streams by, never kept
            buf = bytes(c.head) + bytes(data)
            whole = len(buf) // 8 * 8
            c.total += int(np.sum((np.frombuffer(buf[:whole], "<u8") // 64).astype(object))) * 64 + 64 * int(
                np.count_nonzero(np.frombuffer(buf[:whole], "<u8") % 64))
            c.left -= whole // 8
            c.head = bytearray(buf[whole:])
            if not c.left:
                self._table_done(c)
        else:
            c.head += data
            if c.need() == 0:
                return self._step(c)
        return True

    def _step(self, c: Conn) -> bool:
        """A head part is complete; False if ``c`` was closed."""
        if c.state == S_HELLO:
            return self._admit(c, handshake.check_answer(self._key, c.nonce, bytes(c.head)))
        if c.state == S_HEAD:
            magic, c.frames = struct.unpack_from("<II", c.head)
            if magic != MAGIC:
                self._ready.append((None, message.MessageError("malformed", f"connection {c.peer}: no message "
                                                               f"starts where one must (magic {magic:#x})")))
                self._close(c, evicted=True)
                return False
            c.left, c.total = c.frames, 0
            if FIXED + 8 * c.frames <= ALIGN:  # the whole head is in: table and padding
                c.lengths = struct.unpack_from(f"<{c.frames}Q", c.head, FIXED)
                c.total, c.head = padded(c.lengths), bytearray()
                self._decide(c)
            else:  # the table goes on: what came of it stays in ``head``
                c.head, c.lengths, c.state = c.head[FIXED:], (), S_TABLE
            return c.sock.fileno() >= 0
        c.lengths = struct.unpack(f"<{c.frames}Q", c.head)  # S_TABLE, a short one
        c.total, c.head, c.left = padded(c.lengths), bytearray(), 0
        self._table_done(c)
        return True

    def _table_done(self, c: Conn) -> None:
        c.head, c.skip = bytearray(), head_bytes(c.frames) - FIXED - 8 * c.frames  # the table's padding
        c.state = S_TPAD
        if not c.skip:
            self._decide(c)

    def _decide(self, c: Conn) -> None:
        """The whole head is in: refuse the message (its body passed over) or queue it for memory."""
        k, total = c.frames, c.total
        if k > message.MAX_FRAMES:
            return self._refuse_msg(c, "too_many_frames", f"{k} frames, expected at most {message.MAX_FRAMES}")
        if k < 2:  # magic and header at least (an end marker on an authenticated connection)
            return self._refuse_msg(c, "malformed", f"{k} frames, expected 2 to {message.MAX_FRAMES}")
        if max(c.lengths) > self.frame_bytes or total > self.body_bytes:
            return self._refuse_msg(c, "oversized", f"frames of up to {max(c.lengths)} bytes (at most "
                                    f"{self.frame_bytes}), {total} in all (at most {self.body_bytes})")
        if not self._waiting and self.held + total <= self.max_held_bytes:  # memory free now: read on at once
            return self._give_memory(c)
        c.state = S_WAIT
        self._waiting.append(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass

    def _refuse_msg(self, c: Conn, reason: str, detail: str) -> None:
        self._ready.append((c, message.MessageError(reason, f"connection {c.peer}: {detail}")))
        c.skip, c.state = c.total, S_SKIP
        if not c.skip:
            self._taken(c)

    def _taken(self, c: Conn) -> None:
        """One message of ``c``'s read (whole, or refused and passed over): the next may start.
        It is acknowledged when :meth:`recv` hands it over."""
        c.state, c.head, c.lengths = S_HEAD, bytearray(), ()

    def _complete(self, c: Conn) -> None:
        if c.lowat != 1:
            _lowat(c, 1)
        frames, at = [], 0
        for n in c.lengths:
            frames.append(c.view[at:at + n])
            at += pad(n)
        self._ready.append((c, (c.peer, frames)))
        self.held -= c.body.nbytes
        c.body, c.view = None, None
        self._taken(c)


def _lowat(c: Conn, n: int) -> None:
    """Wake the server for ``c`` once ``n`` bytes are in (a close or an error wakes it whatever ``n``)."""
    try:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
        c.lowat = n
    except OSError:
        pass
