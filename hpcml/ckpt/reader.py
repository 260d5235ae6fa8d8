"""Load: each rank reads exactly the chunks its own pieces cover, whatever layout saved
them, straight from the shards at the offsets the manifest records, each chunk checked as
it is read (:class:`hpcml.ckpt.checked.Checkpoint`). No collective, no pickle, and no
byte of the checkpoint parsed by HDF5 (``index.h5`` is for other tools)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpcml import log
from hpcml.ckpt import codec
from hpcml.ckpt.checked import Checkpoint
from hpcml.ckpt.format import resolve
from hpcml.ckpt.chunks import check_fused, fused_boxes, fused_spec
from hpcml.ckpt.state import fused_shards, local_piece
from hpcml.errors import CheckpointError, ConfigError

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


def read_tensor(source: Checkpoint | str | os.PathLike, name: str) -> torch.Tensor:
    """One whole global tensor (for tools: export, consolidate, conversion), every chunk checked."""
    if not isinstance(source, Checkpoint):
        with Checkpoint(source) as ck:
            return read_tensor(ck, name)
    data, _ = source.read(name)
    t = codec.from_numpy(data, source.tensors[name]["dtype"])
    return t.reshape(()) if source.tensors[name]["scalar"] else t


def read_tensors(path: str | os.PathLike, prefix: str, key=None) -> dict[str, torch.Tensor]:
    """Every whole tensor of checkpoint ``path`` whose name starts with ``prefix`` (state that is
    not a model's, e.g. a data source's, read by name without knowing the names up front)."""
    with Checkpoint(path, key) as ck:
        return {n: read_tensor(ck, n) for n in ck.names(prefix)}


def load(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *, strict: bool = True, comm=None,
         tensor_attrs: dict[str, dict] | None = None, key=None) -> LoadReport:
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
    ``key``: the keys a signature must match (default: ``$HPCML_CKPT_KEY`` /
    ``$HPCML_CKPT_KEY_FILE``; :class:`~hpcml.ckpt.checked.Checkpoint`).
    """
    why = _targets_problem(tensors)
    if comm is None:
        if why:
            raise CheckpointError(why)
        return _load(path, tensors, strict=strict, wanted=set(tensors), tensor_attrs=tensor_attrs, key=key)
    asked = comm.allgather((None, why) if why else (sorted(tensors), None))  # a wrong argument on one rank: on all
    if any(w for _, w in asked):
        raise CheckpointError(next(w for _, w in asked if w))
    wanted = set().union(*(names for names, _ in asked))
    report, error = None, None
    cause: BaseException | None = None
    try:
        report = _load(path, tensors, strict=strict, wanted=wanted, tensor_attrs=tensor_attrs, key=key)
    except (CheckpointError, ConfigError) as e:
        error = str(e)
    except Exception as e:  # anything else too: raised on every rank, never left to hang the others
        error, cause = f"rank {comm.Get_rank()}: {type(e).__name__}: {e}", e
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0]) from cause
    return report


def _targets_problem(tensors: object) -> str | None:
    """Why ``tensors`` cannot be filled (None: it can): a dict of names to tensors."""
    if not isinstance(tensors, dict):
        hint = " (model.state_dict(): its tensors are the model's own, so the load fills the model)" \
            if isinstance(tensors, torch.nn.Module) else ""
        return f"tensors is of type {type(tensors).__name__}: expected a dict of names to tensors to fill{hint}"
    bad = next((n for n, t in tensors.items() if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        return f"{bad!r} is of type {type(tensors[bad]).__name__}: expected a torch.Tensor or DTensor to fill in place"
    for n, t in tensors.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_meta:
            return (f"{n!r} is on the meta device: it has no memory to fill (a model built on meta: "
                    f"model.to_empty(device=...) first)")
        if any(st == 0 and sz > 1 for st, sz in zip(local.stride(), local.shape)):
            return (f"{n!r} of shape {tuple(local.shape)} has stride 0 along a dimension (an expand()ed view): its "
                    f"elements share memory and cannot each be filled; clone() it first")
    return None


def _fused_plan(name: str, t: torch.Tensor, attrs: dict, declared: dict | None,
                gshape: tuple[int, ...]) -> tuple[tuple[list[int], int, int] | None, str | None]:
    """((widths, dim, tp shards) or None for an ordinary tensor, why it cannot load or None)."""
    stored, want = fused_spec(attrs), fused_spec(declared)
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
          tensor_attrs: dict[str, dict] | None = None, key=None) -> LoadReport:
    with Checkpoint(path, key) as ck:
        ck.check_index()
        ckpt = ck.path
        report = LoadReport(ckpt, ck.step, extra=ck.extra, layout=ck.layout)
        stored = set(ck.tensors)
        report.missing = sorted(n for n in tensors if n not in stored)
        report.unexpected = sorted(n for n in stored if n not in wanted and not n.startswith("rank_state/")
                                   and n.split("/")[0] in {k.split("/")[0] for k in wanted})
        plan, misfused, mistyped = [], [], []
        for name, t in tensors.items():
            if name in report.missing:
                continue
            entry = ck.tensors[name]
            gshape = () if entry["scalar"] else tuple(entry["shape"])
            if gshape != tuple(t.shape):
                report.mismatched.append(f"{name}: checkpoint {list(gshape)}, model {list(t.shape)}")
                continue
            model_dtype = str(t.dtype).removeprefix("torch.")
            if _kind(entry["dtype"]) != _kind(model_dtype):  # float into int: truncated
                mistyped.append(f"{name}: checkpoint {entry['dtype']}, model {model_dtype}")
                continue
            fused, why = _fused_plan(name, t, entry["attrs"], (tensor_attrs or {}).get(name), gshape)
            if why:
                misfused.append(why)
                continue
            plan.append((name, t, entry, fused))
        problems = [f"missing {report.missing}" if report.missing else "",
                    f"unexpected {report.unexpected}" if report.unexpected else "",
                    f"mis-shaped {report.mismatched}" if report.mismatched else "",
                    f"fused layout does not fit {misfused}" if misfused else "",
                    f"of another kind (a float loads into any float, an integer into any integer) {mistyped}"
                    if mistyped else ""]
        report.mismatched += misfused + mistyped
        if strict and any(problems):
            raise CheckpointError(f"{ckpt} does not fit the model: " + "; ".join(p for p in problems if p))
        for name, t, entry, fused in plan:
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
            for dest, off in parts:
                view = codec.numpy_view(dest, entry["dtype"])  # read straight into the tensor where possible
                data, nread = ck.read(name, tuple(slice(o, o + s) for o, s in zip(off, dest.shape)),
                                      out=None if view is None else view.reshape(dest.shape or (1,)))
                if view is None:
                    dest.copy_(codec.from_numpy(data, entry["dtype"]).reshape(dest.shape).to(dest.device))
                report.bytes_needed += data.nbytes
                report.bytes_read += nread
    return report


def _kind(dtype_name: str) -> str:
    """float, int or bool: values cross between dtypes of a kind (as load_state_dict copies), never between kinds."""
    return "bool" if dtype_name == "bool" else "float" if "float" in dtype_name else "int"


def read_extra(path: str | os.PathLike, key=None) -> tuple[Path, int, dict]:
    """(checkpoint directory, step, JSON extra state) without touching any tensor."""
    with Checkpoint(path, key) as ck:
        return ck.path, ck.step, ck.extra


__all__ = ["LoadReport", "load", "read_extra", "read_tensor", "read_tensors", "resolve"]
