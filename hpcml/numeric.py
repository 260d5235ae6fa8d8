"""What counts as a number in a config, a record or a message: an ``int`` that is not a
``bool`` (``True`` is an ``int`` to Python, never a count or a size to hpcml), a real that is
not a ``bool``. One definition, so every check refuses the same values (issue 44)."""

from __future__ import annotations


def is_int(x: object, *, numpy: bool = False) -> bool:
    """``x`` is an integer and not a bool (with ``numpy``, numpy's integers count too)."""
    if isinstance(x, bool):
        return False
    if numpy:
        import numpy as np  # only callers that hold numpy values pay its import

        return isinstance(x, (int, np.integer))
    return isinstance(x, int)


def is_real(x: object) -> bool:
    """``x`` is an int or a float and not a bool (NaN and infinities included: check them apart)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
