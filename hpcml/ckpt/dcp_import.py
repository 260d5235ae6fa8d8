"""DCP directories in torchtitan's layout into hpcml checkpoints (:mod:`hpcml.ckpt.dcp` has
the layout, the export and why nothing is unpickled): each hpcml tensor built from the
entries it is made of, read once, and the loop state (step, schedule, optimizer groups,
tokens seen) carried over."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcml import log, safeio
from hpcml.ckpt.dcp import GROUP_KEYS, Converted, ParamMap, Rows, their_shapes
from hpcml.ckpt.dcp_safe import DcpReader
from hpcml.errors import CheckpointError

logger = log.get_logger(__name__)


@dataclass(frozen=True)
class _Want:
    """One hpcml tensor to build: its name and shape (``()``: an optimizer's ``step``), the
    blocks it is made of and the entry names they come from (``key`` formats each block's name)."""

    ours: str
    shape: tuple[int, ...]
    blocks: tuple[Rows, ...]
    key: str
    their_shapes: dict[str, tuple[int, ...]]


def _gather(reader: DcpReader, wants: list[_Want]) -> dict[str, torch.Tensor]:
    """Build each wanted tensor, reading each entry once and keeping it only while a later
    tensor still needs rows of it (a fused optimizer tensor feeds three hpcml ones)."""
    uses = Counter(w.key.format(b.name) for w in wants for b in w.blocks)
    cache: dict[str, torch.Tensor] = {}
    out = {}
    for w in wants:
        t = None
        for b in w.blocks:
            key = w.key.format(b.name)
            if key not in cache:
                reader.check_shape(key, () if not w.shape else w.their_shapes[b.name], w.ours)
                cache[key] = reader.tensor(key)
            uses[key] -= 1
            src = cache[key] if uses[key] else cache.pop(key)
            if not w.shape:  # a step: every part holds the same one
                t = src if t is None else t
                continue
            rows = src[b.theirs:b.theirs + b.count]
            if t is None and b.ours == b.theirs == 0 and b.count == w.shape[0] and tuple(src.shape) == w.shape:
                t, done = src, {(b.ours, b.count)}  # whole: no copy (nothing writes to a read tensor)
                continue
            if t is None:
                t, done = src.new_empty(w.shape), set()
            if (b.ours, b.count) in done:  # a tied weight's second name: the same rows, or not tied
                if not torch.equal(t[b.ours:b.ours + b.count], rows):
                    raise CheckpointError(f"{reader.path}: {key!r} differs from the other entry of hpcml {w.ours} "
                                          f"(a tied weight): is the model config the one that saved it?")
                continue
            t[b.ours:b.ours + b.count] = rows
            done.add((b.ours, b.count))
        out[w.ours] = t
    return out


def import_titan(src: str | Path | DcpReader, root: str | Path, maps: Sequence[ParamMap], *,
                 tensor_attrs: dict[str, dict] | None = None, schedule_steps: int | None = None,
                 extra: dict | None = None) -> Converted:
    """Write torchtitan-layout DCP directory ``src`` as hpcml checkpoint ``root/step_N``.

    The JSON state comes from ``hpcml.extra`` when an hpcml export wrote it (same step), else
    from torchtitan's entries: step, lr_scheduler, the hyper-parameters of each hpcml AdamW
    group (from its first parameter). The learning-rate schedule then goes on from
    torchtitan's rate at that step (hpcml's stretch rule) unless ``schedule_steps`` says it
    is hpcml's own warmup + cosine of that many steps, which then continues bitwise. ``extra``
    is merged over the JSON state (e.g. the model's config, for the layout written).
    """
    from mpi4py import MPI

    from hpcml import ckpt
    from hpcml.grid.layout import Layout

    t0 = time.perf_counter()
    reader = src if isinstance(src, DcpReader) else DcpReader(src)
    step = _int(reader, "train_state.step")
    _check_import(reader, maps)
    model_shapes, optim_shapes = their_shapes(maps, optim=False), their_shapes(maps, optim=True)
    wants = [_Want(f"model/{m.fqn}", m.shape, m.model, "{}", model_shapes) for m in maps]
    for m in maps:
        first = m.optim[0].name
        states = reader.children(f"optimizer.state.{first}.")
        if not states:
            why = ("is the model config the one that saved it?" if reader.children("optimizer.state.") else
                   "a model-only checkpoint cannot resume training")
            raise CheckpointError(f"{reader.path}: no optimizer state for {first!r} (hpcml model/{m.fqn}): {why}")
        for s in states:
            scalar = reader.shape(f"optimizer.state.{first}.{s}") == ()
            wants.append(_Want(f"optim/{m.fqn}/{s}", () if scalar else m.shape, m.optim, f"optimizer.state.{{}}.{s}",
                               optim_shapes))
    tensors = _gather(reader, wants)
    for key in reader.children("hpcml.tensors."):
        tensors[key] = reader.tensor(f"hpcml.tensors.{key}")
    extra = {**_import_extra(reader, maps, step, schedule_steps), **(extra or {})}
    result = ckpt.save(root, step, tensors, comm=MPI.COMM_SELF, extra=extra, layout=Layout.from_degrees(1, {}).degrees,
                       tensor_attrs=tensor_attrs)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Converted(result.path, step, len(tensors), nbytes, time.perf_counter() - t0)


def _check_import(reader: DcpReader, maps: Sequence[ParamMap]) -> None:
    """Every model and optimizer entry is one the maps use: a DCP of another model is refused, not half read."""
    model = {b.name for m in maps for b in m.model}
    optim = {b.name for m in maps for b in m.optim}
    stray = []
    for key in reader.entries:
        head, _, rest = key.partition(".")
        if head == "optimizer":
            kind, _, name = rest.partition(".")
            stray += [key] if kind not in ("state", "param_groups") or name.rsplit(".", 1)[0] not in optim else []
        elif head not in ("lr_scheduler", "train_state", "dataloader", "hpcml") and key not in model:
            stray.append(key)
    if stray:
        raise CheckpointError(f"{reader.path} holds {len(stray)} entries the model does not, e.g. {stray[:3]}: is the "
                              f"model config the one that saved it?")


def _int(reader: DcpReader, key: str) -> int:
    v = reader.value(key)
    if type(v) is not int:
        raise CheckpointError(f"{reader.path}: {key} is {v!r}, not an integer")
    return v


def carried_extra(reader: DcpReader) -> dict:
    """The hpcml JSON state an hpcml export stored (``hpcml.extra``); {} in a DCP torchtitan wrote."""
    if not reader.has("hpcml.extra"):
        return {}
    text = reader.value("hpcml.extra")
    try:
        extra = safeio.parse_json(text, "hpcml.extra", constants=True) if isinstance(text, str) else None
    except ValueError as e:
        raise CheckpointError(f"{reader.path}: hpcml.extra is not JSON ({e})") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{reader.path}: hpcml.extra holds a {type(extra).__name__}, not a JSON object")
    return extra


def _import_extra(reader: DcpReader, maps: Sequence[ParamMap], step: int, schedule_steps: int | None) -> dict:
    saved = carried_extra(reader)
    if saved.get("step") == step:
        return saved
    if saved:
        logger.warning("%s: hpcml.extra is of another step than train_state.step %d: ignored", reader.path, step)
    groups = []
    for pick in (lambda s: len(s) >= 2, lambda s: len(s) < 2):
        firsts = [m.optim[0].name for m in maps if pick(m.shape)]
        group = _group(reader, firsts[0])
        for other in firsts[1:]:
            theirs = _group(reader, other, ("lr", "weight_decay"))
            if any(theirs[k] != group[k] for k in theirs):
                logger.warning("%s: %s has %s, unlike %s %s of the same hpcml AdamW group: the first is taken",
                               reader.path, other, theirs, firsts[0], {k: group[k] for k in theirs})
                break
        groups.append(group)
    last_epoch = _int(reader, "lr_scheduler.last_epoch") if reader.has("lr_scheduler.last_epoch") else step
    base = [g["initial_lr"] for g in groups]
    scheduler = {"base_lrs": base, "last_epoch": last_epoch, "_step_count": last_epoch + 1, "_is_initial": False,
                 "_get_lr_called_within_step": False, "_last_lr": [g["lr"] for g in groups],
                 "lr_lambdas": [None] * len(groups)}
    if schedule_steps is not None:
        schedule = {"steps": int(schedule_steps), "anchor": None}
    else:  # the cosine goes on from torchtitan's rate at this step (hpcml.train.schedule)
        schedule = {"steps": step, "anchor": [step, groups[0]["lr"] / base[0] if base[0] else 1.0]}
    return {"step": step, "scheduler": scheduler, "schedule": schedule, "param_groups": groups,
            "data": {"next_step": step, "ntokens_seen": _ntokens(reader)},
            "source": {"format": "torch.distributed.checkpoint", "path": str(reader.path)}}


def _ntokens(reader: DcpReader) -> int:
    return _int(reader, "train_state.ntokens_seen") if reader.has("train_state.ntokens_seen") else 0


def _group(reader: DcpReader, fqn: str, keys: Sequence[str] = GROUP_KEYS) -> dict[str, Any]:
    out = {k: reader.value(f"optimizer.param_groups.{fqn}.{k}") for k in keys
           if reader.has(f"optimizer.param_groups.{fqn}.{k}")}
    if "lr" not in out and "lr" in keys:
        raise CheckpointError(f"{reader.path}: no optimizer.param_groups.{fqn}.lr (torchtitan's flat optimizer state)")
    if "initial_lr" in keys:
        out.setdefault("initial_lr", out["lr"])
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


__all__ = ["carried_extra", "import_titan"]
