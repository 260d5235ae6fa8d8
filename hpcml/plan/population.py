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


@dataclass(frozen=True)
class MixedPrice:
    """K members of different layouts: they step together (the selection hooks agree on every
    step), so at the slowest member's pace, and swap through checkpoints, resharded on load."""

    members: int
    gpus_per_member: int
    step_s: float
    """The slowest member's step: the population's."""
    slowest: int
    checkpoint_gib: float
    """A member's whole state -- fp32 weights and Adam's two moments -- that a swap writes and
    the partner reads."""
    scratch_gbps: float | None
    exchange_s: float | None
    """Every member writing its state at once, then reading its partner's, at ``scratch_gbps``
    (the job's file-system rate; None: not priced)."""
    evaluate_s: float
    every: int | None
    overhead: float | None

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def state_gib(model) -> float:
    """Weights (fp32) and Adam's two moments of every trainable one: a member's checkpoint."""
    import math

    from hpcml.models.transformer import footprint as fp

    n = {name: math.prod(shape) for name, shape in fp.param_shapes(model).items()}
    return sum(4 * v + 8 * v * fp.trainable(name) for name, v in n.items()) / GIB


def price_mixed(step_s: list[float], model, *, gpus_per_member: int, every: int | None = None,
                scratch_gbps: float | None = None, val_batches: int = 1) -> MixedPrice:
    """The price of members of different layouts from each one's predicted step."""
    if every is not None and (not is_int(every) or every < 1):
        raise ConfigError(f"--exchange-every {every!r}: expected a whole number of steps >= 1")
    if scratch_gbps is not None and not (isinstance(scratch_gbps, (int, float)) and 0 < scratch_gbps < float("inf")):
        raise ConfigError(f"--scratch-gbps {scratch_gbps!r}: expected the file system's rate in GB/s, > 0")
    k, slowest = len(step_s), max(range(len(step_s)), key=lambda i: step_s[i])
    step, state = step_s[slowest], state_gib(model)
    exchange = 2 * k * state * GIB / (scratch_gbps * 1e9) if scratch_gbps else None
    evaluate = 2 * val_batches * step / 3
    overhead = (exchange + evaluate) / (every * step) if every and exchange is not None and step > 0 else None
    return MixedPrice(k, gpus_per_member, step, slowest, state, scratch_gbps, exchange, evaluate, every, overhead)


def mixed_line(mp: MixedPrice) -> str:
    """The sentence under the members' lines."""
    swap = (f"{mp.exchange_s:.3g} s at --scratch-gbps {mp.scratch_gbps:g}" if mp.exchange_s is not None
            else "not priced: give --scratch-gbps, the job's file-system rate")
    every = (f"; every {mp.every} steps that adds {mp.overhead:.1%} to the steps" if mp.overhead is not None else "")
    return (f"population: {mp.members} members of {mp.gpus_per_member} devices, different layouts, stepping "
            f"together at the slowest's {mp.step_s:.3g} s (member {mp.slowest}); an exchange goes through "
            f"checkpoints, {mp.checkpoint_gib:.2f} GiB a member written and read ({swap}), and scores both "
            f"models ({mp.evaluate_s:.3g} s){every}")
