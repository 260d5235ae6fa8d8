"""What a training loop needs of a sample source, and the state every source saves.

A source fills a :class:`~hpcml.stream.buffer.Buffer` from a thread: the
:class:`~hpcml.stream.server.StreamServer` from simulations over ZeroMQ, the
:class:`~hpcml.stream.files.FileSource` from HDF5 files, or a user's own. Its state is
plain named arrays (buffer contents, the ``(sim, step)`` keys already taken, JSON meta as
uint8), so it goes into a checkpoint beside the model and a restart ingests nothing twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import numpy as np

from hpcml.stream.buffer import Buffer


@runtime_checkable
class SampleSource(Protocol):
    """Fills ``buffer``; ``buffer.end()`` once nothing more will come."""

    buffer: Buffer

    def start(self) -> SampleSource: ...

    def stop(self) -> None: ...

    def quiesce(self) -> None:
        """Take in what is already on its way (before a save that stops the run)."""

    def stats(self) -> dict:
        """Counters: at least ``samples``, ``bytes``, ``duplicates``, ``dropped`` (reason -> n)."""

    def state(self) -> dict[str, np.ndarray]:
        """This rank's state as named arrays, consistent at one instant."""

    def load_state(self, states: list[dict[str, np.ndarray]]) -> None:
        """Restore from every saved rank's :meth:`state`, keeping what routes to this rank now."""


def pack_state(buffer: Buffer, seen: Iterable[tuple[int, int]], meta: dict) -> dict[str, np.ndarray]:
    """A source's state as arrays: ``buffer/*``, ``seen`` [N, 2] int64 and ``meta_json``."""
    arrays, buffer_meta = buffer.state()
    out = {f"buffer/{k}": v for k, v in arrays.items()}
    out["seen"] = np.array(sorted(seen), dtype=np.int64).reshape(-1, 2)
    out["meta_json"] = np.frombuffer(json.dumps({**meta, "buffer": buffer_meta}).encode(), dtype=np.uint8).copy()
    return out


def unpack_states(states: list[dict[str, np.ndarray]], buffer: Buffer, seen: set[tuple[int, int]],
                  keep: Callable[[int], bool], rank: int) -> list[dict]:
    """Put the saved samples and keys of the simulations ``keep`` selects back into ``buffer``
    and ``seen`` (``states`` in saved-rank order; the buffer's counters go on from saved rank
    ``rank``'s, once); each saved rank's meta, in order."""
    metas = []
    for i, st in enumerate(states):
        meta = json.loads(bytes(st["meta_json"]).decode())
        seen.update((int(a), int(b)) for a, b in st.get("seen", np.zeros((0, 2), np.int64)).tolist() if keep(a))
        buffer.load_state({k[len("buffer/"):]: v for k, v in st.items() if k.startswith("buffer/")}, meta["buffer"],
                          keep=keep, counters=i == rank)
        metas.append(meta)
    return metas
