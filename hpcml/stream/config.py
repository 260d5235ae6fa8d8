"""Where a trainer rank listens and what a sample looks like: :class:`ServerConfig`, validated
when built, and what a producer learns of it at the handshake (:func:`handshake_info`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.stream import message
from hpcml.stream.budget import PeerLimits, peer_limits
from hpcml.stream.schema import SampleSchema


@dataclass(kw_only=True)
class ServerConfig:
    """Where a trainer rank listens and what a sample looks like. ``repr()`` rebuilds it."""

    host: str = "127.0.0.1"
    """Interface to bind: loopback by default; a node's high-speed interface address on a cluster."""
    port: int = 0
    """0 picks a free port (restart a trainer with the port it published to keep the address)."""
    param_names: tuple[str, ...] = ()
    """Order of the parameter vector of each sample; every message must carry these names."""
    field_names: tuple[str, ...] = ()
    """Fields stacked into each sample, in this order."""
    shape: tuple[int, ...] | None = None
    """The grid of every sample (None: the first sample's fixes it)."""
    hwm: int = 8
    """The default budget of a producer connection, in its largest valid messages (at least 2;
    ``max_peer_bytes`` sets it in bytes instead: :attr:`limits`)."""
    max_held_bytes: int | None = None
    """Unfinished messages of all connections together, in bytes (None: 256 MiB, or two of the
    largest valid message if more); a message that does not fit waits, unread, until others
    complete (:mod:`hpcml.stream.transport`)."""
    max_frame_bytes: int = message.MAX_FRAME_BYTES
    """Largest frame (one field of one rank's block) a message may announce; a larger one is
    refused and its connection closed. The server takes at most the largest frame its schema
    allows, if smaller (:attr:`limits`)."""
    max_sample_bytes: int = 1 << 30
    """Largest assembled sample (fields x global shape x 4 bytes); a larger one is dropped
    (``too_large``) before anything is allocated."""
    max_partial_bytes: int = 1 << 30
    """Memory held by incomplete samples (some ranks' blocks in, others not yet); past it the
    oldest of the connection holding the most is evicted (``partial_evicted``), so senders that
    never finish cannot grow memory."""
    max_peer_bytes: int | None = None
    """Budget of one producer connection, in bytes: at most this much of incomplete samples its
    blocks opened (past it such a block is dropped: ``peer_budget``); on the zmtp wire it sizes
    ZeroMQ's queue. None: ``hwm`` largest valid messages. Whatever a
    connection sends, it holds at most ``limits.queued_bytes`` before decoding
    (:mod:`hpcml.stream.budget`)."""
    transport: str = "framed"
    """The wire: ``"framed"`` (hpcml's framing over plain TCP: a challenge per connection, every
    byte a connection makes the server hold bounded, whatever it sends) or ``"zmtp"`` (ZeroMQ's
    own messages, PUSH -> PULL: a peer holding the campaign secret can make the server hold any
    amount: for trusted simulations only, :mod:`hpcml.stream.zmtp`)."""
    integrity: str = "connection"
    """What the framed wire authenticates: ``"connection"`` (each connection answers a fresh
    challenge under the campaign secret, and what then arrives on it is its producer's: TCP
    carries it, as PostgreSQL's SCRAM or Redis's AUTH leave it) or ``"message"`` (each message
    also carries a GMAC tag over every byte, so a host on the path that rewrites TCP segments is
    caught too; costs ~0.1-0.2 ms of CPU per MiB on each side, docs/streaming.md). The zmtp
    wire seals every message whatever this says."""
    partial_timeout_s: float = 600.0
    """An incomplete sample no block has reached for this long is evicted (``partial_evicted``)."""
    end_grace_s: float = 30.0
    """After the done record, how long to wait for the samples of completed simulations that
    are not in yet (in flight) before the stream ends without them (they count as missing)."""
    done_file: str | None = None
    """The driver's done record (``sims_done.json``), polled twice a second."""

    def __post_init__(self) -> None:
        SampleSchema(self.field_names, self.param_names, self.shape)  # the same checks, one place
        if not 0 <= self.port < 65536 or self.hwm < 2 or self.end_grace_s < 0:  # hwm 1: budget.py
            raise ConfigError(f"ServerConfig needs 0 <= port < 65536, hwm >= 2, end_grace_s >= 0; got {self.port}, "
                              f"{self.hwm}, {self.end_grace_s}")
        for name in ("max_frame_bytes", "max_sample_bytes", "max_partial_bytes"):
            v = getattr(self, name)
            if not is_int(v) or not 1 <= v <= 1 << 62:
                raise ConfigError(f"ServerConfig.{name}={v!r}: expected an integer number of bytes in 1..2**62")
        if self.max_sample_bytes > self.max_partial_bytes:
            raise ConfigError(f"ServerConfig.max_sample_bytes={self.max_sample_bytes} exceeds max_partial_bytes="
                              f"{self.max_partial_bytes}: one incomplete sample must fit the bound")
        if self.transport not in ("framed", "zmtp"):
            raise ConfigError(f"ServerConfig.transport={self.transport!r}: expected 'framed' or 'zmtp'")
        if self.integrity not in ("connection", "message"):
            raise ConfigError(f"ServerConfig.integrity={self.integrity!r}: expected 'connection' (a challenge per "
                              f"connection) or 'message' (a MAC on every message too)")
        if not self.partial_timeout_s > 0:
            raise ConfigError(f"ServerConfig.partial_timeout_s={self.partial_timeout_s!r}: expected seconds > 0")
        for name in ("max_peer_bytes", "max_held_bytes"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 1 <= v <= 1 << 62):
                raise ConfigError(f"ServerConfig.{name}={v!r}: expected None or an integer number of bytes in "
                                  f"1..2**62")
        self.limits  # noqa: B018 -- a budget below two messages is refused here, with its numbers

    @property
    def limits(self) -> PeerLimits:
        """The per-connection limits this config gives: frame limit, queue depth, budget."""
        return peer_limits(hwm=self.hwm, max_frame_bytes=self.max_frame_bytes, max_sample_bytes=self.max_sample_bytes,
                           n_fields=len(self.field_names), shape=self.shape, max_peer_bytes=self.max_peer_bytes,
                           max_held_bytes=self.max_held_bytes)


def handshake_info(campaign: str, run: str, rank: int, config: ServerConfig) -> bytes:
    """What a producer learns of this trainer rank at the handshake, to refuse at its first
    ``send`` what the trainer would drop (:meth:`hpcml.stream.Producer.send`)."""
    return json.dumps({"campaign": campaign, "run": run or "", "rank": rank, "fields": list(config.field_names),
                       "params": list(config.param_names), "shape": list(config.shape) if config.shape else None,
                       "integrity": config.integrity},
                      separators=(",", ":")).encode()
