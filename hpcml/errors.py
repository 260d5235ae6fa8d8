"""One exception hierarchy for hpcml.

Every error is an :class:`HpcmlError` *and* the built-in a caller would already catch
(``ValueError`` for bad input, ``RuntimeError`` for a failed operation), so code that
knows nothing of hpcml still handles it.
"""

from __future__ import annotations


class HpcmlError(Exception):
    """Root of all hpcml errors."""


class ConfigError(HpcmlError, ValueError):
    """A configuration value is out of range or inconsistent."""


class GridError(ConfigError):
    """A process-grid layout does not fit the world size or names an unknown axis."""


class LaunchError(HpcmlError, RuntimeError):
    """The launch environment or distributed bootstrap failed."""


class MissingFeatureError(HpcmlError, RuntimeError):
    """A dependency lacks a feature hpcml needs (e.g. h5py built without MPI)."""


class CheckpointError(HpcmlError, RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


class DivergenceError(HpcmlError, FloatingPointError):
    """Training stopped: the loss or the gradients stayed NaN or infinite (the weights are
    those of the last finite step)."""


class PopulationDivergedError(DivergenceError):
    """Every member of a population diverged: raised on every rank of the job at once (at a
    selection round), so it ends cleanly -- one member's :class:`DivergenceError` ends the job."""
