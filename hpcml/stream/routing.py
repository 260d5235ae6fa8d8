"""Which trainer rank takes which simulation, and how the two sides find each other.

Routing is round robin, ``sim_id % n_trainers``: the Campaign numbers simulations
0..S-1, so with S >= n every trainer rank gets data and the counts differ by at most one
(a hash balances only on average: 3 simulations on 2 ranks could all land on one, and the
other rank would train on nothing). Every process computes the same answer with no
communication. With S < n, ranks S..n-1 get no simulation (the training call then
fails: a rank without a sample). When the trainer count changes most simulations move;
a restore reads every saved rank's state anyway, so nothing is lost or taken twice.

Rendezvous between a training job and simulations launched separately: the trainer
writes ``endpoints.json`` (one stream address per data-parallel rank, with the campaign
and run, written atomically: :func:`hpcml.contract.write_endpoints`); the campaign's
contract (:mod:`hpcml.contract`) names it and the secret file for every simulation. The
secret is 32 random bytes in a file readable by its owner only.
"""

from __future__ import annotations

import operator
import os
import secrets
from pathlib import Path

from hpcml import safeio
from hpcml.contract import read_endpoints, write_endpoints
from hpcml.errors import ConfigError

__all__ = ["new_secret", "read_endpoints", "read_secret", "route", "write_endpoints"]


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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.hex().encode())
    return key


def read_secret(path: str | os.PathLike) -> bytes:
    try:
        text = safeio.read_text(path, 4096, "64 hex characters")
        key = bytes.fromhex(text.strip()) if text is not None else None
    except (OSError, ValueError) as e:
        raise ConfigError(f"stream secret file {path}: {e}; expected 64 hex characters") from None
    if key is None:
        raise ConfigError(f"stream secret file {path}: no such file; expected 64 hex characters")
    if len(key) < 16:
        raise ConfigError(f"stream secret in {path} has {len(key)} bytes, expected >= 16")
    return key
