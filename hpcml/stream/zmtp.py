"""The opt-in fast wire for trusted simulations: ZeroMQ's own messages (PUSH -> PULL).

``ServerConfig(transport="zmtp")``. A server publishes its address as ``zmtp+tcp://HOST:PORT``
and a :class:`~hpcml.stream.Producer` given such an address speaks this wire. It receives
libzmq's own framing and reconnection (no acknowledgements: a message in flight when a
connection drops is lost, and the end-of-stream accounting counts it).

What it keeps: peers are authenticated at ZeroMQ's PLAIN handshake by a ZAP handler
(:class:`_Gate`, a thread; the password is the campaign's token, never the secret), so a peer
without the secret gets nothing queued or parsed; every message is MAC'd; ``ZMQ_MAXMSGSIZE``
bounds a frame and ``RCVHWM`` the whole messages queued per connection.

What it gives up: libzmq holds every frame of a multipart message before the server can
read any and bounds frames per message nowhere, so **a peer holding the campaign secret**
(a buggy or hostile simulation of the campaign) can make the trainer hold any amount of
memory. Use it where every simulation is trusted code; the default wire bounds it.
"""

from __future__ import annotations

import hmac
import threading

import zmq

from hpcml.errors import ConfigError
from hpcml.stream import message
from hpcml.stream.handshake import token

SCHEME = "zmtp+"
"""Prefix of the address a zmtp server publishes: a producer connects to the rest with PUSH."""
USER = b"hpcml"
DOMAIN = b"hpcml-stream"


def send_limits(sock: zmq.Socket, hwm: int | None, timeout_s: float | None) -> None:
    """A sending socket's queue (``SNDHWM`` messages) and how long a send and its close wait."""
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
    if timeout_s is not None:
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))


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


class Sender:
    """A PUSH socket that passes a zmtp server's handshake; the interface of
    :class:`hpcml.stream.sender.Sender`, so a producer speaks either wire the same way."""

    info = None  # ZeroMQ's handshake carries no info: the producer checks nothing more
    error = None
    undelivered = 0

    def __init__(self, secret: bytes, *, hwm: int | None = None, timeout_s: float | None = None) -> None:
        self.token = token(secret)
        self._ctx = zmq.Context(io_threads=1)  # terminated in close(): it waits until every zero-copy frame is sent
        self.sock = self._ctx.socket(zmq.PUSH)
        self.sock.plain_username, self.sock.plain_password = USER, self.token
        send_limits(self.sock, hwm, timeout_s)

    def connect(self, endpoint: str) -> None:
        self.sock.connect(endpoint.removeprefix(SCHEME))

    def wait_info(self, timeout_s: float) -> None:
        return None

    def send_frames(self, frames) -> None:
        """One message of ``frames``, none copied."""
        self.sock.send_multipart(frames, copy=False)

    def send_message(self, buf, views, flags: int = 0) -> None:
        """One message built by :func:`~hpcml.stream.transport.frame_buffer`: its frames, views
        into ``buf``, as one ZeroMQ multipart message, without a copy."""
        self.sock.send_multipart(views, flags, copy=False)

    def close(self, linger: int | None = None) -> None:
        if self.sock.closed:
            return
        self.sock.close(linger)
        self._ctx.term()


class Receiver:
    """The server's PULL socket on a context of its own, with its own ZAP handler; the same
    interface as :class:`hpcml.stream.transport.Receiver`."""

    def __init__(self, secret: bytes, *, host: str, port: int, hwm: int, max_frame_bytes: int) -> None:
        # libzmq writes a credential message into each authenticated pipe and never counts it as
        # read: it takes one slot for good, and RCVHWM 1 would let no message through
        if hwm < 2:
            raise ConfigError(f"RCVHWM {hwm} lets no message of an authenticated peer through: expected >= 2")
        self.ctx = zmq.Context()
        self.gate = _Gate(self.ctx, token(secret))
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.plain_server = True
        self.sock.zap_domain = DOMAIN
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = SCHEME + bind(self, host, port)

    @property
    def admitted(self) -> int:
        return self.gate.admitted

    @property
    def refused(self) -> int:
        return self.gate.refused

    #: Producer connections held at most: not counted on this wire (libzmq holds them).
    max_connections: int | None = None

    def held_bytes(self) -> int:
        return 0  # what libzmq holds is not visible from here

    def stats(self) -> dict:
        """The framed wire's connection counters: none of them is visible from here."""
        return {}

    def sweep(self) -> None:
        pass  # the handshake happens inside libzmq

    def flush(self) -> None:
        pass  # no acknowledgements on this wire

    def wait(self, timeout_s: float) -> None:
        self.sock.poll(int(timeout_s * 1000), zmq.POLLIN)

    def recv(self) -> tuple[int, list]:
        """(the connection's number, one message's frames); ``zmq.Again`` when none is queued. A
        message of more than ``message.MAX_FRAMES`` frames is drained and refused (``too_many_frames``)."""
        frames = [self.sock.recv(zmq.NOBLOCK, copy=False)]
        while frames[-1].more:
            if len(frames) >= message.MAX_FRAMES:
                n = len(frames) + len(self.sock.recv_multipart(copy=True))  # the rest is already here
                raise message.MessageError("too_many_frames", f"{n} frames, expected at most {message.MAX_FRAMES}")
            frames.append(self.sock.recv(copy=False))
        return int(frames[0].get("User-Id")), frames

    def poll(self) -> tuple[int, list] | None:
        """:meth:`recv`, None when no message is queued."""
        try:
            return self.recv()
        except zmq.Again:
            return None

    def close(self) -> None:
        self.gate.stop()
        self.ctx.destroy(linger=0)


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
