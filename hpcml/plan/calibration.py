"""The time model's constants per device family, fitted on published measured runs.

``data/calibration.json`` holds the fitted constants with the tables they were fitted on;
``data/published/*.json`` holds those tables as published, each with its source. The fit
(:mod:`hpcml.plan.fit`) is a small grid search that minimises the mean squared log error of
predicted against published throughput; tests hold the predictions to the published figures.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from functools import lru_cache
from importlib import resources

from hpcml.errors import ConfigError
from hpcml.plan.devices import Device
from hpcml.plan.constants import Constants


@lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads(resources.files("hpcml.plan").joinpath("data/calibration.json").read_text())


def constants(dev: Device) -> Constants:
    """The fitted constants of ``dev``'s family (the defaults where none were fitted; a device
    file's own, :mod:`hpcml.plan.devfile`)."""
    from hpcml.plan.devfile import constants_of

    own = constants_of(dev.family)
    if own is not None:
        return own
    fam = _table().get("families", {}).get(dev.family, {})
    known = {f.name for f in fields(Constants)}
    bad = sorted(set(fam.get("constants", {})) - known)
    if bad:
        raise ConfigError(f"calibration.json: family {dev.family}: unknown constants {bad}")
    return replace(Constants(), **fam.get("constants", {}))


def unfitted(dev: Device) -> str | None:
    """A line saying that no measured run fitted ``dev``'s time constants (its family has no
    published table in ``calibration.json`` and no device file of the user's), or None: its times
    are the planner's defaults, estimates to say as such, not facts."""
    from hpcml.plan.devfile import constants_of

    if constants_of(dev.family) is not None or dev.family in _table().get("families", {}):
        return None
    return (f"{dev.name}: no measured run fits the {dev.family} family's time constants (no published table "
            f"found; unverified defaults), so its step times and MFU are estimates: time a few steps on it and "
            f"fit them with 'hpcml plan calibrate RUNS' (docs/plan.md)")


def calibrated(dev: Device) -> Device:
    """``dev`` running at the share of its peak fitted for it, where its source gives a range only."""
    fit = _table().get("devices", {}).get(dev.name.split("@")[0])
    if not fit or dev.sustained_range is None:
        return dev
    return replace(dev, sustained=float(fit["sustained"]))


def published(name: str) -> dict:
    """A published table (``data/published/<name>.json``): its source, columns and rows."""
    return json.loads(resources.files("hpcml.plan").joinpath(f"data/published/{name}.json").read_text())

