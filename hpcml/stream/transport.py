"""The stream's ZeroMQ sockets: peers authenticated at the handshake, limits before parsing.

Two gates stand between the network and the decoder, and every connection gets a name:

1. **The handshake.** The server's PULL socket speaks ZeroMQ's PLAIN mechanism and asks a
   ZAP handler (:class:`_Gate`, a thread, one per server context) about every peer: a
   peer must present a token derived from the campaign secret
   (``HMAC-SHA256(secret, "hpcml-stream/transport")``, so the secret itself never goes on
   the wire). ZMTP sends no message before the handshake completes, so a peer without the
   secret gets nothing queued, parsed or buffered: libzmq drops the connection after a
   ~100-byte exchange. The token is a gate, not a signature: it travels in clear, so every
   message is still MAC'd with the secret (:mod:`hpcml.stream.message`).
2. **Limits before parsing.** ``ZMQ_MAXMSGSIZE`` (libzmq disconnects a peer that announces
   a larger frame before reading it), ``RCVHWM`` messages queued per peer, and at most
   ``message.MAX_FRAMES`` frames per message: the frames are taken one at a time and a
   longer message is dropped (its remaining frames drained) before anything is decoded.
3. **Names.** The ZAP handler gives every authenticated connection a number of its own (its
   ``User-Id``, read by :meth:`Receiver.peer`), so the server can charge what it holds to the
   connection that sent it (:mod:`hpcml.stream.budget`).

Imports no torch: simulations connect through :func:`push_socket`.
"""

from __future__ import annotations

import hashlib
import hmac
import threading

import zmq

from hpcml.errors import ConfigError
from hpcml.stream import message

USER = b"hpcml"
DOMAIN = b"hpcml-stream"


def token(secret: bytes) -> bytes:
    """The handshake password of a campaign: derived from, never equal to, its secret."""
    return hmac.new(secret, b"hpcml-stream/transport", hashlib.sha256).hexdigest().encode()


def push_socket(ctx: zmq.Context, secret: bytes, *, hwm: int | None = None, timeout_s: float | None = None
                ) -> zmq.Socket:
    """A PUSH socket that passes a stream server's handshake (connect it afterwards)."""
    s = ctx.socket(zmq.PUSH)
    s.plain_username, s.plain_password = USER, token(secret)
    if hwm is not None:
        s.setsockopt(zmq.SNDHWM, hwm)
    if timeout_s is not None:
        s.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        s.setsockopt(zmq.LINGER, int(timeout_s * 1000))
    return s


class Receiver:
    """The server's PULL socket on a context of its own, with its own ZAP handler (:class:`_Gate`)."""

    def __init__(self, secret: bytes, *, host: str, port: int, hwm: int, max_frame_bytes: int) -> None:
        self.ctx = zmq.Context()
        self.gate = _Gate(self.ctx, token(secret))
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.plain_server = True
        self.sock.zap_domain = DOMAIN
        # libzmq writes a credential message into each authenticated pipe and never counts it as
        # read: it takes one slot for good, and RCVHWM 1 would let no message through
        if hwm < 2:
            raise ConfigError(f"RCVHWM {hwm} lets no message of an authenticated peer through: expected >= 2")
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        addr = f"tcp://{host}"
        try:
            if port:
                self.sock.bind(f"{addr}:{port}")
            else:
                port = self.sock.bind_to_random_port(addr)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = f"{addr}:{port}"

    def recv(self) -> list:
        """One message's frames (zmq Frames, not copied); ``zmq.Again`` when none is queued.
        A message of more than ``message.MAX_FRAMES`` frames is drained and refused with
        :class:`~hpcml.stream.message.MessageError` ``too_many_frames``."""
        frames = [self.sock.recv(zmq.NOBLOCK, copy=False)]
        while frames[-1].more:
            if len(frames) >= message.MAX_FRAMES:
                n = len(frames) + self._drain()
                raise message.MessageError("too_many_frames", f"{n} frames, expected at most {message.MAX_FRAMES}")
            frames.append(self.sock.recv(copy=False))  # the rest of a message is already here: no wait
        return frames

    @staticmethod
    def peer(frame: zmq.Frame) -> int:
        """The connection that sent ``frame``: a number the gate gave it at its handshake."""
        return int(frame.get("User-Id"))

    def _drain(self) -> int:
        """The rest of a message (its parts are all here). Copied, not as Frames: the tiny frames of
        such a message become CPython's cached empty and one-byte bytes, ~1.5 us a frame against
        ~3-5 us for Frame objects; a large frame is bounded by ``max_frame_bytes``."""
        return len(self.sock.recv_multipart(copy=True))

    def close(self) -> None:
        self.gate.stop()
        self.ctx.destroy(linger=0)  # every socket of this context, queued messages dropped


class _Gate:
    """The ZAP handler (RFC 27), a thread: lets in a peer presenting the campaign's token and
    numbers every connection it lets in (the ``User-Id`` libzmq then attaches to each frame)."""

    def __init__(self, ctx: zmq.Context, password: bytes) -> None:
        self._password = password
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind("inproc://zeromq.zap.01")
        self.admitted = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcml-stream-zap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._zap.poll(100):
                continue
            request = self._zap.recv_multipart()  # version, id, domain, address, identity, mechanism, user, password
            ok = len(request) == 8 and request[6] == USER and hmac.compare_digest(request[7], self._password)
            self.admitted += ok
            self.refused += not ok
            self._zap.send_multipart([b"1.0", request[1] if len(request) > 1 else b"", b"200" if ok else b"400",
                                      b"OK" if ok else b"wrong token", str(self.admitted).encode() if ok else b"", b""])
