"""Training data from files: tokenized corpora packed into HDF5 and read as untrusted input
(:mod:`hpcml.data.tokens`, :mod:`hpcml.data.pack`, :mod:`hpcml.data.mixture`; docs/data.md).
The names below are imported on first use: ``hpcml``'s command line parses ``hpcml data``'s
options with every command's, and numpy's import was 0.4 s of each ``hpcml plan``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcml.data.mixture import Mixture, end_of_document, open_tokens
    from hpcml.data.tokens import DataError, Manifest, TokenDataset

__all__ = ["DataError", "Manifest", "Mixture", "TokenDataset", "end_of_document", "open_tokens", "pack"]
_HOME = {"Mixture": "mixture", "end_of_document": "mixture", "open_tokens": "mixture", "DataError": "tokens",
         "Manifest": "tokens", "TokenDataset": "tokens"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f"hpcml.data.{_HOME[name]}"), name)
    raise AttributeError(f"module 'hpcml.data' has no attribute {name!r}")


def pack(*args, **kwargs):
    """:func:`hpcml.data.pack.pack` (imported on use: it needs mpi4py and h5py)."""
    from hpcml.data.pack import pack as _pack

    return _pack(*args, **kwargs)
