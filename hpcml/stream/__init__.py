"""The streaming data path: simulations send their output over ZeroMQ straight into the
training job's buffers -- authenticated, validated, assembled, ingested exactly once.

The producer side (:mod:`hpcml.stream.producer`, :mod:`hpcml.stream.message`,
:mod:`hpcml.stream.routing`) imports no torch, so simulations start fast.
"""

from hpcml.stream.buffer import Buffer, BufferConfig, Sample
from hpcml.stream.message import MessageError
from hpcml.stream.producer import Producer, announce_done
from hpcml.stream.routing import new_secret, read_endpoints, read_secret, route, write_endpoints

__all__ = ["Buffer", "BufferConfig", "MessageError", "Producer", "Sample", "announce_done", "new_secret",
           "read_endpoints", "read_secret", "route", "write_endpoints"]


def __getattr__(name: str):
    # the training side pulls in its (heavier) modules only when used
    if name in ("StreamServer", "ServerConfig"):
        from hpcml.stream import server
        return getattr(server, name)
    if name == "StreamLoader":
        from hpcml.stream.loader import StreamLoader
        return StreamLoader
    raise AttributeError(name)
