"""The stream's ZeroMQ sockets: peers authenticated at the handshake, limits before parsing.

Two gates stand between the network and the decoder:

1. **The handshake.** The server's PULL socket speaks ZeroMQ's PLAIN mechanism and asks a
   ZAP handler (pyzmq's authenticator thread, one per server context) about every peer: a
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

Imports no torch: simulations connect through :func:`push_socket`.
"""

from __future__ import annotations

import hashlib
import hmac

import zmq

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
    """The server's PULL socket on a context of its own, with its own ZAP handler."""

    def __init__(self, secret: bytes, *, host: str, port: int, hwm: int, max_frame_bytes: int) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self.ctx, log=None)
        self._auth.start()
        self._auth.configure_plain(domain=DOMAIN.decode(), passwords={USER.decode(): token(secret).decode()})
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.plain_server = True
        self.sock.zap_domain = DOMAIN
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

    def _drain(self) -> int:
        """The rest of a message (its parts are all here). Copied, not as Frames: the tiny frames of
        such a message become CPython's cached empty and one-byte bytes, ~1.5 us a frame against
        ~3-5 us for Frame objects; a large frame is bounded by ``max_frame_bytes``."""
        return len(self.sock.recv_multipart(copy=True))

    def close(self) -> None:
        self._auth.stop()
        self.ctx.destroy(linger=0)  # every socket of this context, queued messages dropped
