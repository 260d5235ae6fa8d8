"""A population's price (issue 45): K members of one layout on ``gpus / K`` devices each, and
what an exchange -- a tournament's swap or a PBT copy -- costs on top of their steps.

A swap moves what each rank holds of the model and the optimizer (:mod:`hpcml.train.population`:
one send and one receive per rank, to the rank at its place in the partner member, at the same
time). The two members sit on different nodes whenever a member fills a node, so the bytes
cross the network at the device's off-node bandwidth (``Device.inter_gbps``); members smaller
than a node are priced the same way (a partner on another node is the worst case). Each
exchange also scores both models on validation data: two evaluations of ``val_batches``
batches, a forward each (a third of a step's compute per batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.plan.devices import GIB, Device


@dataclass(frozen=True)
class PopulationPrice:
    members: int
    gpus_per_member: int
    exchange_gib_per_rank: float
    """Weights and optimizer state one rank sends (and receives) in a swap."""
    exchange_s: float
    """The swap's transfer: the bytes at the off-node bandwidth, both directions at once."""
    evaluate_s: float
    """Scoring both models: 2 x ``val_batches`` forward passes of one global batch."""
    every: int | None
    overhead: float | None
    """(exchange + evaluations) / (``every`` steps): the share a population adds to its steps."""

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def member_gpus(gpus: int, members) -> int:
    """The devices of one member; ConfigError unless ``members`` divides ``gpus``."""
    if not is_int(members) or members < 1:
        raise ConfigError(f"--pop {members!r}: expected a positive whole number of population members")
    if gpus % members:
        raise ConfigError(f"--pop {members} does not divide --gpus {gpus}: every member needs as many devices")
    return gpus // members


def price(memory_gib: dict[str, float], step_s: float, dev: Device, *, members: int, gpus_per_member: int,
          every: int | None = None, val_batches: int = 1) -> PopulationPrice:
    """The population's exchange cost from a member's prediction (its fullest rank's memory and step)."""
    if every is not None and (not is_int(every) or every < 1):
        raise ConfigError(f"--exchange-every {every!r}: expected a whole number of steps >= 1")
    state = memory_gib.get("params", 0.0) + memory_gib.get("optimizer", 0.0)
    exchange_s = state * GIB / (dev.inter_gbps * 1e9)
    evaluate_s = 2 * val_batches * step_s / 3
    overhead = (exchange_s + evaluate_s) / (every * step_s) if every and step_s > 0 else None
    return PopulationPrice(members, gpus_per_member, state, exchange_s, evaluate_s, every, overhead)


def line(pp: PopulationPrice) -> str:
    """The population's sentence under the member's line."""
    every = (f"; every {pp.every} steps that adds {pp.overhead:.1%} to the steps" if pp.overhead is not None
             else "; --exchange-every N prices it against the steps")
    return (f"population: {pp.members} members of {pp.gpus_per_member} devices; an exchange moves "
            f"{pp.exchange_gib_per_rank:.2f} GiB a rank each way ({pp.exchange_s:.3g} s off the node) and scores "
            f"both models ({pp.evaluate_s:.3g} s){every}")
