"""How the framed wire lays out one message: a checked length table, then 64-byte aligned frames.

    magic: u32 | n: u32 | len_0 .. len_{n-1}: u64 | pad to 64 B | frame_0 | pad | ... | frame_{n-1} | pad

A sender builds each message in one buffer (:func:`frame_buffer`), so the receiver can read
it into one buffer too, every frame an aligned view. For the whole messages it takes the server
sends acknowledgements: the count of this connection's messages it has taken (u64), so a
producer knows what a cut connection lost and sends exactly that again.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

MAGIC = 0x33434D48  # "HMC3" little-endian: a message starts here, or the stream is out of step
ALIGN = 64
#: The fixed part of a message's head: the magic and the frame count.
FIXED = 8
ACK = struct.Struct("<Q")


def pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def padded(lengths) -> int:
    """The bytes frames of these ``lengths`` take on the wire, padding included."""
    return sum(-(-n // ALIGN) for n in lengths) * ALIGN


def head_bytes(n_frames: int) -> int:
    return pad(FIXED + 8 * n_frames)


def frame_buffer(lengths: Sequence[int]) -> tuple[np.ndarray, list[memoryview]]:
    """One message's buffer with its head written, and a writable view per frame to fill."""
    at = head_bytes(len(lengths))
    offsets = []
    for n in lengths:
        offsets.append(at)
        at += pad(n)
    buf = np.empty(at, np.uint8)
    view = memoryview(buf)
    head = FIXED + 8 * len(lengths)
    struct.pack_into(f"<II{len(lengths)}Q", buf, 0, MAGIC, len(lengths), *lengths)
    buf[head:offsets[0] if offsets else at] = 0
    for o, n in zip(offsets, lengths):  # no byte of this process's memory goes out unwritten
        buf[o + n:o + pad(n)] = 0
    return buf, [view[o:o + n] for o, n in zip(offsets, lengths)]


_ZEROS = bytes(ALIGN)


def parts(frames: Sequence) -> list:
    """The wire bytes of a message of ``frames`` as consecutive pieces (head, each frame, its
    padding), none of the frames copied: for a scatter-gather send."""
    views = [memoryview(f).cast("B") for f in frames]
    n = len(views)
    head = bytearray(head_bytes(n))
    struct.pack_into(f"<II{n}Q", head, 0, MAGIC, n, *[v.nbytes for v in views])
    out: list = [head]
    for v in views:
        out.append(v)
        if v.nbytes % ALIGN:
            out.append(_ZEROS[:ALIGN - v.nbytes % ALIGN])
    return out


def pack(frames: Sequence) -> np.ndarray:
    """The wire bytes of a message of ``frames`` (bytes-like), copied into one buffer."""
    views = [memoryview(f).cast("B") for f in frames]
    buf, out = frame_buffer([v.nbytes for v in views])
    for dst, src in zip(out, views):
        dst[:] = src
    return buf
