"""Save: every rank writes its own pieces to ``rank_NNNNN.h5``; rank 0 writes ``index.h5``,
whose virtual datasets present each global tensor whole; the directory is committed by rename.

Crash safety: everything goes to ``step_N.tmp/``; shards, index and manifest are fsynced,
the directory is renamed to ``step_N/`` and only then is ``latest`` replaced (write +
rename). A save killed at any moment leaves ``latest`` on a complete checkpoint; a failed
save (a full disk) removes its ``.tmp``. Integrity: ``manifest.json`` records every file's
size and digest (a CRC-32 per data chunk, taken as the chunk is written; a SHA-256 of each
file's metadata) and the save's id, which every file also carries (:mod:`hpcml.ckpt.manifest`).
Three collectives per save: an allgather of what each rank holds, a gather of the shard
statuses (with the placement of each tensor a rank wrote: rank 0 may hold none of a later
pipeline stage's), a broadcast of the outcome (so a failure raises on every rank).
"""

from __future__ import annotations

import os
import time

import torch

from hpcml.ckpt import format as fmt
from hpcml.ckpt.pipeline import SaveResult, finish, prepare, write_local
from hpcml.ckpt.single import require_parallel_hdf5, write_single


def save(root: str | os.PathLike, step: int, tensors: dict[str, torch.Tensor], *, comm=None,
         extra: dict | None = None, layout: dict | None = None, keep: int | fmt.Keep | None = None,
         tensor_attrs: dict[str, dict] | None = None, single_file: bool = False, key=None) -> SaveResult:
    """Write ``tensors`` (name -> DTensor or tensor; all ranks pass the names they hold) as
    checkpoint ``root/step_N``. ``extra`` is JSON-able non-tensor state (config, data
    positions, ...). ``keep`` prunes to the newest K checkpoints (a :class:`~hpcml.ckpt.format.Keep`:
    and spares the step roots saved in lock-step hold in common). ``single_file``: all
    ranks write one ``shared.h5`` collectively (MPI-IO) instead of a file each; the index
    and the reader are the same. ``key``: sign the manifest (:func:`hpcml.ckpt.keys.keyring`;
    by default the key of ``$HPCML_CKPT_KEY`` / ``$HPCML_CKPT_KEY_FILE`` when set). The
    first save into ``root`` makes this job its owner (:mod:`hpcml.ckpt.lock`). Collective over ``comm``.
    """
    from mpi4py import MPI

    if single_file:  # the same h5py on every rank: all raise here, before any collective
        require_parallel_hdf5()
    pending = prepare(root, step, tensors, comm or MPI.COMM_WORLD, extra, layout, keep, tensor_attrs, key=key,
                      single_file=single_file)
    t = time.perf_counter()
    status = write_single(pending) if single_file else write_local(pending)
    return finish(pending, status, time.perf_counter() - t)


__all__ = ["SaveResult", "save"]
