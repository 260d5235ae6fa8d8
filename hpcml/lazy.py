"""Names a package hands out on first use, so importing it costs nothing until then (the
planner reads model shapes without importing torch). Every package's ``__getattr__`` is one
of these (issue 44: one public-surface mechanism)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection


def lazy_names(package: str, where: dict[str, str], submodules: Collection[str] = ()) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: name -> the attribute of ``package.<where[name]>``
    (or of ``where[name]`` itself when it is an absolute ``hpcml...`` path); a name in
    ``submodules`` -> the submodule ``package.<name>``."""

    def __getattr__(name: str) -> object:
        if name in where:
            module = where[name]
            return getattr(importlib.import_module(module if module.startswith("hpcml") else f"{package}.{module}"),
                           name)
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
