"""Training data from files: tokenized corpora packed into HDF5 and read as untrusted input
(:mod:`hpcml.data.tokens`, :mod:`hpcml.data.pack`, :mod:`hpcml.data.mixture`; docs/data.md)."""

from hpcml.data.mixture import Mixture, end_of_document, open_tokens
from hpcml.data.tokens import DataError, Manifest, TokenDataset

__all__ = ["DataError", "Manifest", "Mixture", "TokenDataset", "end_of_document", "open_tokens", "pack"]


def pack(*args, **kwargs):
    """:func:`hpcml.data.pack.pack` (imported on use: it needs mpi4py and h5py)."""
    from hpcml.data.pack import pack as _pack

    return _pack(*args, **kwargs)
