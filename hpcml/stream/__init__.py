"""The streaming data path: simulations send their output over TCP straight into the
training job's buffers -- authenticated, validated, assembled, ingested exactly once.

The producer side (:mod:`hpcml.stream.producer`, :mod:`hpcml.stream.message`,
:mod:`hpcml.stream.routing`) imports no torch, so simulations start fast; the training
side's names (``StreamServer``, ``StreamLoader``, ``FileSource``, ...) load on first use.
"""

from hpcml.lazy import lazy_names
from hpcml.stream.buffer import Buffer, BufferConfig, Sample
from hpcml.stream.message import MessageError
from hpcml.stream.producer import Producer
from hpcml.stream.routing import new_secret, read_endpoints, read_secret, route, write_endpoints

_LAZY = {"StreamServer": "server", "ServerConfig": "server", "StreamLoader": "loader", "FileSource": "files",
         "read_samples": "files"}

__all__ = sorted(["Buffer", "BufferConfig", "MessageError", "Producer", "Sample", "new_secret", "read_endpoints",
                  "read_secret", "route", "write_endpoints", *_LAZY])


__getattr__ = lazy_names(__name__, _LAZY)  # the training side pulls in its (heavier) modules only when used
