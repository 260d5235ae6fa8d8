"""Load: each rank reads, through ``index.h5``'s virtual datasets, exactly the hyperslabs
its own pieces cover, whatever layout saved them. No collective, no pickle."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import torch

from hpcml import log
from hpcml.ckpt import codec, format as fmt
from hpcml.ckpt.format import resolve
from hpcml.ckpt.plan import check_fused, fused_boxes, fused_spec
from hpcml.ckpt.state import fused_shards, local_piece
from hpcml.errors import CheckpointError

logger = log.get_logger(__name__)


@dataclass
class LoadReport:
    path: Path
    step: int
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    bytes_needed: int = 0
    bytes_read: int = 0
    """HDF5 chunk bytes the reads touched (HDF5 reads whole storage chunks)."""
    extra: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def _open_index(ckpt: Path) -> h5py.File:
    try:
        f = h5py.File(ckpt / fmt.INDEX, "r")
    except OSError as e:
        raise CheckpointError(f"cannot open {ckpt / fmt.INDEX}: {e}") from None
    version = str(f.attrs.get("format_version", "?"))
    if version.split(".")[0] != fmt.FORMAT_VERSION.split(".")[0]:
        f.close()
        raise CheckpointError(f"{ckpt / fmt.INDEX} has format version {version}; this hpcml reads "
                              f"{fmt.FORMAT_VERSION.split('.')[0]}.x")
    for s in json.loads(f.attrs["shards"]):
        shard = ckpt / s["file"]
        size = shard.stat().st_size if shard.exists() else None
        if size != s["bytes"]:
            f.close()
            raise CheckpointError(f"shard {shard} is {'missing' if size is None else f'{size} bytes'}, "
                                  f"expected {s['bytes']} bytes: truncated or replaced")
    return f


def _touched_bytes(chunks: list[dict], offset: tuple[int, ...], shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of the HDF5 storage chunks a read of the box (offset, shape) touches."""
    total = 0
    for c in chunks:
        lo = [max(a, b) for a, b in zip(offset, c["offset"])]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offset, shape, c["offset"], c["shape"])]
        if any(h <= low for low, h in zip(lo, hi)):
            continue
        n = 1
        for low, h, o, sc, cs in zip(lo, hi, c["offset"], c["storage_chunk"], c["shape"]):
            first, last = (low - o) // sc, (h - 1 - o) // sc
            n *= min(cs, (last - first + 1) * sc)
        total += n * itemsize
    return total


def read_tensor(index: h5py.File, name: str) -> torch.Tensor:
    """One whole global tensor from an open index (for tools: export, consolidate, verify)."""
    ds = index[name]
    t = codec.from_numpy(ds[()], ds.attrs["dtype"])
    return t.reshape(()) if len(ds.attrs["global_shape"]) == 0 else t


def read_tensors(path: str | os.PathLike, prefix: str) -> dict[str, torch.Tensor]:
    """Every whole tensor of checkpoint ``path`` whose name starts with ``prefix`` (state that is
    not a model's, e.g. a data source's, read by name without knowing the names up front)."""
    out: dict[str, torch.Tensor] = {}
    with _open_index(resolve(path)) as index:
        names: list[str] = []
        index.visititems(lambda n, obj: names.append(n) if n.startswith(prefix) and isinstance(obj, h5py.Dataset)
                         else None)
        for n in names:
            out[n] = read_tensor(index, n)
    return out


def load(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *, strict: bool = True, comm=None,
         tensor_attrs: dict[str, dict] | None = None) -> LoadReport:
    """Fill ``tensors`` (name -> DTensor or tensor, any layout) in place from a checkpoint.

    ``strict``: raise naming every missing, unexpected or mis-shaped tensor; otherwise load
    what fits and return the report. Nothing is unpickled: tensors are HDF5 datasets,
    everything else JSON attributes. With ``comm`` (collective: two small allgathers) the
    names every rank asks for together decide what is unexpected -- a pipeline stage
    holds only some -- and an error on any rank is raised on all of them, so none hangs.

    Fused tensors (stored with ``fused_widths``) are read sub-parameter by sub-parameter
    into this rank's ``[wq_r; wk_r; wv_r]`` when the target is tensor-parallel on the fused
    dim, and whole into a plain tensor. ``tensor_attrs`` (the mapping given to
    :func:`~hpcml.ckpt.save`) is what the model expects: a ``fused_widths``/``fused_dim``
    there that differs from the checkpoint's (or that the checkpoint lacks) is a mismatch.
    """
    if comm is None:
        return _load(path, tensors, strict=strict, wanted=set(tensors), tensor_attrs=tensor_attrs)
    wanted = set().union(*comm.allgather(sorted(tensors)))
    report, error = None, None
    try:
        report = _load(path, tensors, strict=strict, wanted=wanted, tensor_attrs=tensor_attrs)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    return report


def _fused_plan(name: str, t: torch.Tensor, ds: h5py.Dataset, declared: dict | None,
                gshape: tuple[int, ...]) -> tuple[tuple[list[int], int, int] | None, str | None]:
    """((widths, dim, tp shards) or None for an ordinary tensor, why it cannot load or None)."""
    stored, want = fused_spec(ds.attrs), fused_spec(declared)
    if want is not None and (stored is None or stored != want):
        have = f"fused_widths {stored[0]} on dim {stored[1]}" if stored else "no fused_widths"
        return None, f"{name}: checkpoint {have}, model fused_widths {want[0]} on dim {want[1]}"
    if stored is None:
        return None, None
    widths, dim = stored
    n = fused_shards(t, dim) if isinstance(dim, int) and 0 <= dim < len(gshape) else 1
    why = check_fused(name, widths, dim, gshape, n)
    return (widths, dim, n), why


@torch.no_grad()
def _load(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *, strict: bool, wanted: set[str],
          tensor_attrs: dict[str, dict] | None = None) -> LoadReport:
    ckpt = resolve(path)
    with _open_index(ckpt) as index:
        report = LoadReport(ckpt, int(index.attrs["step"]), extra=json.loads(index.attrs["extra"]),
                            layout=json.loads(index.attrs["layout"]))
        stored = set()
        index.visititems(lambda n, o: stored.add(n) if isinstance(o, h5py.Dataset) else None)
        report.missing = sorted(n for n in tensors if n not in stored)
        report.unexpected = sorted(n for n in stored if n not in wanted and not n.startswith("rank_state/")
                                   and n.split("/")[0] in {k.split("/")[0] for k in wanted})
        plan, misfused = [], []
        for name, t in tensors.items():
            if name in report.missing:
                continue
            ds = index[name]
            gshape = tuple(int(x) for x in ds.attrs["global_shape"])
            if gshape != tuple(t.shape):
                report.mismatched.append(f"{name}: checkpoint {list(gshape)}, model {list(t.shape)}")
                continue
            fused, why = _fused_plan(name, t, ds, (tensor_attrs or {}).get(name), gshape)
            if why:
                misfused.append(why)
                continue
            plan.append((name, t, ds, fused))
        problems = [f"missing {report.missing}" if report.missing else "",
                    f"unexpected {report.unexpected}" if report.unexpected else "",
                    f"mis-shaped {report.mismatched}" if report.mismatched else "",
                    f"fused layout does not fit {misfused}" if misfused else ""]
        report.mismatched += misfused
        if strict and any(problems):
            raise CheckpointError(f"{ckpt} does not fit the model: " + "; ".join(p for p in problems if p))
        for name, t, ds, fused in plan:
            local, _, offset = local_piece(t)
            if local.numel() == 0:
                continue
            if not local.dim():
                offset, parts = (0,), [(local.reshape(1), (0,))]
            elif fused is None:
                parts = [(local, offset)]
            else:  # each sub-parameter's rows for this rank: logical offsets, as the writer stored them
                widths, dim, n = fused
                parts = [(local.narrow(dim, lo, shp[dim]), off)
                         for lo, off, shp in fused_boxes(widths, dim, n, offset, tuple(local.shape))]
            chunks = json.loads(ds.attrs["chunks"])
            for dest, off in parts:
                box = tuple(slice(o, o + s) for o, s in zip(off, dest.shape))
                try:
                    data = ds[box]
                except OSError as e:  # fletcher32 mismatch or unreadable source
                    files = sorted({c["file"] for c in chunks})
                    raise CheckpointError(f"reading {name} from {ckpt} ({', '.join(files)}) failed: {e}") from None
                value = codec.from_numpy(data, ds.attrs["dtype"]).reshape(dest.shape)
                dest.copy_(value.to(dest.device))
                report.bytes_needed += data.nbytes
                report.bytes_read += _touched_bytes(chunks, off, tuple(dest.shape), data.itemsize)
    return report


def read_extra(path: str | os.PathLike) -> tuple[Path, int, dict]:
    """(checkpoint directory, step, JSON extra state) without touching any tensor."""
    ckpt = resolve(path)
    with h5py.File(ckpt / fmt.INDEX, "r") as index:
        return ckpt, int(index.attrs["step"]), json.loads(index.attrs["extra"])


__all__ = ["LoadReport", "load", "read_extra", "read_tensor", "read_tensors", "resolve"]
