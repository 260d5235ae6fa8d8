"""The simulation side: each rank of a simulation sends its subdomain of every output step.

All ranks of simulation ``s`` send to the one trainer rank ``route(s, n)`` over a ZeroMQ
PUSH socket. Backpressure is ZeroMQ's high-water mark: when the trainer's buffer is full
it stops reading, both queues fill to ``hwm`` messages and ``send`` blocks, so a fast
simulation slows down instead of growing memory. The PUSH socket reconnects by itself, so
a trainer restarted on the same address picks the stream up again; messages still queued
here are delivered then. Imports no torch: a simulation starts in a fraction of a second.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import zmq

from hpcml import log
from hpcml.errors import ConfigError, LaunchError
from hpcml.stream import message, routing

logger = log.get_logger(__name__)

ENV_ENDPOINTS_FILE = "HPCML_STREAM_ENDPOINTS_FILE"
ENV_SECRET_FILE = "HPCML_STREAM_SECRET_FILE"
ENV_SIM_ID = "HPCML_SIM_ID"
ENV_ATTEMPT = "HPCML_ATTEMPT"


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set (the campaign sets it for each simulation)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


@dataclass(kw_only=True)
class Producer:
    """Sends one simulation rank's output; ``close()`` tells the trainer this rank is done."""

    endpoint: str
    secret: bytes
    campaign: str
    sim_id: int
    attempt: int
    rank: int
    nranks: int
    params: dict[str, float]
    global_shape: tuple[int, int]
    offset: tuple[int, int]
    local_shape: tuple[int, int]
    hwm: int = 4
    """Messages queued on each side before ``send`` blocks (memory bound: ~2 x hwm x message size)."""
    send_timeout_s: float = 600.0
    """A trainer unreachable this long is an error (the campaign then retries the simulation)."""
    copy: bool = True
    """Copy each array before sending (ZeroMQ sends from it after ``send`` returns). False: the
    caller hands over arrays it never modifies again -- the kernels pass fresh copies -- and
    saves a copy per message."""

    def __post_init__(self) -> None:
        if self.hwm < 1 or self.send_timeout_s <= 0:
            raise ConfigError(f"Producer needs hwm >= 1 and send_timeout_s > 0, got {self.hwm}, {self.send_timeout_s}")
        if not all(o + s <= g for o, s, g in zip(self.offset, self.local_shape, self.global_shape)):
            raise ConfigError(f"subdomain {self.offset}+{self.local_shape} lies outside the global shape {self.global_shape}")
        self.params = {k: float(v) for k, v in self.params.items()}
        # its own context, terminated in close(): that waits until ZeroMQ has sent every
        # zero-copy frame, so no array is freed while the I/O thread still reads it
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, self.hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
        self._sock.setsockopt(zmq.LINGER, int(self.send_timeout_s * 1000))
        self._sock.connect(self.endpoint)
        self.n_sent = 0
        self.bytes_sent = 0
        self.blocked_s = 0.0
        self._closed = False

    @classmethod
    def from_env(cls, *, comm, params: dict[str, float], global_shape, offset, local_shape, fields=None,
                 sim_id: int | None = None, attempt: int | None = None, **kw) -> Producer:
        """Build from what the campaign put in the environment (endpoints and secret files,
        simulation id, attempt); ``comm`` is the simulation's communicator."""
        ep_file = os.environ.get(ENV_ENDPOINTS_FILE)
        secret_file = os.environ.get(ENV_SECRET_FILE)
        if not ep_file or not secret_file:
            raise ConfigError(f"streaming needs {ENV_ENDPOINTS_FILE} and {ENV_SECRET_FILE} in the environment")
        sim = _env_int(ENV_SIM_ID) if sim_id is None else sim_id
        campaign, endpoints = routing.read_endpoints(ep_file, timeout_s=float(os.environ.get(
            "HPCML_STREAM_WAIT_S", "120")))
        return cls(endpoint=endpoints[routing.route(sim, len(endpoints))], secret=routing.read_secret(secret_file),
                   campaign=campaign, sim_id=sim, attempt=_env_int(ENV_ATTEMPT, 0) if attempt is None else attempt,
                   rank=comm.Get_rank(), nranks=comm.Get_size(), params=params, global_shape=tuple(global_shape),
                   offset=tuple(offset), local_shape=tuple(local_shape), **kw)

    def _send(self, frames: list) -> None:
        t0 = time.perf_counter()
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise LaunchError(f"simulation {self.sim_id} rank {self.rank}: trainer at {self.endpoint} took no data for "
                              f"{self.send_timeout_s:.0f} s") from None
        self.blocked_s += time.perf_counter() - t0

    def send(self, step: int, t: float, fields: dict[str, np.ndarray]) -> None:
        """Send this rank's subdomain of every field at output ``step`` (arrays are copied first,
        so the simulation may overwrite them as soon as this returns)."""
        if self._closed:
            raise LaunchError("Producer.send after close()")
        arrays, names = [], []
        for name, a in fields.items():
            if tuple(a.shape) != self.local_shape:
                raise ConfigError(f"field {name!r} has shape {tuple(a.shape)}, expected the subdomain {self.local_shape}")
            a = np.array(a, dtype=np.float32 if a.dtype != np.float64 else np.float64, order="C",
                         copy=True if self.copy else None)
            arrays.append(a)
            names.append([name, str(a.dtype)])
        header = {"kind": "data", "campaign": self.campaign, "sim": self.sim_id, "attempt": self.attempt,
                  "rank": self.rank, "nranks": self.nranks, "step": int(step), "t": float(t),
                  "global_shape": list(self.global_shape), "offset": list(self.offset),
                  "shape": list(self.local_shape), "fields": names, "params": self.params}
        self._send(message.encode(self.secret, header, arrays))
        self.n_sent += 1
        self.bytes_sent += sum(a.nbytes for a in arrays)

    def close(self) -> None:
        """Send the end marker and wait (up to the send timeout) until everything queued has left."""
        if self._closed:
            return
        header = {"kind": "end", "campaign": self.campaign, "sim": self.sim_id, "attempt": self.attempt,
                  "rank": self.rank, "nranks": self.nranks, "n_sent": self.n_sent}
        self._send(message.encode(self.secret, header))
        self._sock.close()  # lingers until queued messages are sent (at most send_timeout_s)
        self._ctx.term()
        self._closed = True


def announce_done(endpoints_file: str | os.PathLike, secret_file: str | os.PathLike, completed: list[int],
                  failed: list[int], timeout_s: float = 60.0) -> None:
    """Tell every trainer rank that the campaign is over: which simulations completed and
    which failed for good. Trainers end the stream once the completed ones' data is in."""
    campaign, endpoints = routing.read_endpoints(endpoints_file)
    secret = routing.read_secret(secret_file)
    ctx = zmq.Context()
    header = {"kind": "campaign_done", "campaign": campaign, "completed": sorted(completed), "failed": sorted(failed)}
    for ep in endpoints:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, int(timeout_s * 1000))
        s.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        s.connect(ep)
        try:
            s.send_multipart(message.encode(secret, header))
        finally:
            s.close()
    ctx.term()
