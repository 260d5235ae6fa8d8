"""What one producer connection may make a stream server hold before its data is in the buffer.

Three places hold a connection's bytes on their way to the training buffer:

1. **The kernel's socket buffer**: while the training buffer is full the server stops reading
   (the backpressure that keeps ingestion exactly-once: a producer waits, nothing is dropped),
   the socket's receive buffer fills and TCP stops the producer. That memory is the kernel's
   (``net.ipv4.tcp_rmem``), not the trainer's.
2. **One incomplete message** per connection, allocated once its lengths have been checked
   (:mod:`hpcml.stream.transport`): at most the largest valid message of this trainer (its
   fields as one block of the whole grid in float64, a header, the magic and the tag, 64-byte
   aligned), a larger one refused before anything is allocated. No frame count or frame size
   a peer announces changes it, and all connections' together stay under ``held_bytes``.
3. **Incomplete samples** (:mod:`hpcml.stream.assembly`), charged to the connection whose block
   opened them (the whole sample is allocated then); past ``peer_bytes`` a block that would
   open another is dropped and counted (``peer_budget``).

So one connection holds at most ``queued_bytes`` (2) plus ``peer_bytes`` (3), whatever it
sends; a stranger (no secret) holds nothing but its 64 answer bytes. All connections together
hold at most ``held_bytes`` in 2 and ``max_partial_bytes`` in 3.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Sequence
from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.stream import framing, message


@dataclass(frozen=True)
class PeerLimits:
    """The per-connection limits a server applies (see the module docstring)."""

    frame_bytes: int
    """The largest frame a message may announce; a larger one is refused, its connection closed."""
    message_bytes: int
    """The largest valid message: its fields as one block of the whole grid, a header, magic, tag."""
    peer_bytes: int
    """The budget: at most this much of incomplete samples."""
    held_bytes: int
    """All connections' unfinished messages together, at most."""

    @property
    def queued_bytes(self) -> int:
        """Worst case held for one connection before its messages are decoded: one incomplete
        message (aligned frames)."""
        return self.message_bytes + framing.ALIGN * message.MAX_FRAMES

    @property
    def messages(self) -> int:
        """Whole messages the budget holds (the zmtp wire's ``RCVHWM``)."""
        return max(2, self.peer_bytes // self.message_bytes)


#: The default of ``held_bytes``: unfinished messages of all connections, unless two of the
#: largest valid message need more.
HELD_BYTES = 256 << 20


def fd_limit() -> int:
    """The open-file limit of this process: more connections than this are never accepted."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            pass
    return fd_limit()


def field_limit(*, max_frame_bytes: int, max_sample_bytes: int, n_fields: int, shape: Sequence[int] | None) -> int:
    """The largest payload frame a valid message carries: one field of the whole grid in float64
    (``shape``, else the largest sample ``max_sample_bytes`` lets in), at most ``max_frame_bytes``."""
    return min(max_frame_bytes, 8 * math.prod(shape) if shape else 2 * max_sample_bytes // n_fields)


def peer_limits(*, hwm: int, max_frame_bytes: int, max_sample_bytes: int, n_fields: int,
                shape: Sequence[int] | None, max_peer_bytes: int | None, max_held_bytes: int | None = None
                ) -> PeerLimits:
    """The limits of a server configured so; ``max_peer_bytes=None``: room for ``hwm`` messages;
    ``max_held_bytes=None``: :data:`HELD_BYTES`, or two largest messages if more. A budget that
    holds fewer than two messages is a ConfigError stating the numbers."""
    field = field_limit(max_frame_bytes=max_frame_bytes, max_sample_bytes=max_sample_bytes, n_fields=n_fields,
                        shape=shape)
    msg = n_fields * field + message.MAX_HEADER_BYTES + len(message.MAGIC) + message.MAC_BYTES
    budget = hwm * msg if max_peer_bytes is None else max_peer_bytes
    if budget < 2 * msg:
        raise ConfigError(f"ServerConfig.max_peer_bytes={budget} holds fewer than 2 messages of {msg} bytes (the "
                          f"largest valid one: {n_fields} field(s) of {field} bytes and a header of up to "
                          f"{message.MAX_HEADER_BYTES}): expected at least {2 * msg}")
    one = msg + framing.ALIGN * message.MAX_FRAMES
    if max_held_bytes is not None and max_held_bytes < 2 * one:
        raise ConfigError(f"ServerConfig.max_held_bytes={max_held_bytes} holds fewer than 2 messages of {one} bytes "
                          f"(the largest valid one, aligned): expected at least {2 * one}")
    return PeerLimits(frame_bytes=min(max_frame_bytes, max(field, message.MAX_HEADER_BYTES)), message_bytes=msg,
                      peer_bytes=budget, held_bytes=max_held_bytes or max(HELD_BYTES, 2 * one))
