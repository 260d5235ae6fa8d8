"""Names a package hands out on first use, so importing it costs nothing until then (the
planner reads model shapes without importing torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: name -> ``package.<where[name]>``'s attribute."""

    def __getattr__(name: str) -> object:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
