"""What a sample of this training looks like, checked once at the edge, and the one place a
:class:`~hpcml.stream.buffer.Sample` is built.

Both sources -- the stream server's assembly and the file reader -- hand every sample
through :class:`SampleSchema`: the fields it carries must be the trainer's, its parameters
must include the trainer's, and its grid must be the grid of every sample before it on
this rank (the first sample fixes it, or ``shape`` does). A sample that breaks the schema
is refused with a :class:`~hpcml.stream.message.MessageError` that names the simulation
and the shapes, so no batch ever stacks two grids and no error surfaces later as a bare
``all input arrays must have the same shape``. Later stages trust the record.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.stream.buffer import Sample
from hpcml.stream.message import MAX_DIMS, MessageError


_F32_INF = 2.0**128 - 2.0**103
"""Halfway between the largest float32 and 2**128: a value this large or larger rounds to infinity."""


def shape_text(shape: Sequence[int]) -> str:
    return " x ".join(str(n) for n in shape) if len(shape) > 1 else f"{shape[0]} (1-D)"


class SampleSchema:
    """Field names, parameter names and the grid shape of every sample of one trainer rank."""

    def __init__(self, field_names: Sequence[str], param_names: Sequence[str] = (),
                 shape: Sequence[int] | None = None) -> None:
        self.field_names, self.param_names = tuple(field_names), tuple(param_names)
        self._names = frozenset(self.field_names)
        if not self.field_names or not all(isinstance(n, str) and n for n in self.field_names):
            raise ConfigError(f"field_names={field_names!r}: expected one or more field names (e.g. ('T',))")
        if len(set(self.field_names)) != len(self.field_names):
            raise ConfigError(f"field_names={field_names!r} names a field twice")
        if shape is not None:
            shape = tuple(shape)
            if not 1 <= len(shape) <= MAX_DIMS or any(not is_int(n) or n < 1
                                                      for n in shape):
                raise ConfigError(f"shape={shape!r}: expected 1 to {MAX_DIMS} grid sizes >= 1")
        self.shape: tuple[int, ...] | None = shape
        self.shape_from: int | None = None
        """The simulation whose sample fixed ``shape`` (None: given, or none yet)."""

    def check(self, sim: int, fields: Collection[str], params: Mapping[str, float], shape: Sequence[int]) -> None:
        """Refuse (MessageError ``wrong_fields``, ``missing_params``, ``wrong_shape``) a sample, or
        a block of one, of ``sim`` that does not fit; the first whole sample fixes the grid
        shape (:meth:`fix`): blocks of a sample that never completes fix nothing."""
        if set(fields) != self._names:
            raise MessageError("wrong_fields", f"simulation {sim} sends fields {sorted(fields)}, the trainer takes "
                                               f"{list(self.field_names)}")
        lacking = [n for n in self.param_names if n not in params]
        if lacking:
            raise MessageError("missing_params", f"simulation {sim}'s parameters {sorted(params)} lack "
                                                 f"{lacking} (the trainer's param_names)")
        shape = tuple(shape)
        if self.shape is not None and shape != self.shape:
            first = f"simulation {self.shape_from}'s" if self.shape_from is not None else "the trainer's"
            raise MessageError("wrong_shape", f"simulation {sim}'s grid is {shape_text(shape)}, {first} "
                                              f"{shape_text(self.shape)}: every sample of a training must share "
                                              f"one grid")

    def fix(self, sim: int, shape: Sequence[int]) -> None:
        """The grid of a whole sample of ``sim`` (checked): the first fixes the schema's."""
        if self.shape is None:
            self.shape, self.shape_from = tuple(shape), sim

    def params_vector(self, params: Mapping[str, float]) -> np.ndarray:
        """The trainer's parameters in its order, float32 (MessageError ``bad_header`` for a
        value finite in JSON but not in float32, e.g. 1e300)."""
        vals = [params[n] for n in self.param_names]
        if not all(-_F32_INF < x < _F32_INF for x in vals):  # rounds to inf in float32 (NaN never got here)
            with np.errstate(over="ignore"):
                v = np.array(vals, np.float32)
            raise MessageError("bad_header", f"parameters {dict(zip(self.param_names, v.tolist()))} overflow float32")
        return np.array(vals, np.float32)

    def sample(self, sim: int, step: int, t: float, params: np.ndarray, fields: np.ndarray) -> Sample:
        """A Sample of fields [F, *shape] already checked (:meth:`check`), as float32; its
        grid fixes the schema's if none is yet."""
        self.fix(sim, fields.shape[1:])
        return Sample(sim, step, t, params, fields if fields.dtype == np.float32 else fields.astype(np.float32))

    def state(self) -> dict:
        return {"shape": list(self.shape) if self.shape is not None else None, "shape_from": self.shape_from}

    def load_state(self, meta: Mapping) -> None:
        """Take a saved grid shape (the first saved rank's that has one) when none is fixed yet."""
        if self.shape is None and meta.get("shape"):
            self.shape, self.shape_from = tuple(int(n) for n in meta["shape"]), meta.get("shape_from")
