"""The framed wire's handshake: a fresh challenge per connection, answered under the campaign secret.

The secret never goes on the wire, and nothing a peer sent once opens a second connection::

    server -> producer   HELLO (16 B) | nonce_s (32 B)
    producer -> server   nonce_p (32 B) | HMAC(key, "p" | nonce_s | nonce_p)
    server -> producer   1 | HMAC(key, "s" | nonce_s | nonce_p | info) | len(info): u32 | info (JSON)
                         (or 0 and a close: the answer was wrong)

``key`` is HMAC-SHA256(secret, "hpcml-stream/transport"). Each server nonce is 32 bytes of
``os.urandom`` drawn for that connection, so a captured answer opens no other connection, no
other run's, and none after a restart. The server proves it holds the secret too (a stale
``endpoints.json`` pointing at another campaign's trainer is found at once), and its proof
covers ``info``: what the trainer expects of a sample (fields, parameters, grid, campaign and
run), which the producer checks before its first message leaves (:mod:`hpcml.stream.producer`),
so a simulation that sends what the trainer would drop fails at its first ``send``, naming
the values. Imports no torch and no ZeroMQ.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct

HELLO = b"hpcml-stream/3\n\0"
NONCE = 32
DIGEST = 32
#: What the server sends first: the greeting and its nonce.
HELLO_BYTES = len(HELLO) + NONCE
#: The producer's answer: its nonce and its proof.
ANSWER_BYTES = NONCE + DIGEST
#: The fixed part of the server's reply: status, proof, the length of ``info``.
REPLY_BYTES = 1 + DIGEST + 4
#: The largest ``info`` a producer reads.
MAX_INFO_BYTES = 64 * 1024


class HandshakeError(ConnectionError):
    """The peer did not prove it holds the campaign secret (``final``: retrying cannot help)."""

    def __init__(self, detail: str, *, final: bool) -> None:
        super().__init__(detail)
        self.final = final


def key(secret: bytes) -> bytes:
    """The key both sides prove with: derived from, never equal to, the campaign secret."""
    return hmac.new(secret, b"hpcml-stream/transport", hashlib.sha256).digest()


def token(secret: bytes) -> bytes:
    """The zmtp wire's PLAIN password (:mod:`hpcml.stream.zmtp`), in hex: derived under a label
    of its own, so one seen in clear on that wire opens nothing on this one."""
    return hmac.new(secret, b"hpcml-stream/zmtp-plain", hashlib.sha256).hexdigest().encode()


def hello() -> tuple[bytes, bytes]:
    """(the server's first bytes, its nonce)."""
    nonce = os.urandom(NONCE)
    return HELLO + nonce, nonce


def answer(k: bytes, hello_bytes: bytes) -> tuple[bytes, bytes]:
    """(the producer's answer to a server's first bytes, its own nonce); HandshakeError if they
    are not an hpcml stream server's."""
    if len(hello_bytes) != HELLO_BYTES or hello_bytes[:len(HELLO)] != HELLO:
        raise HandshakeError(f"the peer's first {len(hello_bytes)} bytes are not an hpcml stream server's greeting "
                             f"(another program at this address, or an older hpcml)", final=True)
    nonce_s, nonce_p = hello_bytes[len(HELLO):], os.urandom(NONCE)
    return nonce_p + _mac(k, b"p", nonce_s, nonce_p), nonce_p


def check_answer(k: bytes, nonce_s: bytes, got: bytes) -> bytes | None:
    """The producer's nonce if ``got`` proves the secret for this connection's ``nonce_s``, else None."""
    nonce_p, proof = got[:NONCE], got[NONCE:ANSWER_BYTES]
    return nonce_p if hmac.compare_digest(proof, _mac(k, b"p", nonce_s, nonce_p)) else None


def reply(k: bytes, nonce_s: bytes, nonce_p: bytes, info: bytes) -> bytes:
    """The server's reply to a good answer."""
    return b"\1" + _mac(k, b"s", nonce_s, nonce_p, info) + struct.pack("<I", len(info)) + info


def check_reply(k: bytes, nonce_s: bytes, nonce_p: bytes, head: bytes, info: bytes) -> dict:
    """The server's ``info`` if its reply proves the secret; HandshakeError otherwise."""
    if not hmac.compare_digest(head[1:1 + DIGEST], _mac(k, b"s", nonce_s, nonce_p, info)):
        raise HandshakeError("the trainer did not prove it holds this campaign's secret (endpoints.json names "
                             "another campaign's trainer, or the secret file is not this campaign's)", final=True)
    try:
        out = json.loads(info)
    except ValueError:
        out = None
    if not isinstance(out, dict):
        raise HandshakeError("the trainer's handshake info is not a JSON object", final=True)
    return out


def info_length(head: bytes) -> int:
    """The length of ``info`` a reply announces; HandshakeError for a refusal or a bad length."""
    if head[:1] != b"\1":
        raise HandshakeError("the trainer refused this producer's proof of the campaign secret: the secret file it "
                             "read is not this campaign's", final=True)
    n = struct.unpack_from("<I", head, 1 + DIGEST)[0]
    if n > MAX_INFO_BYTES:
        raise HandshakeError(f"the trainer announced {n} bytes of handshake info, expected at most "
                             f"{MAX_INFO_BYTES}", final=True)
    return n


def _mac(k: bytes, side: bytes, *parts: bytes) -> bytes:
    h = hmac.new(k, side, hashlib.sha256)
    for p in parts:
        h.update(struct.pack("<I", len(p)))
        h.update(p)
    return h.digest()
