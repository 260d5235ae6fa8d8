"""What a training loop needs of a sample source, and the state every source saves.

A source fills a :class:`~hpcml.stream.buffer.Buffer` from a thread: the
:class:`~hpcml.stream.server.StreamServer` from simulations over TCP, the
:class:`~hpcml.stream.files.FileSource` from HDF5 files, or a user's own. Its state is
plain named arrays (buffer contents, the ``(sim, step)`` keys already taken, JSON meta as
uint8), so it goes into a checkpoint beside the model and a restart ingests nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import numpy as np

from hpcml import safeio
from hpcml.numeric import is_real
from hpcml.stream.buffer import Buffer
from hpcml.stream.routing import route


class SampleSource:
    """What a training loop takes samples from: it fills ``buffer`` from a thread and calls
    ``buffer.end()`` once nothing more will come. A base class with a default for every member
    the loop uses, so the loop never probes for one: a source of one's own subclasses it and
    overrides what it has (the stream server and the file source do). The defaults keep no
    state beyond the buffer: ``state`` saves its samples, ``load_state`` puts back those of the
    simulations that route to this rank (:func:`hpcml.stream.routing.route` over ``rank`` of
    ``n_trainers``)."""

    buffer: Buffer
    rank: int = 0
    n_trainers: int = 1
    param_names: tuple[str, ...] = ()
    """The samples' parameters by name, in the order of ``Sample.params`` (feedback names them)."""
    endpoint: str | None = None
    """Where producers connect, published for the campaign (None: nothing listens)."""
    max_connections: int | None = None
    """Producer connections this rank holds at most (None: no connections)."""

    def start(self) -> SampleSource:
        return self

    def stop(self) -> None:
        """Take nothing more in."""

    def quiesce(self) -> None:
        """Take in what is already on its way (before a save that stops the run)."""

    def stats(self) -> dict:
        """Counters: at least ``samples``, ``bytes``, ``duplicates``, ``dropped`` (reason -> n)."""
        return {"samples": self.buffer.stats.ingested, "bytes": 0, "duplicates": 0, "dropped": {}}

    def accounting(self) -> dict:
        """``{"expected": {sim: samples it should give, or None if unknown}, "ingested": {sim: samples
        taken}}`` for this rank's simulations, restarts included: what the run's summary
        counts as missing (no silent loss). The default knows of none."""
        return {"expected": {}, "ingested": {}}

    def state(self) -> dict[str, np.ndarray]:
        """This rank's state as named arrays, consistent at one instant."""
        return pack_state(self.buffer, (), {})

    def load_state(self, states: list[dict[str, np.ndarray]]) -> None:
        """Restore from every saved rank's :meth:`state`, keeping what routes to this rank now."""
        unpack_states(states, self.buffer, set(), lambda sim: route(int(sim), self.n_trainers) == self.rank,
                      self.rank, self.n_trainers)


def pack_state(buffer: Buffer, seen: Iterable[tuple[int, int]], meta: dict, also=()) -> dict[str, np.ndarray]:
    """A source's state as arrays: ``buffer/*``, ``seen`` [N, 2] int64 and ``meta_json``
    (``also``: samples taken in but not yet in the buffer, saved as if they were)."""
    arrays, buffer_meta = buffer.state(also)
    out = {f"buffer/{k}": v for k, v in arrays.items()}
    out["seen"] = np.array(sorted(seen), dtype=np.int64).reshape(-1, 2)
    out["meta_json"] = np.frombuffer(json.dumps({**meta, "buffer": buffer_meta}).encode(), dtype=np.uint8).copy()
    return out


def history_of(saved_rank: int, rank: int, n_ranks: int) -> bool:
    """Whether saved rank ``saved_rank``'s counters (its history: duplicates, drops, bytes,
    buffer statistics) go on in rank ``rank`` of ``n_ranks`` now: its own number's, and rank
    0 takes those of saved ranks that no longer exist -- each history once, none lost, on any
    trainer count. Sample counts are not history: they are ``len(seen)`` of what a rank owns."""
    return saved_rank == rank or (saved_rank >= n_ranks and rank == 0)


def unpack_states(states: list[dict[str, np.ndarray]], buffer: Buffer, seen: set[tuple[int, int]],
                  keep: Callable[[int], bool], rank: int, n_ranks: int) -> list[dict]:
    """Put the saved samples and keys of the simulations ``keep`` selects back into ``buffer``
    and ``seen`` (``states`` in saved-rank order; the buffer's counters go on as
    :func:`history_of` says); each saved rank's meta, in order."""
    metas = []
    for i, st in enumerate(states):
        meta = safeio.parse_json(bytes(st["meta_json"]), "the saved stream state", constants=True)  # input too
        seen.update((int(a), int(b)) for a, b in st.get("seen", np.zeros((0, 2), np.int64)).tolist() if keep(a))
        buffer.load_state({k[len("buffer/"):]: v for k, v in st.items() if k.startswith("buffer/")}, meta["buffer"],
                          keep=keep, counters=history_of(i, rank, n_ranks))
        metas.append(meta)
    return metas


def add_counters(into: dict[str, int], saved: dict, skip: tuple[str, ...] = ("samples",)) -> None:
    """Saved counters added to ``into`` (numbers only), except the sample count."""
    for k, v in saved.items():
        if k not in skip and is_real(v):
            into[k] = into.get(k, 0) + v
