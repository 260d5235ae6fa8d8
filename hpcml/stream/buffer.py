"""Training buffers between the stream and the optimizer: FIFO, FIRO and reservoir.

- ``fifo``: batches are the oldest samples, each used once. Full: ``put`` refuses, so the
  server stops reading and the simulations block (backpressure).
- ``firo`` (first in, random out): batches are drawn at random and removed, so a batch
  mixes simulations and times; full: backpressure as for FIFO.
- ``reservoir``: batches are drawn at random and kept (samples are reused); full: a new
  sample evicts a random one, so the stream never blocks and the buffer follows the
  newest data.

While the stream is live a batch is served only when the buffer holds at least
``watermark`` samples (diversity before the first step; FIFO/FIRO keep that many as a
mixing pool). After the end of the stream FIFO and FIRO drain what is left.
Statistics: how often each sample was used (reuse) and its age in ingested samples when used.
Thread-safe: the server thread puts, the training thread gets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import numpy as np

from hpcml.errors import ConfigError

POLICIES = ("fifo", "firo", "reservoir")


@dataclass
class Sample:
    """One whole (assembled) output step of one simulation."""

    sim: int
    step: int
    t: float
    params: np.ndarray
    """float32 [n_params], in the campaign's parameter order."""
    fields: np.ndarray
    """float32 [n_fields, *global_shape]: [F, nx], [F, nx, ny] or [F, nx, ny, nz]."""
    seq: int = 0
    """Ingestion order on this rank (age = samples ingested since)."""
    reuse: int = 0


@dataclass(kw_only=True)
class BufferConfig:
    """Policy, size and start threshold of a training buffer. ``repr()`` rebuilds it."""

    policy: str = "firo"
    """"fifo", "firo" or "reservoir" (see the module docstring)."""
    capacity: int = 256
    """Samples held at most: the memory bound (capacity x sample bytes)."""
    watermark: int = 32
    """Samples the buffer must hold before a batch is served while the stream is live."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"buffer policy {self.policy!r} unknown: expected one of {', '.join(POLICIES)}")
        if self.capacity < 1 or not 0 <= self.watermark <= self.capacity:
            raise ConfigError(f"buffer needs capacity >= 1 and 0 <= watermark <= capacity, got capacity "
                              f"{self.capacity}, watermark {self.watermark}")


@dataclass
class BufferStats:
    ingested: int = 0
    served: int = 0
    evicted: int = 0
    evicted_unused: int = 0
    batches: int = 0
    age_sum: float = 0.0
    reuse_hist: dict[int, int] = field(default_factory=dict)
    """Times-used -> samples, counted when a sample leaves the buffer (consumed or evicted)."""

    def as_dict(self) -> dict:
        return {"ingested": self.ingested, "served": self.served, "evicted": self.evicted,
                "evicted_unused": self.evicted_unused, "batches": self.batches,
                "mean_age": self.age_sum / self.served if self.served else 0.0,
                "reuse_hist": {str(k): v for k, v in sorted(self.reuse_hist.items())}}


class Buffer:
    """A bounded sample store with one of the three policies."""

    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self._items: list[Sample] = []
        self._rng = np.random.default_rng(config.seed)
        self._cond = threading.Condition()
        self._seq = 0
        self.ended = False
        self.error: str | None = None
        """Why the source filling it died (see :meth:`fail`)."""
        self.stats = BufferStats()
        self.policy_set = False
        """The policy was changed during the run (:meth:`set_policy`): saved, and a restore keeps it."""
        self._wants: list[int] = []
        """Samples each waiting :meth:`get` needs: a put wakes a getter only once it can be served
        (a wake-up per put cost the server thread ~0.1 ms a sample on 2 cores)."""

    def __len__(self) -> int:
        return len(self._items)

    def unused(self) -> int:
        """Samples held that no batch has used yet."""
        with self._cond:
            return sum(s.reuse == 0 for s in self._items)

    def _retire(self, s: Sample) -> None:
        self.stats.reuse_hist[s.reuse] = self.stats.reuse_hist.get(s.reuse, 0) + 1

    def put(self, sample: Sample, timeout: float | None = None, *, force: bool = False) -> bool:
        """Insert; FIFO/FIRO wait up to ``timeout`` for room and return False if none came.
        ``force``: insert past the capacity (a stop that must keep what is already received)."""
        cfg = self.config
        with self._cond:
            if cfg.policy != "reservoir" and not force and len(self._items) >= cfg.capacity:
                if not self._cond.wait_for(lambda: len(self._items) < cfg.capacity, timeout):
                    return False
            sample.seq = self._seq
            self._seq += 1
            self.stats.ingested += 1
            if len(self._items) >= cfg.capacity and not force:  # reservoir: evict a random sample
                j = int(self._rng.integers(len(self._items)))
                old = self._items[j]
                self.stats.evicted += 1
                self.stats.evicted_unused += old.reuse == 0
                self._retire(old)
                self._items[j] = sample
            else:
                self._items.append(sample)
            if self._wants and len(self._items) >= min(self._wants):
                self._cond.notify_all()
            return True

    def wait_for_room(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until a FIFO/FIRO put would succeed (a reservoir always takes one)."""
        with self._cond:
            return self.config.policy == "reservoir" or self._cond.wait_for(
                lambda: len(self._items) < self.config.capacity, timeout)

    def end(self) -> None:
        """No more samples will come: FIFO/FIRO drain below the watermark."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """The source died: no more samples will come, and the loader must say why, not wait."""
        with self._cond:
            self.error = reason
            self.ended = True
            self._cond.notify_all()

    def can_serve(self, n: int) -> bool:
        need = n if self.ended else max(n, self.config.watermark)
        return len(self._items) >= need and len(self._items) > 0

    def exhausted(self, n: int) -> bool:
        """The stream has ended and no further batch of ``n`` can be served."""
        with self._cond:
            return self.ended and not self.can_serve(n)

    def get(self, n: int, timeout: float = 0.0) -> list[Sample] | None:
        """A batch of ``n`` samples per the policy, waiting up to ``timeout``; None if none is ready."""
        with self._cond:
            if not (self.can_serve(n) or self.ended):
                need = max(n, self.config.watermark, 1)
                self._wants.append(need)
                try:
                    self._cond.wait_for(lambda: self.can_serve(n) or self.ended, timeout)
                finally:
                    self._wants.remove(need)
            if not self.can_serve(n):
                return None
            policy = self.config.policy
            if policy == "fifo":
                batch, self._items = self._items[:n], self._items[n:]
            else:
                idx = self._rng.choice(len(self._items), size=n, replace=False)
                batch = [self._items[i] for i in idx]
                if policy == "firo":
                    keep = np.ones(len(self._items), bool)
                    keep[idx] = False
                    self._items = [s for s, k in zip(self._items, keep) if k]
            for s in batch:
                s.reuse += 1
                self.stats.age_sum += self._seq - 1 - s.seq
                if policy != "reservoir":
                    self._retire(s)
            self.stats.served += n
            self.stats.batches += 1
            self._cond.notify_all()  # room for the server
            return batch

    def unget(self, batch: list[Sample]) -> None:
        """Give back a batch taken by :meth:`get` but never trained on (a stop came first):
        FIFO/FIRO put the samples back in front, so the checkpoint holds them."""
        with self._cond:
            for s in batch:
                s.reuse -= 1
                if self.config.policy != "reservoir":
                    self.stats.reuse_hist[s.reuse + 1] -= 1
            if self.config.policy != "reservoir":
                self._items[0:0] = batch
            self.stats.served -= len(batch)
            self.stats.batches -= 1
            self._cond.notify_all()

    def set_policy(self, policy: str) -> None:
        """Serve by ``policy`` from now on (PBT explores it): the samples held stay, each used
        or not as before; a FIFO or FIRO buffer past its capacity makes producers wait again."""
        if policy not in POLICIES:
            raise ConfigError(f"buffer policy {policy!r} unknown: expected one of {', '.join(POLICIES)}")
        with self._cond:
            self.config = replace(self.config, policy=policy)
            self.policy_set = True
            self._cond.notify_all()

    # -- checkpointing: plain arrays and JSON, never pickle ---------------------------------
    def state(self, also: list[Sample] | tuple = ()) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, JSON) of the buffer's contents and counters; ``also``: samples on their
        way in (taken by the source, not yet put), saved as if they were in."""
        with self._cond:
            items = list(self._items) + list(also)
            meta = {"seq": self._seq, "ended": self.ended, "stats": self.stats.as_dict(),
                    "rng": self._rng.bit_generator.state, "config": vars(self.config),
                    **({"policy_set": self.config.policy} if self.policy_set else {})}
        if not items:
            return {}, meta
        arrays = {"keys": np.array([[s.sim, s.step, s.seq, s.reuse] for s in items], dtype=np.int64),
                  "t": np.array([s.t for s in items], dtype=np.float64),
                  "params": np.stack([s.params for s in items]).astype(np.float32),
                  "fields": np.stack([s.fields for s in items]).astype(np.float32)}
        return arrays, meta

    def load_state(self, arrays: dict[str, np.ndarray], meta: dict, keep=lambda sim: True,
                   counters: bool = True) -> None:
        """Restore what :meth:`state` gave (several ranks' states may be merged: ``keep``
        selects the simulations this rank now owns, ``counters`` whether this state's
        counters are this buffer's history). Every saved sample comes back, even past the
        capacity (fewer trainer ranks than saved them): a restore never drops data."""
        if meta.get("policy_set") in POLICIES and meta["policy_set"] != self.config.policy:
            self.set_policy(meta["policy_set"])  # changed during the saved run: kept
        with self._cond:
            self._seq = max(self._seq, int(meta.get("seq", 0)))
            if meta.get("rng") and not self._items:
                self._rng.bit_generator.state = meta["rng"]
            if counters:
                s = meta.get("stats", {})
                self.stats.ingested += int(s.get("ingested", 0))
                self.stats.served += int(s.get("served", 0))
                self.stats.batches += int(s.get("batches", 0))
                for k, n in (s.get("reuse_hist") or {}).items():
                    self.stats.reuse_hist[int(k)] = self.stats.reuse_hist.get(int(k), 0) + int(n)
            if "keys" in arrays:
                for i, (sim, step, seq, reuse) in enumerate(arrays["keys"].tolist()):
                    if keep(sim):
                        self._items.append(Sample(sim, step, float(arrays["t"][i]), arrays["params"][i].copy(),
                                                  arrays["fields"][i].copy(), seq, reuse))
            self._cond.notify_all()
