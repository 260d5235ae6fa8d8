"""Which trainer rank takes which simulation, and how the two sides find each other.

Routing is round robin, ``sim_id % n_trainers``: the Campaign numbers simulations
0..S-1, so with S >= n every trainer rank gets data and the counts differ by at most one
(a hash balances only on average: 3 simulations on 2 ranks could all land on one, and the
other rank would train on nothing). Every process computes the same answer with no
communication. With S < n, ranks S..n-1 get no simulation (the training call then
fails: a rank without a sample). When the trainer count changes most simulations move;
a restore reads every saved rank's state anyway, so nothing is lost or taken twice.

Rendezvous between a training job and simulations launched separately: the trainer
writes ``endpoints.json`` (one ZeroMQ address per data-parallel rank, written atomically);
the campaign passes its path and the secret file's path to every simulation
(``HPCML_STREAM_ENDPOINTS_FILE``, ``HPCML_STREAM_SECRET_FILE``). The secret is 32 random
bytes in a file readable by its owner only.
"""

from __future__ import annotations

import json
import operator
import os
import secrets
import time
from pathlib import Path

from hpcml.errors import ConfigError, LaunchError


def route(sim_id: int, n_trainers: int) -> int:
    """The trainer rank (0..n_trainers-1) that ingests simulation ``sim_id``."""
    if n_trainers < 1:
        raise ConfigError(f"n_trainers must be >= 1, got {n_trainers}")
    try:
        sim = operator.index(sim_id)
    except TypeError:
        sim = -1
    if sim < 0:
        raise ConfigError(f"sim_id {sim_id!r}: expected an integer >= 0")
    return sim % n_trainers


def new_secret(path: str | os.PathLike) -> bytes:
    """Create (or reuse) the campaign secret at ``path``, mode 0600."""
    path = Path(path)
    if path.exists():
        return read_secret(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.hex().encode())
    return key


def read_secret(path: str | os.PathLike) -> bytes:
    try:
        text = Path(path).read_text().strip()
        key = bytes.fromhex(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"stream secret file {path}: {e}; expected 64 hex characters") from None
    if len(key) < 16:
        raise ConfigError(f"stream secret in {path} has {len(key)} bytes, expected >= 16")
    return key


def write_endpoints(path: str | os.PathLike, campaign: str, endpoints: list[str]) -> None:
    """Publish the trainers' addresses (index = dp rank), atomically."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"campaign": campaign, "endpoints": endpoints, "time": time.time()}))
    tmp.rename(path)


def read_endpoints(path: str | os.PathLike, timeout_s: float = 0.0) -> tuple[str, list[str]]:
    """(campaign id, endpoints), waiting up to ``timeout_s`` for the file to appear."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            raise LaunchError(f"stream endpoints file {path} does not exist (is the training job up?)")
        time.sleep(0.1)
    try:
        d = json.loads(path.read_text())
        campaign, endpoints = str(d["campaign"]), [str(e) for e in d["endpoints"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"stream endpoints file {path} is malformed: {e}") from None
    if not endpoints:
        raise ConfigError(f"stream endpoints file {path} lists no endpoints")
    return campaign, endpoints
