"""The streaming data path: simulations send their output over TCP straight into the
training job's buffers -- authenticated, validated, assembled, ingested exactly once.

The producer side (:mod:`hpcml.stream.producer`, :mod:`hpcml.stream.message`,
:mod:`hpcml.stream.routing`) imports no torch, so simulations start fast; the training
side's names (``StreamServer``, ``StreamLoader``, ``FileSource``, ...) load on first use.
"""

import importlib

from hpcml.stream.buffer import Buffer, BufferConfig, Sample
from hpcml.stream.message import MessageError
from hpcml.stream.producer import Producer
from hpcml.stream.routing import new_secret, read_endpoints, read_secret, route, write_endpoints

_LAZY = {"StreamServer": "server", "ServerConfig": "server", "StreamLoader": "loader", "FileSource": "files",
         "read_samples": "files"}

__all__ = sorted(["Buffer", "BufferConfig", "MessageError", "Producer", "Sample", "new_secret", "read_endpoints",
                  "read_secret", "route", "write_endpoints", *_LAZY])


def __getattr__(name: str):
    if name in _LAZY:  # the training side pulls in its (heavier) modules only when used
        return getattr(importlib.import_module(f"hpcml.stream.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hpcml.stream' has no attribute {name!r}")
