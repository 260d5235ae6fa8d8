"""What one producer connection may make a stream server hold before its data is in the buffer.

Two places hold a connection's bytes on their way to the training buffer:

1. **ZeroMQ's receive queue.** While the buffer is full the server stops reading (that is the
   backpressure that keeps ingestion exactly-once: a producer waits, nothing is dropped), and
   every connection keeps at most ``depth`` (``ZMQ_RCVHWM``) whole messages: ``depth - 1`` in
   its pipe, whose last slot libzmq's credential message takes for good, and at most one
   decoded in its engine. libzmq counts messages, not bytes, so the server sizes the depth
   from the budget and the largest valid message of this trainer (its fields as one block of
   the whole grid in float64, a header, the magic and the tag):
   ``depth x message_bytes <= peer_bytes``, ``depth >= 2``; ``ZMQ_MAXMSGSIZE`` refuses a
   larger frame than a valid message carries (one field of the whole grid, or a header).
2. **Incomplete samples** (:mod:`hpcml.stream.assembly`), charged to the connection whose block
   opened them (the whole sample is allocated then); past ``peer_bytes`` a block that would
   open another is dropped and counted (``peer_budget``).

What the budget cannot cover: libzmq holds every frame of a message before the server can
read any, and has no limit on frames per message, so a peer holding the secret that sends
messages of more frames than a valid one (refused once read: ``malformed``,
``too_many_frames``) makes ZeroMQ hold up to ``depth x frames x frame_bytes`` -- any amount.
Nor can libzmq cap authenticated connections (its monitor does not say which connection a
handshake was): the open-file limit (:func:`fd_limit`) caps connections, so all of them hold
at most ``fd_limit x peer_bytes`` in ZeroMQ, and ``max_partial_bytes`` of incomplete samples.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.stream import message


@dataclass(frozen=True)
class PeerLimits:
    """The per-connection limits a server applies (see the module docstring)."""

    frame_bytes: int
    """``ZMQ_MAXMSGSIZE``: the largest frame read; a peer announcing more is disconnected."""
    message_bytes: int
    """The largest valid message: its fields as one block of the whole grid, a header, magic, tag."""
    depth: int
    """``ZMQ_RCVHWM``: whole messages ZeroMQ holds per connection (at least 2, see above)."""
    peer_bytes: int
    """The budget: at most this much queued in ZeroMQ, and this much of incomplete samples."""

    @property
    def queued_bytes(self) -> int:
        """Worst case queued in ZeroMQ for one connection: ``depth x message_bytes``."""
        return self.depth * self.message_bytes


def fd_limit() -> int:
    """The open-file limit of this process: more connections than this are never accepted."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def field_limit(*, max_frame_bytes: int, max_sample_bytes: int, n_fields: int, shape: Sequence[int] | None) -> int:
    """The largest payload frame a valid message carries: one field of the whole grid in float64
    (``shape``, else the largest sample ``max_sample_bytes`` lets in), at most ``max_frame_bytes``."""
    return min(max_frame_bytes, 8 * math.prod(shape) if shape else 2 * max_sample_bytes // n_fields)


def peer_limits(*, hwm: int, max_frame_bytes: int, max_sample_bytes: int, n_fields: int,
                shape: Sequence[int] | None, max_peer_bytes: int | None) -> PeerLimits:
    """The limits of a server configured so; ``max_peer_bytes=None``: room for ``hwm`` messages.
    A budget that holds fewer than two messages is a ConfigError stating the numbers."""
    field = field_limit(max_frame_bytes=max_frame_bytes, max_sample_bytes=max_sample_bytes, n_fields=n_fields,
                        shape=shape)
    msg = n_fields * field + message.MAX_HEADER_BYTES + len(message.MAGIC) + message.MAC_BYTES
    budget = hwm * msg if max_peer_bytes is None else max_peer_bytes
    if budget < 2 * msg:
        raise ConfigError(f"ServerConfig.max_peer_bytes={budget} holds fewer than 2 messages of {msg} bytes (the "
                          f"largest valid one: {n_fields} field(s) of {field} bytes and a header of up to "
                          f"{message.MAX_HEADER_BYTES}): expected at least {2 * msg}")
    return PeerLimits(frame_bytes=min(max_frame_bytes, max(field, message.MAX_HEADER_BYTES)), message_bytes=msg,
                      depth=min(hwm, budget // msg), peer_bytes=budget)
