"""torch.distributed.checkpoint (DCP) directories in torchtitan's layout, to and from hpcml
checkpoints -- without running a pickle from the directory read.

torchtitan's ``CheckpointManager`` saves one flat state dict: the model's state-dict keys at
the top level, its FQN-keyed optimizer state (``optimizer.state.<fqn>.<name>``,
``optimizer.param_groups.<fqn>.<key>``), ``lr_scheduler.last_epoch``, ``train_state.step``
and ``.ntokens_seen``, ``dataloader.*``. How a model's names and fused layouts differ is the
model's to say (a list of :class:`ParamMap`, e.g. :mod:`hpcml.interop.torchtitan`);
this module walks it. An export also stores ``hpcml.extra`` (the hpcml JSON state) and
``hpcml.tensors.*`` (per-rank RNG), which torchtitan ignores, so hpcml -> DCP -> hpcml is exact.

Reading: torch's ``FileSystemReader`` ``pickle.load``s ``.metadata``, and its load planner
``torch.load(weights_only=False)``s every non-tensor entry -- code from whoever wrote the
directory would run. :class:`DcpReader` reads the same files itself (:mod:`hpcml.ckpt.dcp_safe`).

Memory: both directions hold the whole state once (``dcp.save`` and :func:`hpcml.ckpt.save`
take a state dict) plus what is being read: a layer of the hpcml checkpoint, one DCP tensor.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcml import log
from hpcml.ckpt.dcp_safe import DcpReader
from hpcml.errors import CheckpointError

logger = log.get_logger(__name__)

GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
"""Optimizer hyper-parameters taken from a torchtitan DCP; implementation flags (foreach,
fused, capturable) stay the loading trainer's, so they cannot change its arithmetic."""


@dataclass(frozen=True)
class Rows:
    """Rows ``[ours, ours + count)`` of an hpcml tensor are rows ``[theirs, theirs + count)`` of tensor ``name``."""

    name: str
    ours: int
    theirs: int
    count: int


@dataclass(frozen=True)
class ParamMap:
    """One hpcml parameter as another framework holds it: in its model state dict
    (``model``) and in its optimizer state (``optim``). The two differ where a module splits
    on save a fused parameter its optimizer keeps whole. Any split, join or permutation of
    rows is a list of blocks; a block list may name a tensor twice over (tied weights)."""

    fqn: str
    shape: tuple[int, ...]
    model: tuple[Rows, ...]
    optim: tuple[Rows, ...]

    def __post_init__(self) -> None:
        for blocks in (self.model, self.optim):
            covered = sorted({(b.ours, b.count) for b in blocks})
            ends = [0] + [o + c for o, c in covered]
            if [o for o, _ in covered] != ends[:-1] or ends[-1] != self.shape[0]:
                raise ValueError(f"{self.fqn}: row blocks {covered} do not tile its {self.shape[0]} rows once")

    @classmethod
    def same(cls, fqn: str, shape: tuple[int, ...], name: str | None = None) -> ParamMap:
        """A parameter held whole under one name (``fqn`` unless renamed) by model and optimizer."""
        rows = (Rows(name or fqn, 0, 0, shape[0]),)
        return cls(fqn, tuple(shape), rows, rows)


@dataclass(frozen=True)
class Converted:
    """What a conversion wrote."""

    path: Path
    step: int
    tensors: int
    nbytes: int
    seconds: float


def their_shapes(maps: Sequence[ParamMap], optim: bool) -> dict[str, tuple[int, ...]]:
    """Shape of each tensor the maps name on the other side (its blocks must tile its rows)."""
    rows: dict[str, list[tuple[int, int]]] = {}
    tail: dict[str, tuple[int, ...]] = {}
    for m in maps:
        for b in m.optim if optim else m.model:
            rows.setdefault(b.name, []).append((b.theirs, b.count))
            tail[b.name] = m.shape[1:]
    out = {}
    for name, blocks in rows.items():
        blocks.sort()
        ends = [0] + [o + c for o, c in blocks]
        if [o for o, _ in blocks] != ends[:-1]:
            raise ValueError(f"{name}: row blocks {blocks} overlap or leave gaps")
        out[name] = (ends[-1], *tail[name])
    return out


def _scatter(t: torch.Tensor, blocks: Sequence[Rows], out: dict[str, torch.Tensor],
             shapes: dict[str, tuple[int, ...]], key: str = "{}") -> None:
    """Copy ``t``'s row blocks into the other side's tensors (``key`` formats their names);
    a 0-d tensor (an optimizer's ``step``) goes whole to each."""
    for b in blocks:
        k = key.format(b.name)
        if t.dim() == 0 or (b.ours == b.theirs == 0 and (b.count, *t.shape[1:]) == shapes[b.name] == tuple(t.shape)):
            out[k] = t  # whole: no copy (``t`` is a fresh read, no one writes to it)
            continue
        if k not in out:
            out[k] = t.new_empty(shapes[b.name])
        out[k][b.theirs:b.theirs + b.count] = t[b.ours:b.ours + b.count]


def _group_index(shape: Sequence[int], n_groups: int) -> int:
    """hpcml's AdamW groups (:func:`hpcml.train.loop.make_optimizer`): decayed matrices, then the rest."""
    return 0 if n_groups < 2 or len(shape) >= 2 else 1


def _json_value(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _count(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= 1 << 62


def _plain(v) -> bool:
    """A hyper-parameter value: a finite number, a bool, None, or a short list of numbers."""
    if isinstance(v, list):
        return len(v) <= 16 and all(_plain(x) and not isinstance(x, list) for x in v)
    return v is None or isinstance(v, bool) or isinstance(v, (int, float)) and math.isfinite(v)


def _loop_state(extra: dict, step: int, where, trained: bool) -> tuple[list[dict], int, int]:
    """(optimizer groups, scheduler epoch, tokens seen) of the trainer state in ``extra``, each
    checked before it is written into the DCP (one line naming the field otherwise).
    ``trained``: the checkpoint holds optimizer state, so the groups and the token count must be there."""
    groups = extra.get("param_groups")
    if groups is None and not trained:
        groups = []
    elif not isinstance(groups, list) or not groups or len(groups) > 1024 or not all(
            isinstance(g, dict) and all(isinstance(k, str) and _plain(v) for k, v in g.items())
            and isinstance(g.get("lr"), (int, float)) and not isinstance(g.get("lr"), bool) and _plain(g["lr"])
            for g in groups):
        raise CheckpointError(f"{where}: extra['param_groups'] is {repr(groups)[:80]}: expected 1 or more optimizer "
                              f"groups of numbers, each with an lr")
    sched = extra.get("scheduler", {})
    last = sched.get("last_epoch", step) if isinstance(sched, dict) else None
    if not _count(last):
        raise CheckpointError(f"{where}: extra['scheduler'] is {repr(sched)[:80]}: expected a scheduler state whose "
                              f"last_epoch is an integer >= 0")
    cfg, data = extra.get("train_config"), extra.get("data")
    if isinstance(cfg, dict) and _count(cfg.get("global_batch"), 1) and _count(cfg.get("seq_len"), 1):
        tokens = step * cfg["global_batch"] * cfg["seq_len"]
    elif isinstance(data, dict) and _count(data.get("ntokens_seen")):
        tokens = data["ntokens_seen"]
    elif not trained:
        tokens = 0
    else:
        raise CheckpointError(f"{where}: extra has no train_config with global_batch and seq_len >= 1 (nor "
                              f"data.ntokens_seen): the tokens seen, which torchtitan's train_state holds, are unknown")
    return groups, last, tokens


# -- hpcml -> DCP ------------------------------------------------------------------------------
def export_titan(src: str | Path, dst: str | Path, maps: Sequence[ParamMap]) -> Converted:
    """Write hpcml checkpoint ``src`` as a torchtitan-layout DCP directory ``dst`` (new or empty)."""
    import torch.distributed.checkpoint as dcp

    from hpcml.ckpt import read_tensors, tools
    from hpcml.ckpt.checked import Checkpoint

    t0 = time.perf_counter()
    info = tools.inspect(src)
    with Checkpoint(src) as ck:  # the whole step as saved, index.h5 included (as export and resume)
        ck.check_index()
    path, names, extra, step = info["path"], info["tensors"], info["extra"], int(info["step"])
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"{dst} exists and is not an empty directory: convert writes a new one")
    _check_export(path, names, maps)

    batch: dict[str, torch.Tensor] = {}

    def read(name: str) -> torch.Tensor:  # a layer at a time: one checked open per layer, one layer in memory
        if name not in batch:
            batch.clear()
            unit = _unit(name.split("/", 1)[1])
            for kind in ("model/", "optim/"):
                batch.update(read_tensors(path, kind + unit))
        return batch.pop(name)

    model_shapes, optim_shapes = their_shapes(maps, optim=False), their_shapes(maps, optim=True)
    groups, last_epoch, tokens = _loop_state(extra, step, path, trained=any(n.startswith("optim/") for n in names))
    model: dict[str, torch.Tensor] = {}
    optimizer: dict[str, Any] = {}
    for m in maps:
        _scatter(read(f"model/{m.fqn}"), m.model, model, model_shapes)
        for key in sorted(n for n in names if n.startswith(f"optim/{m.fqn}/")):
            _scatter(read(key), m.optim, optimizer, optim_shapes, f"state.{{}}.{key.rsplit('/', 1)[1]}")
        if groups:
            group = groups[_group_index(m.shape, len(groups))]
            optimizer.update({f"param_groups.{b.name}.{k}": _json_value(v) for b in m.optim for k, v in group.items()})
    others = read_tensors(path, "rank_state/") if any(n.startswith("rank_state/") for n in names) else {}
    others.update({n: read_tensors(path, n)[n] for n in names if not n.startswith(("model/", "optim/", "rank_state/"))})
    state = {**model, "optimizer": optimizer,
             "lr_scheduler": {"last_epoch": last_epoch},
             "train_state": {"step": step, "ntokens_seen": tokens},
             "hpcml": {"extra": json.dumps(extra), "tensors": others}}
    nbytes = sum(t.numel() * t.element_size() for d in (model, optimizer, others) for t in d.values()
                 if isinstance(t, torch.Tensor))
    dst.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process on purpose: torch warns that it assumes so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    n = len(model) + sum(isinstance(v, torch.Tensor) for v in optimizer.values()) + len(others)
    return Converted(dst, step, n, nbytes, time.perf_counter() - t0)


def _unit(fqn: str) -> str:
    """The name prefix read together: a layer's (``layers.3.``), else the parameter's own."""
    parts = fqn.split(".")
    return f"{parts[0]}.{parts[1]}." if parts[0] == "layers" and len(parts) > 2 else fqn


def _check_export(path: str, names: dict[str, dict], maps: Sequence[ParamMap]) -> None:
    want = {f"model/{m.fqn}": m for m in maps}
    have = {n for n in names if n.startswith("model/")}
    missing, unexpected = sorted(set(want) - have), sorted(have - set(want))
    orphans = sorted(n for n in names if n.startswith("optim/") and f"model/{n[6:].rsplit('/', 1)[0]}" not in want)
    if missing or unexpected or orphans:
        raise CheckpointError(f"{path} does not match the model map: missing {missing[:3]}, unexpected "
                              f"{(unexpected + orphans)[:3]} (is the model config the one that saved it?)")
    for name, m in want.items():
        if tuple(names[name]["shape"]) != m.shape:
            raise CheckpointError(f"{path}: {name} is {list(names[name]['shape'])}, the model config expects "
                                  f"{list(m.shape)}")


# -- DCP -> hpcml ------------------------------------------------------------------------------
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
        extra = json.loads(text) if isinstance(text, str) else None
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


__all__ = ["Converted", "DcpReader", "GROUP_KEYS", "ParamMap", "Rows", "carried_extra", "export_titan", "import_titan",
           "their_shapes"]
