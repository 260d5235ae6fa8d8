"""Training data from files: tokenized corpora packed into HDF5 and read as untrusted input
(:mod:`hpcml.data.tokens`, :mod:`hpcml.data.pack`, :mod:`hpcml.data.mixture`; docs/data.md).
The names below are handed out on first use: ``hpcml``'s command line parses ``hpcml data``'s
options with every command's, and numpy's import was 0.4 s of each ``hpcml plan``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcml.lazy import lazy_names

if TYPE_CHECKING:
    from hpcml.data.mixture import Mixture, end_of_document, open_tokens
    from hpcml.data.tokens import DataError, Manifest, TokenDataset

__all__ = ["DataError", "Manifest", "Mixture", "TokenDataset", "end_of_document", "open_tokens", "pack"]
__getattr__ = lazy_names(__name__, {"Mixture": "mixture", "end_of_document": "mixture", "open_tokens": "mixture",
                                    "DataError": "tokens", "Manifest": "tokens", "TokenDataset": "tokens"})


def pack(*args, **kwargs):
    """:func:`hpcml.data.pack.pack` (imported on use: it needs mpi4py and h5py)."""
    from hpcml.data.pack import pack as _pack

    return _pack(*args, **kwargs)
