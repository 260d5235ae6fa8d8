"""The training side: one server per data-parallel trainer rank, in a background thread.

It receives over ZeroMQ (PULL, bound to loopback unless told otherwise; peers without the
campaign secret are refused at the handshake, frames and frame counts are bounded before
parsing: :mod:`hpcml.stream.transport`), authenticates and validates every message
(:mod:`hpcml.stream.message`; a bad one is dropped and counted by reason, never raised
into training, never unpickled), assembles the subdomains (1-D, 2-D or 3-D blocks) of
each simulation step into a whole sample (:mod:`hpcml.stream.assembly`, bounded in memory
and time), and ingests it into the :class:`~hpcml.stream.buffer.Buffer` exactly once.
No input kills the thread; if a bug does, the buffer is failed and every trainer rank's
loader raises within a poll (no hang).

Exactly-once, keyed by (simulation, step):
- a sample is complete when every rank of its simulation attempt has sent its box and the
  boxes cover the grid; its key then enters the ``seen`` set and the sample the buffer;
  a later copy of the same key (a retried attempt re-sending it) is dropped as a duplicate;
- failed attempts: complete samples already ingested stay (the simulations are
  deterministic, so the retry's copies are identical and dropped); incomplete samples of
  an older attempt are discarded when a newer attempt of that simulation appears, and
  fragments of an older attempt arriving after that are dropped (``stale_attempt``);
- the ``seen`` set, the buffer and the counters are saved with the trainer's checkpoint,
  so a restarted trainer neither re-ingests nor loses what its checkpoint holds.

Backpressure: while the buffer is full the thread stops reading; ZeroMQ's queues fill and
the producers block. End of stream: after the launcher's ``campaign_done`` message, once
every completed simulation routed here has sent its end markers (or ``end_grace_s`` passed).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.stream import message, routing, transport
from hpcml.stream.assembly import Assembler, Key, Partial
from hpcml.stream.buffer import Buffer, Sample
from hpcml.stream.source import add_counters, history_of, pack_state, unpack_states

logger = log.get_logger(__name__)


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
    hwm: int = 8
    """Messages ZeroMQ queues per producer on the receiving side before the producer blocks."""
    max_frame_bytes: int = message.MAX_FRAME_BYTES
    """Largest frame (one field of one rank's block) read; libzmq drops a peer announcing more."""
    max_sample_bytes: int = 1 << 30
    """Largest assembled sample (fields x global shape x 4 bytes); a larger one is dropped
    (``too_large``) before anything is allocated."""
    max_partial_bytes: int = 1 << 30
    """Memory held by incomplete samples (some ranks' blocks in, others not yet); past it the
    oldest is evicted (``partial_evicted``), so senders that never finish cannot grow memory."""
    partial_timeout_s: float = 600.0
    """An incomplete sample no block has reached for this long is evicted (``partial_evicted``)."""
    end_grace_s: float = 30.0
    """After campaign_done, how long to wait for missing end markers before ending anyway."""
    done_file: str | None = None
    """A JSON file ``{"completed": [...], "failed": [...]}`` the launcher writes when no
    simulation is left (the Campaign's ``sims_done.json``): the end of the campaign without
    a network message. The ``campaign_done`` message works too."""
    streamed: tuple[int, ...] | None = None
    """The simulation ids that stream (None: every completed one); others, e.g. held-out
    simulations writing files, are not waited for."""

    def __post_init__(self) -> None:
        if not self.field_names:
            raise ConfigError("ServerConfig.field_names is empty: name the fields each sample holds (e.g. ('T',))")
        if not 0 <= self.port < 65536 or self.hwm < 1 or self.end_grace_s < 0:
            raise ConfigError(f"ServerConfig needs 0 <= port < 65536, hwm >= 1, end_grace_s >= 0; got {self.port}, "
                              f"{self.hwm}, {self.end_grace_s}")
        for name in ("max_frame_bytes", "max_sample_bytes", "max_partial_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 62:
                raise ConfigError(f"ServerConfig.{name}={v!r}: expected an integer number of bytes in 1..2**62")
        if self.max_sample_bytes > self.max_partial_bytes:
            raise ConfigError(f"ServerConfig.max_sample_bytes={self.max_sample_bytes} exceeds max_partial_bytes="
                              f"{self.max_partial_bytes}: one incomplete sample must fit the bound")
        if not self.partial_timeout_s > 0:
            raise ConfigError(f"ServerConfig.partial_timeout_s={self.partial_timeout_s!r}: expected seconds > 0")


class StreamServer:
    """Receives this trainer rank's simulations into ``buffer``; ``start()`` runs it in a thread."""

    def __init__(self, *, campaign: str, secret: bytes, rank: int, n_trainers: int, buffer: Buffer,
                 config: ServerConfig) -> None:
        if not 0 <= rank < n_trainers:
            raise ConfigError(f"trainer rank {rank} outside 0..{n_trainers - 1}")
        self.campaign, self._secret, self.rank, self.n_trainers = campaign, secret, rank, n_trainers
        self.buffer, self.config = buffer, config
        self._rx = transport.Receiver(secret, host=config.host, port=config.port, hwm=config.hwm,
                                      max_frame_bytes=config.max_frame_bytes)
        self.endpoint = self._rx.endpoint
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._overflow = threading.Event()
        self._last_recv = time.monotonic()
        self._thread: threading.Thread | None = None
        self._assembly = Assembler(len(config.field_names), max_bytes=config.max_partial_bytes,
                                   timeout_s=config.partial_timeout_s, on_evict=self._evicted)
        self._pending: Sample | None = None
        self.seen: set[tuple[int, int]] = set()
        self.latest_attempt: dict[int, int] = {}
        self.ends: dict[int, dict[int, int]] = {}
        """sim -> {sim rank: messages it sent} for the latest attempt."""
        self.done: dict | None = None
        self._done_at: float | None = None
        self._done_checked = 0.0
        self.counters: dict[str, int] = {"messages": 0, "samples": 0, "duplicates": 0, "partial_discarded": 0,
                                         "bytes": 0}
        self.error: str | None = None
        """Why the server thread died (None while it runs): the loader then fails every rank."""
        self.dropped: dict[str, int] = {}
        self.t_first: float | None = None
        self.t_last: float | None = None

    # -- thread ------------------------------------------------------------------------------
    def start(self) -> StreamServer:
        self._thread = threading.Thread(target=self._run, name=f"hpcml-stream-{self.rank}", daemon=True)
        self._thread.start()
        logger.info("stream server of trainer rank %d listening on %s", self.rank, self.endpoint)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._rx.close()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug, not input (input is dropped in _handle): fail loud, never hang
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("trainer rank %d: the stream server thread died", self.rank)
            self.buffer.fail(f"the stream server of trainer rank {self.rank} died ({self.error})")

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._rx.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self._pending is not None and not self._deliver():
                continue
            if poller.poll(50):
                for _ in range(16):  # drain what is queued before polling again
                    try:
                        frames = self._rx.recv()
                    except zmq.Again:
                        break
                    except message.MessageError as e:
                        with self._lock:
                            self._rejected(e)
                        continue
                    self._last_recv = time.monotonic()
                    with self._lock:
                        self._handle(frames)
                    if self._pending is not None and not self._deliver():
                        break  # buffer full: stop reading (backpressure)
            with self._lock:
                self._assembly.sweep()
            self._check_end()

    def _deliver(self) -> bool:
        """Move the completed sample into the buffer; False while the buffer is full."""
        with self._lock:
            if self.buffer.put(self._pending, timeout=0, force=self._overflow.is_set()):
                self._pending = None
                return True
        with self.buffer._cond:  # wait for room without holding the server lock (a checkpoint may want it)
            self.buffer._cond.wait(0.05)
        return False

    def quiesce(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
        """Before a last save on a stop: take in everything already sent until the socket has
        been quiet for ``quiet_s`` (at most ``timeout_s``), into the buffer past its capacity.

        A simulation that finished has handed all its messages to ZeroMQ, but they may still
        sit in this socket's queue; the campaign will not run it again, so they must be in
        the checkpoint. (Running simulations were cancelled before the trainer was told to
        stop; their samples come again from the next attempt and duplicates are dropped.)
        """
        self._overflow.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (time.monotonic() - self._last_recv < quiet_s
                                               or self._pending is not None):
            time.sleep(0.05)

    # -- one message ----------------------------------------------------------------------
    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _rejected(self, e: Exception) -> None:
        self._drop(e.reason if isinstance(e, message.MessageError) else "internal_error")
        if sum(self.dropped.values()) <= 10:
            logger.warning("dropped a message: %s", e, exc_info=not isinstance(e, message.MessageError))

    def _handle(self, frames: list) -> None:
        """Decode, check and place one message; anything wrong with it is a counted drop."""
        try:
            msg = message.decode(self._secret, frames, self.campaign)
        except message.MessageError as e:
            return self._rejected(e)
        try:
            self._place(msg)
        except Exception as e:  # MessageError, or input the checks missed: dropped, the thread lives on
            self._rejected(e)

    def _place(self, msg: message.Message) -> None:
        self.counters["messages"] += 1
        h = msg.header
        if msg.kind == "campaign_done":
            self.done = {"completed": h["completed"], "failed": h["failed"]}
            self._done_at = time.monotonic()
            return
        sim, attempt = h["sim"], h["attempt"]
        if routing.route(sim, self.n_trainers) != self.rank:
            return self._drop("misrouted")
        latest = self.latest_attempt.get(sim, -1)
        if attempt < latest:
            return self._drop("stale_attempt")
        if attempt > latest:
            self._new_attempt(sim, attempt)
        if msg.kind == "end":
            self.ends.setdefault(sim, {})[h["rank"]] = h["n_sent"]
            return
        self._fragment(msg)

    def _new_attempt(self, sim: int, attempt: int) -> None:
        self.counters["partial_discarded"] += self._assembly.discard_older(sim, attempt)
        self.latest_attempt[sim] = attempt
        self.ends.pop(sim, None)

    def _fragment(self, msg: message.Message) -> None:
        h, cfg = msg.header, self.config
        if set(msg.arrays) != set(cfg.field_names):
            return self._drop("wrong_fields")
        if not set(cfg.param_names) <= set(h["params"]):
            return self._drop("missing_params")
        sim, step = h["sim"], h["step"]
        if (sim, step) in self.seen:
            self.counters["duplicates"] += h["rank"] == 0  # one count per duplicate sample, not per fragment
            return
        key = (sim, h["attempt"], step)
        gshape, offset, shape = (tuple(h[k]) for k in ("global_shape", "offset", "shape"))
        if len(cfg.field_names) * math.prod(gshape) * 4 > cfg.max_sample_bytes:
            return self._drop("too_large")
        params = np.array([h["params"][n] for n in cfg.param_names], np.float32)
        if not np.isfinite(params).all():  # finite in JSON, not in float32 (e.g. 1e300)
            return self._drop("bad_header")
        if h["nranks"] == 1 and len(cfg.field_names) == 1:  # one box is the whole sample: keep the frame, no copy
            if shape != gshape:
                return self._drop("incomplete_cover")
            self._count_bytes(msg)
            self.seen.add((sim, step))
            self.counters["samples"] += 1
            a = msg.arrays[cfg.field_names[0]]
            self._pending = Sample(sim, step, float(h["t"]), params,
                                   (a if a.dtype == np.float32 else a.astype(np.float32)).reshape(1, *gshape))
            return
        p = self._assembly.add(key, rank=h["rank"], nranks=h["nranks"], global_shape=gshape, offset=offset,
                               shape=shape, t=float(h["t"]), params=params,
                               arrays=[msg.arrays[n] for n in cfg.field_names])
        self._count_bytes(msg)
        if p is not None:
            self.seen.add((sim, step))
            self.counters["samples"] += 1
            self._pending = Sample(sim, step, p.t, p.params, p.fields)

    def _evicted(self, key: Key, p: Partial, why: str) -> None:
        self._drop("partial_evicted")
        if self.dropped["partial_evicted"] <= 10:
            logger.warning("trainer rank %d: evicted an incomplete sample (sim %d, attempt %d, step %d; %d of %d "
                           "ranks in): %s", self.rank, *key, len(p.ranks), p.nranks, why)

    def _count_bytes(self, msg: message.Message) -> None:
        self.counters["bytes"] += msg.nbytes
        now = time.perf_counter()
        self.t_first = self.t_first or now
        self.t_last = now

    # -- end of stream ---------------------------------------------------------------------
    def _expected(self) -> list[int]:
        streamed = self.config.streamed
        return [s for s in self.done["completed"] if routing.route(s, self.n_trainers) == self.rank
                and (streamed is None or s in streamed)]

    def _read_done_file(self) -> None:
        now = time.monotonic()
        if self.config.done_file is None or now - self._done_checked < 0.5:
            return
        self._done_checked = now
        try:
            d = json.loads(Path(self.config.done_file).read_text())
            self.done = {"completed": [int(x) for x in d["completed"]], "failed": [int(x) for x in d["failed"]]}
            self._done_at = now
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring malformed done file %s: %s", self.config.done_file, e)

    def _check_end(self) -> None:
        if self.done is None:
            self._read_done_file()
        if self.done is None or self.buffer.ended or self._pending is not None:
            return
        missing = [s for s in self._expected() if len(self.ends.get(s, {})) < self._nranks(s)]
        if missing and time.monotonic() - self._done_at < self.config.end_grace_s:
            return
        if missing:
            logger.warning("trainer rank %d: ending the stream without end markers of simulations %s", self.rank,
                           missing)
        self.buffer.end()
        logger.info("trainer rank %d: end of stream (%d samples, %d duplicates dropped)", self.rank,
                    self.counters["samples"], self.counters["duplicates"])

    def _nranks(self, sim: int) -> int:
        ends = self.ends.get(sim, {})
        return max(ends) + 1 if ends else 1 << 30

    def stats(self) -> dict:
        dt = (self.t_last - self.t_first) if self.t_first and self.t_last and self.t_last > self.t_first else 0.0
        return {**self.counters, "dropped": dict(self.dropped), "error": self.error, "intake_s": dt,
                "intake_mb_s": self.counters["bytes"] / 1e6 / dt if dt else 0.0, "buffer": self.buffer.stats.as_dict(),
                "buffer_len": len(self.buffer)}

    # -- checkpointing --------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """This rank's stream state as named arrays (JSON meta as uint8), consistent at one instant."""
        with self._lock:
            pending = [self._pending] if self._pending is not None else []
            if pending:  # counted as in the buffer: a restart must not lose it
                self.buffer._items.extend(pending)
            try:
                return pack_state(self.buffer, self.seen, {
                    "latest_attempt": {str(k): v for k, v in self.latest_attempt.items()},
                    "ends": {str(k): {str(r): n for r, n in v.items()} for k, v in self.ends.items()},
                    "done": self.done, "counters": self.counters, "dropped": self.dropped})
            finally:
                if pending:
                    self.buffer._items.remove(pending[0])

    def load_state(self, states: list[dict[str, np.ndarray]]) -> None:
        """Restore from the states of every rank of the saved run (one per saved trainer rank);
        keeps the simulations that route to this rank under the current trainer count."""
        mine = lambda sim: routing.route(int(sim), self.n_trainers) == self.rank  # noqa: E731
        with self._lock:
            metas = unpack_states(states, self.buffer, self.seen, mine, self.rank, self.n_trainers)
            for i, meta in enumerate(metas):
                for k, v in meta["latest_attempt"].items():
                    if mine(k):
                        self.latest_attempt[int(k)] = max(v, self.latest_attempt.get(int(k), -1))
                for k, v in meta["ends"].items():
                    if mine(k):
                        self.ends[int(k)] = {int(r): n for r, n in v.items()}
                if meta["done"]:  # global: which simulations completed
                    self.done, self._done_at = meta["done"], time.monotonic()
                if history_of(i, self.rank, self.n_trainers):  # each saved history once, none lost
                    add_counters(self.counters, meta["counters"])
                    add_counters(self.dropped, meta["dropped"], skip=())
            self.counters["samples"] = len(self.seen)  # exactly what this rank owns, whoever ingested it
