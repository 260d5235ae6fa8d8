"""Stream and buffer state inside an hpcml checkpoint: ``stream/rank_NNNNN/<name>`` tensors.

Each trainer rank saves its own (buffer contents, ``seen`` keys, counters as JSON bytes).
On restore every rank reads the states of all saved ranks and keeps the simulations that
route to it now, so a restart on another trainer count rebalances the buffers and the
exactly-once state with the simulations (see :func:`hpcml.stream.routing.route`).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from hpcml.stream.server import StreamServer

_NAME = re.compile(r"^stream/rank_(\d{5})/(.+)$")


def stream_tensors(server: StreamServer, rank: int) -> dict[str, torch.Tensor]:
    return {f"stream/rank_{rank:05d}/{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in
            server.state().items() if v.size}


def load_stream_states(ckpt_path) -> list[dict[str, np.ndarray]]:
    """Every saved rank's stream state from checkpoint ``ckpt_path`` (plain h5py, no pickle)."""
    from hpcml import ckpt
    from hpcml.ckpt.reader import _open_index

    path = ckpt.resolve(ckpt_path)
    states: dict[int, dict[str, np.ndarray]] = {}
    with _open_index(path) as index:
        names = []
        index.visititems(lambda n, obj: names.append(n) if _NAME.match(n) and hasattr(obj, "shape") else None)
        for n in names:
            m = _NAME.match(n)
            states.setdefault(int(m.group(1)), {})[m.group(2)] = ckpt.read_tensor(index, n).numpy()
    for st in states.values():
        st.setdefault("seen", np.zeros((0, 2), np.int64))
    return [states[r] for r in sorted(states)]


def simulations_in(ckpt_path, outputs: int) -> set[int]:
    """Simulations of which checkpoint ``ckpt_path`` holds at least ``outputs`` samples
    (every output): their data survives a restart, so a resumed campaign need not run them
    again. One that finished after the save is not among them."""
    from collections import Counter

    seen = Counter(int(sim) for st in load_stream_states(ckpt_path) for sim, _ in st["seen"].tolist())
    return {sim for sim, n in seen.items() if n >= outputs}
