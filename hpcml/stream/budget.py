"""What one producer connection may make a stream server hold before its data is in the buffer.

Three places hold a connection's bytes on their way to the training buffer:

1. **ZeroMQ's receive queue**: raw TCP chunks of at most 8 KiB (``ZMQ_STREAM``,
   :mod:`hpcml.stream.transport`), at most ``depth`` (``ZMQ_RCVHWM``) of them per connection.
   While the training buffer is full the server stops reading (the backpressure that keeps
   ingestion exactly-once: a producer waits, nothing is dropped), the queue fills, libzmq
   stops reading the socket and TCP stops the producer.
2. **One incomplete message** per connection, allocated once its lengths have been checked:
   at most the largest valid message of this trainer (its fields as one block of the whole
   grid in float64, a header, the magic and the tag, 64-byte aligned), a larger one refused
   before anything is allocated. No frame count or frame size a peer announces changes it.
3. **Incomplete samples** (:mod:`hpcml.stream.assembly`), charged to the connection whose block
   opened them (the whole sample is allocated then); past ``peer_bytes`` a block that would
   open another is dropped and counted (``peer_budget``).

So one connection holds at most ``queued_bytes`` (1 and 2) plus ``peer_bytes`` (3), whatever
it sends, secret or not. libzmq cannot cap connections: the open-file limit
(:func:`fd_limit`) does, so all of them hold at most ``fd_limit x queued_bytes`` in 1 and 2,
and ``max_partial_bytes`` of incomplete samples.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.stream import message, transport


@dataclass(frozen=True)
class PeerLimits:
    """The per-connection limits a server applies (see the module docstring)."""

    frame_bytes: int
    """The largest frame a message may announce; a larger one is refused, its connection closed."""
    message_bytes: int
    """The largest valid message: its fields as one block of the whole grid, a header, magic, tag."""
    depth: int
    """``ZMQ_RCVHWM``: raw chunks (of at most ``CHUNK`` bytes) ZeroMQ holds per connection."""
    peer_bytes: int
    """The budget: at most this much of incomplete samples (and it sizes ``depth``)."""

    @property
    def queued_bytes(self) -> int:
        """Worst case held for one connection before its messages are decoded: ZeroMQ's chunks,
        the one in libzmq's engine, and one incomplete message (aligned frames)."""
        return ((self.depth + 1) * CHUNK + self.message_bytes + transport.ALIGN * message.MAX_FRAMES
                + transport.head_bytes(transport.SKIP_FRAMES))


#: The most libzmq's raw engine hands over at once (its ``in_batch_size``).
CHUNK = 8192
#: The deepest receive queue, in chunks: 256 KiB of read-ahead per connection. It bounds what
#: any connection -- a stranger's too -- waits in while the server does not read, and more
#: read-ahead bought no intake here (libzmq resumes a paused connection every depth/2 chunks).
MAX_DEPTH = 32


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
    The queue depth is what the budget leaves beside one message, 2 to ``MAX_DEPTH`` chunks.
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
                      depth=max(2, min(MAX_DEPTH, (budget - msg) // CHUNK)), peer_bytes=budget)
