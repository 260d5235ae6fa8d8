"""The training side: one server per data-parallel trainer rank, in a background thread.

It only moves bytes. It receives over plain TCP (bound to loopback unless told otherwise,
with framing of our own: a peer must answer a fresh challenge under the campaign secret
before a byte of it is read past the answer, frame counts and lengths are bounded before a
byte of a message is held, and all connections together hold a bounded total:
:mod:`hpcml.stream.transport`), authenticates
and validates every message (:mod:`hpcml.stream.message`), and hands it to the
exactly-once rules (:mod:`hpcml.stream.ingest`: assembly, deduplication, the schema, the
end of the stream); a whole sample goes into the :class:`~hpcml.stream.buffer.Buffer`.
A bad message is dropped and counted by reason, never raised into training, never
unpickled. No input kills the thread; if a bug does, the buffer is failed and every
trainer rank's loader raises within a poll (no hang).

Backpressure: while the buffer is full the thread stops reading; the sockets' buffers fill
and the producers block. What one connection can make the server hold meanwhile, queued or as
incomplete samples, is bounded in bytes (:mod:`hpcml.stream.budget`). End of stream: the
driver's done record (``sims_done.json`` of this run, polled, or
:meth:`StreamServer.campaign_done` in-process), then every completed
simulation routed here settled (:mod:`hpcml.stream.ending`). The ``seen`` set, the buffer,
the end markers and the counters are saved with the trainer's checkpoint, so a restarted
trainer neither re-ingests nor loses what its checkpoint holds.
"""

from __future__ import annotations

import errno
import time
import threading
from pathlib import Path

import numpy as np
import zmq

from hpcml import log
from hpcml.contract import Contract, DoneRecord, read_done, read_endpoints
from hpcml.errors import ConfigError, LaunchError
from hpcml.stream import message, routing, transport, zmtp
from hpcml.stream.budget import fd_limit
from hpcml.stream.config import ServerConfig, handshake_info
from hpcml.stream.buffer import Buffer, Sample
from hpcml.stream.ingest import Ingest
from hpcml.stream.schema import SampleSchema

__all__ = ["ServerConfig", "StreamServer"]
from hpcml.stream.source import SampleSource, history_of, pack_state, unpack_states

logger = log.get_logger(__name__)

#: How long a relaunched trainer retries binding the port its predecessor published (that
#: one's processes may still be exiting) before it gives up.
REBIND_S = 20.0
#: While messages stream in, the loop looks at timeouts and the end of the stream this often
#: (every turn when idle): not once a message.
HOUSEKEEP_S = 0.05


class StreamServer(SampleSource):
    """Receives this trainer rank's simulations into ``buffer``; ``start()`` runs it in a thread."""

    def __init__(self, *, campaign: str, secret: bytes, rank: int, n_trainers: int, buffer: Buffer,
                 config: ServerConfig, contract: Contract | None = None) -> None:
        if not 0 <= rank < n_trainers:
            raise ConfigError(f"trainer rank {rank} outside 0..{n_trainers - 1}")
        self.campaign, self._secret, self.rank, self.n_trainers = campaign, secret, rank, n_trainers
        self.buffer, self.config, self.contract = buffer, config, contract
        self.limits = lim = config.limits
        self.ingest = Ingest(rank=rank, n_trainers=n_trainers,
                             schema=SampleSchema(config.field_names, config.param_names, config.shape),
                             max_sample_bytes=config.max_sample_bytes, max_partial_bytes=config.max_partial_bytes,
                             partial_timeout_s=config.partial_timeout_s, end_grace_s=config.end_grace_s,
                             max_peer_bytes=lim.peer_bytes)
        if config.transport == "zmtp":  # whole messages queued per connection, as the budget holds them
            self._rx = zmtp.Receiver(secret, host=config.host, port=config.port, max_frame_bytes=lim.frame_bytes,
                                     hwm=min(config.hwm, lim.messages))
        else:
            self._rx = transport.Receiver(secret, host=config.host, port=config.port, max_frame_bytes=lim.frame_bytes,
                                          max_message_bytes=lim.message_bytes, max_held_bytes=lim.held_bytes,
                                          info=handshake_info(campaign, contract.run if contract else "", rank,
                                                              config))
        self._unsealed_ok = config.transport == "framed" and config.integrity == "connection"
        """Messages without a MAC frame are taken: each connection proved the secret (the challenge)."""
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (when last logged, drops then)
        self.endpoint = self._rx.endpoint
        self._lock = threading.Lock()  # the ingest state and the pending sample, against a checkpoint
        self._stop = threading.Event()
        self._overflow = threading.Event()
        self._last_recv = time.monotonic()
        self._done_checked = 0.0
        self._kept = 0.0  # when the loop last looked at timeouts and the end of the stream
        self._thread: threading.Thread | None = None
        self._pending: Sample | None = None
        self.error: str | None = None
        """Why the server thread died (None while it runs): the loader then fails every rank."""
        self.t_first: float | None = None
        self.t_last: float | None = None

    @classmethod
    def from_campaign(cls, buffer: Buffer, *, rank: int, n_trainers: int, param_names=(), field_names=(),
                      contract: Contract | None = None, **config) -> StreamServer:
        """The server the campaign's contract describes (:meth:`Contract.from_env` by default):
        its secret, campaign, done record and address -- the contract's host or interface
        (``hsn0``: that interface's address), else loopback -- and, when this run published
        addresses already (a relaunched trainer), the same port, so running simulations reconnect."""
        from hpcml.net import interface_address

        c = contract or Contract.from_env()
        if not c.streams:
            raise ConfigError(f"the campaign {c.campaign!r} gives this trainer no stream (no secret or endpoints "
                              f"file): its TrainingJob takes no stream (stream=False, or None without a ready_file): "
                              f"give it TrainingJob(stream=True) for its simulations to stream to it")
        host = config.pop("host", None) or c.stream_host or (
            interface_address(c.stream_interface) if c.stream_interface else "127.0.0.1")
        port = config.pop("port", 0) or _published_port(c, rank, n_trainers)
        cfg = ServerConfig(host=host, port=port, param_names=tuple(param_names), field_names=tuple(field_names),
                           done_file=c.done_file, **config)
        secret = routing.read_secret(c.secret_file)
        deadline = time.monotonic() + (REBIND_S if port else 0)
        while True:
            try:
                return cls(campaign=c.campaign, secret=secret, rank=rank, n_trainers=n_trainers, buffer=buffer,
                           config=cfg, contract=c)
            except (zmq.ZMQError, OSError) as e:
                if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise LaunchError(f"trainer rank {rank}: cannot bind the stream to tcp://{host}:{port} "
                                      f"({e.strerror})" + (f" within {REBIND_S:g} s: a process of an earlier launch "
                                                           f"still holds it" if port else "")) from None
                time.sleep(0.25)

    # -- what the rest of the library reads ---------------------------------------------------
    @property
    def param_names(self) -> tuple[str, ...]:
        return self.config.param_names

    @property
    def max_connections(self) -> int | None:
        """Producer connections this rank holds at most (None on the zmtp wire: ZeroMQ's own, not counted)."""
        return self._rx.max_connections

    @property
    def seen(self) -> set[tuple[int, int]]:
        return self.ingest.seen

    @property
    def counters(self) -> dict[str, int]:
        return self.ingest.counters

    @property
    def dropped(self) -> dict[str, int]:
        return self.ingest.dropped

    # -- thread ------------------------------------------------------------------------------
    def start(self) -> StreamServer:
        self._thread = threading.Thread(target=self._run, name=f"hpcml-stream-{self.rank}", daemon=True)
        self._thread.start()
        cap = self.max_connections
        logger.info("stream server of trainer rank %d listening on %s%s", self.rank, self.endpoint,
                    f" (up to {cap} producer connections: open-file limit {self._rx.fd_limit})" if cap else "")
        if self.config.shape is None:
            lim = self.config.limits
            logger.warning("no sample shape configured (ServerConfig.shape / train_surrogate(shape=)): a producer "
                           "connection may make this trainer hold up to %.1f GiB of incomplete samples and %.1f GiB "
                           "of a message (the largest the sample limit lets in)", lim.peer_bytes / 2**30,
                           lim.queued_bytes / 2**30)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # its socket stays: closing it under a running recv could crash
                logger.error("trainer rank %d: the stream server thread did not stop within 10 s", self.rank)
                return
        self._rx.close()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug, not input (input is dropped in _handle): fail loud, never hang
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("trainer rank %d: the stream server thread died", self.rank)
            self.buffer.fail(f"the stream server of trainer rank {self.rank} died ({self.error})")

    def _loop(self) -> None:
        """Read while messages are queued (up to 64 in a row), poll only when none is: a poll per
        message cost as much as its validation."""
        while not self._stop.is_set():
            if self._pending is not None and not self._deliver():
                self._rx.flush()  # what was handed over is acknowledged, even while nothing more is read
                continue
            got = 0
            while got < 64 and self._pending is None:  # a pending sample: the buffer is full (backpressure)
                try:
                    item = self._rx.poll()
                except message.MessageError as e:
                    got += 1  # refused messages count too: a flood of them must not keep the loop from the rest
                    with self._lock:
                        self._rejected(e)
                    continue
                if item is None:
                    break
                got += 1
                self._handle(*item)
            now = time.monotonic()
            if got:
                self._last_recv = now
            elif self._pending is None:
                self._rx.sweep()  # nothing queued: a connection with an unfinished token is late
                self._rx.wait(0.05)
            if now - self._kept >= HOUSEKEEP_S or not got:
                self._kept = now
                with self._lock:
                    self.ingest.assembly.sweep()
                self._check_end()

    def _deliver(self) -> bool:
        """Move the completed sample into the buffer; False while the buffer is full."""
        with self._lock:
            if self.buffer.put(self._pending, timeout=0, force=self._overflow.is_set()):
                self._pending = None
                return True
        self.buffer.wait_for_room(0.05)  # without the server lock: a checkpoint may want it
        return False

    def _handle(self, peer: int, frames: list) -> None:
        """Decode, check and place one message (into the buffer if it completes a sample, the
        same lock hold); anything wrong with it is a counted drop."""
        try:
            msg = message.decode(self._secret, frames, self.campaign, self.contract.run if self.contract else None,
                                 authenticated=self._unsealed_ok)
        except message.MessageError as e:
            with self._lock:
                return self._rejected(e)
        with self._lock:
            try:
                sample = self.ingest.message(msg, peer)
            except Exception as e:  # MessageError, or input the checks missed: dropped, the thread lives on
                return self._rejected(e)
            if sample is not None and not self.buffer.put(sample, timeout=0, force=self._overflow.is_set()):
                self._pending = sample  # counted as in the buffer by a checkpoint until it fits
        if msg.kind == "data":
            now = time.perf_counter()
            self.t_first = self.t_first or now
            self.t_last = now

    def _rejected(self, e: Exception) -> None:
        reason = e.reason if isinstance(e, message.MessageError) else "internal_error"
        n = self.ingest.drop(reason)
        if n <= 3 or sum(self.ingest.dropped.values()) <= 10:
            logger.warning("trainer rank %d dropped a message: %s", self.rank, e,
                           exc_info=not isinstance(e, message.MessageError))
            self._logged[reason] = (time.monotonic(), n)
        elif time.monotonic() - self._logged.get(reason, (0.0, 0))[0] > 60:  # then once a minute per reason
            logger.warning("trainer rank %d dropped %d more messages (%s) since: %s", self.rank,
                           n - self._logged.get(reason, (0.0, 0))[1], reason, e)
            self._logged[reason] = (time.monotonic(), n)

    def quiesce(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> None:
        """Before a last save on a stop: take in everything already sent until the socket has
        been quiet for ``quiet_s`` (at most ``timeout_s``), into the buffer past its capacity.

        A simulation whose producers closed was acknowledged every message, but some may still wait
        in this server's queue (or, on the zmtp wire, in ZeroMQ's); the campaign will not run it
        again, so they must be in the checkpoint. (Running simulations were cancelled before the
        trainer was told to stop; their samples come again from the next attempt and duplicates are
        dropped.)
        """
        self._overflow.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (time.monotonic() - self._last_recv < quiet_s
                                               or self._pending is not None):
            time.sleep(0.05)

    # -- end of stream ---------------------------------------------------------------------
    def campaign_done(self, record: DoneRecord) -> None:
        """The driver's done record, in-process (what the done file says from another)."""
        with self._lock:
            self.ingest.ends.campaign_done(record)

    def _check_end(self) -> None:
        now = time.monotonic()
        if self.config.done_file and self.ingest.ends.done is None and now - self._done_checked >= 0.5:
            self._done_checked = now
            try:
                record = read_done(self.config.done_file, self.contract)
            except ConfigError as e:
                self.error = str(e)
                self.buffer.fail(f"trainer rank {self.rank}: {e}")
                return
            if record is not None:
                self.campaign_done(record)
        if self.buffer.ended or self._pending is not None:
            return
        with self._lock:
            ended, without = self.ingest.ended()
        if not ended:
            return
        if without:
            logger.warning("trainer rank %d: the stream ends without every sample of simulations %s (no sample for "
                           "%.0f s after the campaign's end)", self.rank, without, self.config.end_grace_s)
        self.buffer.end()
        logger.info("trainer rank %d: end of stream (%d samples, %d duplicates dropped)", self.rank,
                    self.counters["samples"], self.counters["duplicates"])

    # -- what a run reports ------------------------------------------------------------------
    def stats(self) -> dict:
        dt = (self.t_last - self.t_first) if self.t_first and self.t_last and self.t_last > self.t_first else 0.0
        with self._lock:
            counters, dropped = dict(self.counters), dict(self.dropped)
            held = dict(self.ingest.assembly.held)
        lim = self.limits
        return {**counters, "dropped": dropped, "error": self.error, "intake_s": dt,
                "intake_mb_s": counters["bytes"] / 1e6 / dt if dt else 0.0, "buffer": self.buffer.stats.as_dict(),
                "buffer_len": len(self.buffer),
                "peers": {"admitted": self._rx.admitted, "refused": self._rx.refused,
                          "peer_bytes": lim.peer_bytes, "frame_bytes": lim.frame_bytes,
                          "queued_bytes_max": lim.queued_bytes, "partial_bytes_max": max(held.values(), default=0),
                          "fd_limit": fd_limit(), **self._rx.stats()}}

    def accounting(self) -> dict:
        with self._lock:
            return self.ingest.accounting()

    # -- checkpointing --------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """This rank's stream state as named arrays (JSON meta as uint8), consistent at one instant."""
        with self._lock:
            return pack_state(self.buffer, self.seen, self.ingest.state_meta(),
                              also=[self._pending] if self._pending is not None else [])

    def load_state(self, states: list[dict[str, np.ndarray]]) -> None:
        """Restore from the states of every rank of the saved run (one per saved trainer rank);
        keeps the simulations that route to this rank under the current trainer count."""
        mine = lambda sim: routing.route(int(sim), self.n_trainers) == self.rank  # noqa: E731
        with self._lock:
            metas = unpack_states(states, self.buffer, self.seen, mine, self.rank, self.n_trainers)
            for i, meta in enumerate(metas):
                self.ingest.load_meta(meta, mine, history_of(i, self.rank, self.n_trainers))
            self.ingest.restored()


def _published_port(c: Contract, rank: int, n_trainers: int) -> int:
    """This rank's port in this run's published endpoints (a relaunch within the run), else 0."""
    if not c.endpoints_file or not Path(c.endpoints_file).exists():
        return 0
    try:
        _, old = read_endpoints(c.endpoints_file, contract=c)
    except (ConfigError, LaunchError):  # an earlier run's, or unreadable: a new port
        return 0
    if len(old) != n_trainers:
        return 0
    try:
        return int(old[rank].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 0
