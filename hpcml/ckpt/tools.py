"""Checkpoint tools behind ``hpcml ckpt``: list, inspect, verify, export, consolidate.
All single-process, read-only on the checkpoint, no pickle read, every read checked
(:class:`~hpcml.ckpt.checked.Checkpoint`). Only export imports torch (it takes 2-3 s):
listing, inspecting, verifying and consolidating need numpy (and h5py to write) alone.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import h5py

from hpcml import safeio
from hpcml.ckpt import chunkmac, format as fmt, keys, manifest, rollback
from hpcml.ckpt.checked import Checkpoint
from hpcml.ckpt.chunks import check_fused, fused_spec
from hpcml.ckpt.shard import fsync_path, read_chunks
from hpcml.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def list_checkpoints(root: str | os.PathLike) -> list[dict]:
    """Every ``step_N`` under ``root`` with its size and whether ``latest`` names it, then
    those of a population's members (``member_K``: each its own ``latest``)."""
    root = Path(root)
    if not root.is_dir():
        why = "it is a file" if root.exists() else "the path does not exist"
        raise CheckpointError(f"no checkpoint directory at {root}: {why}; expected the run directory that holds "
                              f"its step_N checkpoints")
    return _steps_listed(root) + [row for m in fmt.member_roots(root) for row in _steps_listed(m)]


def _steps_listed(root: Path) -> list[dict]:
    try:
        latest = (safeio.read_text(root / fmt.LATEST, 4096, "a step name") or "").strip() or None
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    out = []
    for p in sorted(root.iterdir()):
        m = fmt.STEP_RE.match(p.name)
        if m and p.is_dir():
            size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
            out.append({"step": int(m[1]), "path": str(p), "bytes": size, "latest": p.name == latest,
                        "complete": (p / fmt.MANIFEST).is_file()})
    return out


def inspect(path: str | os.PathLike) -> dict:
    """Attributes of the checkpoint and, per tensor, shape, dtype, bytes, partition and
    pieces: from the checked manifest alone (no data read)."""
    with Checkpoint(path) as ck:
        m, tensors = ck.manifest, {}
        for name in ck.names():
            t = ck.tensors[name]
            shape = [] if t["scalar"] else list(t["shape"])
            tensors[name] = {"shape": shape, "dtype": t["dtype"], "pieces": len(t["pieces"]),
                             "bytes": math.prod(t["shape"]) * ck.dtype(name).itemsize, "partition": t["partition"]}
            if "logical_shape" in t["attrs"]:
                tensors[name]["logical_shape"] = list(t["attrs"]["logical_shape"])
            spec = fused_spec(t["attrs"])
            if spec is not None:
                tensors[name]["fused_widths"], tensors[name]["fused_dim"] = spec
            if isinstance(t["attrs"].get("experts"), int):  # a MoE layer's stacked experts, expert index first
                tensors[name]["experts"] = t["attrs"]["experts"]
        shards = [{"file": f, "bytes": v["bytes"]} for f, v in sorted(m["files"].items()) if f != fmt.INDEX]
        return {"path": str(ck.path), "step": ck.step, "format_version": m["format_version"],
                "hpcml_version": str(m.get("hpcml_version", "?")), "world_size": m["world_size"],
                "save_id": m["save_id"], "layout": ck.layout, "shards": shards, "extra": ck.extra,
                "tensors": tensors, "total_bytes": sum(t["bytes"] for t in tensors.values())}


def verify(path: str | os.PathLike, key=None) -> list[str]:
    """Problems found (empty: sound); ``key`` as :class:`Checkpoint`'s (default: the configured
    one). The manifest is checked field by field (each tensor covered exactly once by its
    pieces, a fused tensor's widths summing to its size), then every byte of every file,
    streamed in bounded memory: each shard's data chunks against their CRC-32 and its metadata
    against its SHA-256, ``index.h5`` against its SHA-256. A manifest that fails its checks is
    one problem (nothing else can be trusted then)."""
    try:
        ck = Checkpoint(path, key)
    except CheckpointError as e:
        return [str(e)]
    with ck:
        problems = []
        for name, t in ck.tensors.items():
            spec = fused_spec(t["attrs"])
            if spec is not None and (why := check_fused(name, spec[0], spec[1], tuple(t["shape"]), 1)):
                problems.append(why)
        return problems + ck.verify()


def signature_note(path: str | os.PathLike) -> str:
    """How the checkpoint at ``path`` is signed, and whether that was checked, in a few words."""
    with Checkpoint(path) as ck:
        if ck.signed_by is None:
            return "unsigned"
        return f"signed by key {ck.signed_by}, " + ("checked" if ck.keys is not None else
                                                     f"not checked: no key configured (${keys.ENV_KEY})")


def sign(path: str | os.PathLike) -> str:
    """Sign checkpoint ``path`` with the configured key (the first of the keyring) once every
    byte of it verifies; returns the key id. The manifest is replaced atomically (write, fsync,
    rename). Signing says "I trust this content": use it on checkpoints you made, e.g. to sign
    those saved before a key was set, or to re-sign with a new key when rotating. Every data
    chunk gets a keyed digest under the key and a new salt (:mod:`hpcml.ckpt.chunkmac`)."""
    ring = keys.keyring(True)
    problems = verify(path, key=False)
    if problems:
        raise CheckpointError(f"not signing {path}: it does not verify ({problems[0]})")
    with Checkpoint(path, key=False) as ck:
        step_dir, m = ck.path, _tagged(ck, ring.keys[0])
    state = rollback.read(step_dir.parent, ring)
    m["root"] = rollback.root_id(state)  # signing adopts it into this directory
    try:  # a signature and the chunks' digests add bytes: never past what a reader takes
        data = manifest.readable(step_dir, m, ring)
    except CheckpointError as e:
        raise CheckpointError(f"not signing {path}: {e}; it stays as it was") from None
    safeio.replace(step_dir / fmt.MANIFEST, data, fsync=True)  # whole, or the old one
    fsync_path(step_dir)
    rollback.record(step_dir.parent, m, ring, state)
    return keys.key_id(ring.keys[0])


def _tagged(ck: Checkpoint, key: bytes) -> dict:
    """A copy of ``ck``'s manifest whose data chunks carry keyed digests under ``key`` and a new
    salt: each chunk read once more, and checked against its CRC-32 as it is tagged."""
    salt = uuid.uuid4().hex
    tensors = {}
    for name, t in ck.tensors.items():
        pieces = []
        for p in t["pieces"]:
            mac, tags = chunkmac.for_file(key, salt, p["file"]), [b""] * len(p["at"])
            for i, data in read_chunks(ck._open(p["file"]), p, ck.dtype(name).itemsize, list(range(len(tags))),
                                       f"{ck.path / p['file']} {p['dataset']}"):
                tags[i] = mac.tag(p["at"][i], data)
            pieces.append({**p, "mac": b"".join(tags).hex()})
        tensors[name] = {**t, "pieces": pieces}
    return {**ck.manifest, "tensors": tensors, "data_mac": chunkmac.header(salt)}


def model_weights(source: Checkpoint | str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's tensors under their unparallelised names, vocabulary padding stripped
    (``source``: a path, or a Checkpoint already open)."""
    from hpcml.ckpt.reader import read_tensor

    if not isinstance(source, Checkpoint):
        with Checkpoint(source) as ck:
            return model_weights(ck)
    source.check_index()
    out = {}
    for name in source.names("model/"):
        t = read_tensor(source, name)
        logical = source.tensors[name]["attrs"].get("logical_shape")
        if logical is not None:
            t = t[tuple(slice(0, int(n)) for n in logical)].contiguous()
        out[name[len("model/"):]] = t
    return out


def out_file(out: str | os.PathLike) -> Path:
    """``out`` can be written as a file: not a directory, in a directory that exists -- said
    in one line before any weight is read (the writers' own errors are tracebacks)."""
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"output {out} is a directory: expected a file path, e.g. {out}/<name>")
    if not out.parent.is_dir():
        if out.parent.exists():
            raise ConfigError(f"output {out}: {out.parent} is a file, expected a directory")
        raise ConfigError(f"output {out}: directory {out.parent} does not exist (create it first)")
    return out


def out_dir(out: str | os.PathLike) -> Path:
    """``out`` can be made a directory: no file at it or on the way to it (``mkdir`` would
    say only "Not a directory")."""
    out = Path(out)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"output directory {out}: {p} is a file, expected a directory or a new path")
            return out
    return out


def export(path: str | os.PathLike, out: str | os.PathLike, fmt_name: str = "safetensors") -> int:
    """Consolidated model weights for inference: ``safetensors`` or ``torch`` (torch.save);
    ``hf`` (a Hugging Face directory) is :func:`hpcml.interop.export`'s. Returns bytes."""
    if fmt_name not in ("safetensors", "torch"):  # before reading every weight
        raise ConfigError(f"export format {fmt_name!r} unknown: expected safetensors or torch"
                          + (" (hf: hpcml.interop.export, or hpcml ckpt export --format hf)"
                             if fmt_name == "hf" else ""))
    out_file(out)
    with Checkpoint(path) as ck:
        weights, source, model = model_weights(ck), ck.path, ck.extra.get("model")
    if fmt_name == "safetensors":
        from safetensors.torch import save_file

        meta = {"source": str(source), "format": "hpcml"}
        if isinstance(model, dict):  # the model's config travels with its weights (extra["model"])
            meta["hpcml_model"] = fmt.dumps(model)
        save_file(weights, str(out), metadata=meta)
    else:
        import torch

        torch.save(weights, str(out))
    return Path(out).stat().st_size


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> int:
    """One self-contained HDF5 file: every tensor as a real dataset (read checked), attributes kept."""
    out_file(out)
    tmp = Path(str(out) + ".tmp")
    try:
        _consolidate(path, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a refused or cut consolidation leaves no half-written file
        raise
    tmp.rename(out)
    return Path(out).stat().st_size


def _consolidate(path: str | os.PathLike, tmp: Path) -> None:
    import numpy as np

    with Checkpoint(path) as ck, h5py.File(tmp, "w") as g:
        ck.check_index()
        m = ck.manifest
        for k in ("format_version", "hpcml_version", "save_id", "step", "world_size"):
            g.attrs[k] = m[k]
        g.attrs["layout"], g.attrs["extra"] = fmt.dumps(ck.layout), fmt.dumps(ck.extra)
        g.attrs["consolidated_from"] = str(ck.path)
        for name in ck.names():
            t = ck.tensors[name]
            data, _ = ck.read(name)
            ds = g.create_dataset(name, data=data, chunks=True if data.ndim else None, fletcher32=bool(data.ndim))
            ds.attrs["dtype"] = t["dtype"]
            ds.attrs["global_shape"] = np.asarray([] if t["scalar"] else t["shape"], dtype=np.int64)
            ds.attrs["partition"] = t["partition"]
            for k, v in t["attrs"].items():
                ds.attrs[k] = v


__all__ = ["consolidate", "export", "inspect", "list_checkpoints", "model_weights", "sign", "signature_note", "verify"]
