"""Exactly-once ingestion of one trainer rank's messages: pure rules, no sockets.

:meth:`Ingest.message` takes a decoded, authenticated :class:`~hpcml.stream.message.Message`
and returns the whole :class:`~hpcml.stream.buffer.Sample` it completes (or None); what it
refuses raises :class:`~hpcml.stream.message.MessageError` with a counter key, which the
server counts as a drop. Keyed by (simulation, step):

- a sample is complete when every rank of its simulation attempt has sent its block and
  the blocks tile the grid (:mod:`hpcml.stream.assembly`); its key then enters ``seen``,
  and a later copy of it (a retried attempt re-sending it) is a duplicate, dropped;
- an attempt newer than the latest seen for its simulation discards that simulation's
  incomplete samples of older attempts; a fragment of an older attempt is ``stale_attempt``;
- every sample is checked once against the trainer's schema (:mod:`hpcml.stream.schema`);
- ``end`` markers and the driver's done record go to the :class:`EndTracker`.

Tested with thousands of generated messages in milliseconds; the server only moves bytes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping

from hpcml import log
from hpcml.stream import routing
from hpcml.stream.assembly import Assembler, Key, Partial
from hpcml.stream.buffer import Sample
from hpcml.stream.ending import EndTracker
from hpcml.stream.message import Message, MessageError
from hpcml.stream.schema import SampleSchema

logger = log.get_logger(__name__)


class Ingest:
    """The exactly-once state of one trainer rank."""

    def __init__(self, *, rank: int, n_trainers: int, schema: SampleSchema, max_sample_bytes: int,
                 max_partial_bytes: int, partial_timeout_s: float, end_grace_s: float,
                 max_peer_bytes: int | None = None) -> None:
        self.rank, self.n_trainers, self.schema = rank, n_trainers, schema
        self.max_sample_bytes = max_sample_bytes
        self.assembly = Assembler(len(schema.field_names), max_bytes=max_partial_bytes, timeout_s=partial_timeout_s,
                                  on_evict=self._evicted, peer_bytes=max_peer_bytes)
        self.ends = EndTracker(rank, n_trainers, end_grace_s)
        self.seen: set[tuple[int, int]] = set()
        self.per_sim: Counter[int] = Counter()
        """Samples ingested per simulation (``seen`` counted), checkpoints included."""
        self.latest_attempt: dict[int, int] = {}
        self.counters: dict[str, int] = {"messages": 0, "samples": 0, "duplicates": 0, "partial_discarded": 0,
                                         "bytes": 0}
        self.dropped: dict[str, int] = {}

    # -- one message --------------------------------------------------------------------------
    def message(self, msg: Message, peer: object = None) -> Sample | None:
        """``peer``: the connection it came by, charged for the incomplete sample its block opens."""
        self.counters["messages"] += 1
        h = msg.header
        sim, attempt = h["sim"], h["attempt"]
        if routing.route(sim, self.n_trainers) != self.rank:
            raise MessageError("misrouted", f"simulation {sim} routes to trainer rank "
                                            f"{routing.route(sim, self.n_trainers)}, not {self.rank}")
        latest = self.latest_attempt.get(sim, -1)
        if attempt < latest:
            raise MessageError("stale_attempt", f"simulation {sim} attempt {attempt} after attempt {latest}")
        if attempt > latest:
            self.counters["partial_discarded"] += self.assembly.discard_older(sim, attempt)
            self.latest_attempt[sim] = attempt
            self.ends.new_attempt(sim)
        if msg.kind == "end":
            self.ends.end_marker(sim, h["rank"], h["nranks"], h["n_sent"])
            return None
        return self._fragment(msg, peer)

    def _fragment(self, msg: Message, peer: object) -> Sample | None:
        h = msg.header
        sim, step = h["sim"], h["step"]
        gshape = tuple(h["global_shape"])
        self.schema.check(sim, msg.arrays, h["params"], gshape)
        if (sim, step) in self.seen:
            self.counters["duplicates"] += h["rank"] == 0  # one count per duplicate sample, not per fragment
            return None
        nbytes = len(self.schema.field_names) * math.prod(gshape) * 4
        if nbytes > self.max_sample_bytes:
            raise MessageError("too_large", f"a sample of {gshape} x {len(self.schema.field_names)} fields is "
                                            f"{nbytes} bytes, more than max_sample_bytes={self.max_sample_bytes}")
        params = self.schema.params_vector(h["params"])
        arrays = [msg.arrays[n] for n in self.schema.field_names]
        if h["nranks"] == 1 and len(arrays) == 1:  # one block is the whole sample: keep the frame, no copy
            if tuple(h["shape"]) != gshape:
                raise MessageError("incomplete_cover", f"the one rank of simulation {sim} sends {h['shape']} of "
                                                       f"{list(gshape)}")
            t, fields = float(h["t"]), arrays[0].reshape(1, *gshape)
        else:
            p = self.assembly.add((sim, h["attempt"], step), rank=h["rank"], nranks=h["nranks"], global_shape=gshape,
                                  offset=tuple(h["offset"]), shape=tuple(h["shape"]), t=float(h["t"]), params=params,
                                  arrays=arrays, peer=peer)
            if p is None:
                self.counters["bytes"] += msg.nbytes
                return None
            t, fields = p.t, p.fields
        self.counters["bytes"] += msg.nbytes
        self.seen.add((sim, step))
        self.per_sim[sim] += 1
        self.counters["samples"] += 1
        self.ends.progress()
        return self.schema.sample(sim, step, t, params, fields)

    def drop(self, reason: str) -> int:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return self.dropped[reason]

    def _evicted(self, key: Key, p: Partial, why: str) -> None:
        if self.drop("partial_evicted") <= 10:
            logger.warning("trainer rank %d: evicted an incomplete sample (sim %d, attempt %d, step %d; %d of %d "
                           "ranks in): %s", self.rank, *key, len(p.ranks), p.nranks, why)

    # -- the end ------------------------------------------------------------------------------------
    def ended(self) -> tuple[bool, list[int]]:
        return self.ends.ended(lambda sim: self.per_sim[sim])

    def accounting(self) -> dict:
        """What this rank should hold of the completed simulations and what it holds, per simulation."""
        expected = self.ends.expected()
        return {"expected": {s: n for s, n in expected.items()}, "silent": self.ends.silent(),
                "ingested": {s: self.per_sim[s] for s in set(expected) | set(self.per_sim)}}

    # -- checkpoint -----------------------------------------------------------------------------------
    def state_meta(self) -> dict:
        return {"latest_attempt": {str(k): v for k, v in self.latest_attempt.items()}, **self.ends.state(),
                "counters": self.counters, "dropped": self.dropped, "schema": self.schema.state()}

    def load_meta(self, meta: Mapping, keep: Callable[[int], bool], history: bool) -> None:
        """One saved rank's meta: the simulations ``keep`` selects; its counters when they are
        this rank's ``history`` (:func:`~hpcml.stream.source.history_of`)."""
        from hpcml.stream.source import add_counters

        for k, v in meta.get("latest_attempt", {}).items():
            if keep(int(k)):
                self.latest_attempt[int(k)] = max(int(v), self.latest_attempt.get(int(k), -1))
        self.ends.load_state(meta, keep)
        self.schema.load_state(meta.get("schema") or {})
        if history:
            add_counters(self.counters, meta.get("counters", {}))
            add_counters(self.dropped, meta.get("dropped", {}), skip=())

    def restored(self) -> None:
        """After every saved state is in: counts follow ``seen`` (what this rank owns now)."""
        self.per_sim = Counter(s for s, _ in self.seen)
        self.counters["samples"] = len(self.seen)
