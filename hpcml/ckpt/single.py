"""The collective single-file save: every rank writes its hyperslabs of full-size datasets
into one ``shared.h5`` through h5py's ``mpio`` driver, for file systems where a file per rank
is too many. HDF5 writes the data here, so rank 0 reads the file back once (from cache) to
take the same chunk tables and digests a shard's manifest entry has."""

from __future__ import annotations

import h5py

from hpcml.ckpt import format as fmt
from hpcml.ckpt.index import SINGLE_FILE
from hpcml.ckpt.shard import describe, fsync_path, preallocated, storage_chunk
from hpcml.errors import MissingFeatureError


def require_parallel_hdf5(mpi: bool | None = None) -> None:
    """Raise unless h5py was built with MPI (``mpi``: that fact, default this h5py's)."""
    if mpi is None:
        mpi = bool(h5py.get_config().mpi)
    if not mpi:
        raise MissingFeatureError(f"single_file=True needs h5py built with MPI (parallel HDF5), but h5py "
                                  f"{h5py.version.version} here was built without it; rebuild it with HDF5_MPI=ON")


def write_single(p) -> tuple:
    """This rank's part of a single-file save (collective); the status :func:`~hpcml.ckpt.pipeline.finish` gathers
    (``p``: the writer's pending save)."""
    tensors = {c.name: c for chunks in p.per_rank for c in chunks}
    p.tmp.mkdir(parents=True, exist_ok=True)
    path = p.tmp / SINGLE_FILE
    with h5py.File(path, "w", driver="mpio", comm=p.comm, libver="latest") as f:
        for k, v in p.shard_attrs.items():
            f.attrs[k] = v
        for name in sorted(tensors):  # dataset creation is collective: same order everywhere
            c = tensors[name]
            dtype = fmt.numpy_dtype(c.dtype)
            chunk = storage_chunk(c.global_shape, h5py.h5t.py_create(dtype).get_size())
            f.create_dataset(name, shape=c.global_shape, dtype=dtype, dcpl=preallocated(chunk))
        for c in p.mine:
            f[c.name][tuple(slice(o, o + s) for o, s in zip(c.offset, c.shape))] = p.arrays[c.key]
    if p.rank != 0:
        return ("ok", 0, SINGLE_FILE, {})
    fsync_path(path)
    names = sorted(tensors)
    info = describe(path, names, p.mac(SINGLE_FILE))
    return ("ok", info["bytes"], SINGLE_FILE, {"meta_sha256": info["meta_sha256"],
                                               "tables": dict(zip(names, info["datasets"]))})
