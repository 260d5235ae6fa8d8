"""Checkpoint tools behind ``hpcml ckpt``: list, inspect, verify, export, consolidate.
All single-process, read-only on the checkpoint, no pickle read. Only export imports torch
(it takes 2-3 s): listing, inspecting, verifying and consolidating read with h5py alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import h5py

from hpcml.ckpt import format as fmt
from hpcml.ckpt.format import resolve
from hpcml.ckpt.plan import check_coverage, check_fused, fused_spec
from hpcml.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return sorted(names)


def _open(path: str | os.PathLike) -> tuple[Path, h5py.File]:
    ckpt = resolve(path)
    try:
        return ckpt, h5py.File(ckpt / fmt.INDEX, "r")
    except OSError as e:
        raise CheckpointError(f"cannot open {ckpt / fmt.INDEX}: {e}") from None


def list_checkpoints(root: str | os.PathLike) -> list[dict]:
    """Every ``step_N`` under ``root`` with its size and whether ``latest`` names it."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint directory at {root}")
    latest = (root / fmt.LATEST).read_text().strip() if (root / fmt.LATEST).is_file() else None
    out = []
    for p in sorted(root.iterdir()):
        m = fmt.STEP_RE.match(p.name)
        if m and p.is_dir():
            size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
            out.append({"step": int(m[1]), "path": str(p), "bytes": size, "latest": p.name == latest,
                        "complete": (p / fmt.INDEX).is_file()})
    return out


def inspect(path: str | os.PathLike) -> dict:
    """Attributes of the checkpoint and, per tensor, shape, dtype, bytes, partition and pieces."""
    ckpt, f = _open(path)
    with f:
        tensors = {}
        for name in _datasets(f):
            ds = f[name]
            chunks = json.loads(ds.attrs["chunks"])
            shape = [int(x) for x in ds.attrs["global_shape"]]
            tensors[name] = {"shape": shape, "dtype": str(ds.attrs["dtype"]), "bytes": int(ds.size * ds.dtype.itemsize),
                             "pieces": len(chunks), "partition": str(ds.attrs["partition"])}
            if "logical_shape" in ds.attrs:
                tensors[name]["logical_shape"] = [int(x) for x in ds.attrs["logical_shape"]]
            spec = fused_spec(ds.attrs)
            if spec is not None:
                tensors[name]["fused_widths"], tensors[name]["fused_dim"] = spec
        return {"path": str(ckpt), "step": int(f.attrs["step"]), "format_version": str(f.attrs["format_version"]),
                "hpcml_version": str(f.attrs["hpcml_version"]), "world_size": int(f.attrs["world_size"]),
                "layout": json.loads(f.attrs["layout"]), "shards": json.loads(f.attrs["shards"]),
                "extra": json.loads(f.attrs["extra"]), "tensors": tensors,
                "total_bytes": sum(t["bytes"] for t in tensors.values())}


def verify(path: str | os.PathLike) -> list[str]:
    """Problems found (empty: sound): shard sizes, each tensor's elements covered exactly
    once by its pieces, a fused tensor's widths summing to its size, and every element read
    back through its Fletcher-32 checksum."""
    ckpt, f = _open(path)
    problems = []
    with f:
        for s in json.loads(f.attrs["shards"]):
            shard = ckpt / s["file"]
            if not shard.is_file():
                problems.append(f"{shard}: missing")
            elif shard.stat().st_size != s["bytes"]:
                problems.append(f"{shard}: {shard.stat().st_size} bytes, expected {s['bytes']}")
        for name in _datasets(f):
            ds = f[name]
            chunks = json.loads(ds.attrs["chunks"])
            why = check_coverage(tuple(ds.shape), [(tuple(c["offset"]), tuple(c["shape"])) for c in chunks])
            if why:
                problems.append(f"{name}: {why}")
            spec = fused_spec(ds.attrs)
            if spec is not None and (why := check_fused(name, spec[0], spec[1], tuple(ds.shape), 1)):
                problems.append(why)
            try:
                ds[()]
            except OSError as e:
                problems.append(f"{name} ({', '.join(sorted({c['file'] for c in chunks}))}): unreadable: {e}")
    return problems


def model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's tensors under their unparallelised names, vocabulary padding stripped."""
    from hpcml.ckpt.reader import read_tensor

    _, f = _open(path)
    with f:
        out = {}
        for name in _datasets(f):
            if not name.startswith("model/"):
                continue
            t = read_tensor(f, name)
            if "logical_shape" in f[name].attrs:
                t = t[tuple(slice(0, int(n)) for n in f[name].attrs["logical_shape"])].contiguous()
            out[name[len("model/"):]] = t
        return out


def export(path: str | os.PathLike, out: str | os.PathLike, fmt_name: str = "safetensors") -> int:
    """Consolidated model weights for inference: ``safetensors`` or ``torch`` (torch.save). Returns bytes."""
    if fmt_name not in ("safetensors", "torch"):  # before reading every weight
        raise ConfigError(f"export format {fmt_name!r} unknown: expected safetensors or torch")
    weights = model_weights(path)
    if fmt_name == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(out), metadata={"source": str(resolve(path)), "format": "hpcml"})
    else:
        import torch

        torch.save(weights, str(out))
    return Path(out).stat().st_size


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> int:
    """One self-contained HDF5 file: every tensor as a real dataset, attributes kept."""
    ckpt, f = _open(path)
    tmp = Path(str(out) + ".tmp")
    with f, h5py.File(tmp, "w") as g:
        for k, v in f.attrs.items():
            g.attrs[k] = v
        g.attrs["consolidated_from"] = str(ckpt)
        for name in _datasets(f):
            src = f[name]
            ds = g.create_dataset(name, data=src[()], chunks=True if src.ndim else None,
                                  fletcher32=bool(src.ndim))
            for k, v in src.attrs.items():
                ds.attrs[k] = v
    tmp.rename(out)
    return Path(out).stat().st_size


__all__ = ["consolidate", "export", "inspect", "list_checkpoints", "model_weights", "verify"]
