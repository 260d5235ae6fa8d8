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

The import direction (DCP -> hpcml) is :mod:`hpcml.ckpt.dcp_import`.

Memory: both directions hold the whole state once (``dcp.save`` and :func:`hpcml.ckpt.save`
take a state dict) plus what is being read: a layer of the hpcml checkpoint, one DCP tensor.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcml import log
from hpcml.ckpt.dcp_safe import DcpReader
from hpcml.errors import CheckpointError
from hpcml.numeric import is_int, is_real

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
    return is_int(v) and lo <= v <= 1 << 62


def _plain(v) -> bool:
    """A hyper-parameter value: a finite number, a bool, None, or a short list of numbers."""
    if isinstance(v, list):
        return len(v) <= 16 and all(_plain(x) and not isinstance(x, list) for x in v)
    return v is None or isinstance(v, bool) or is_real(v) and math.isfinite(v)


def _loop_state(extra: dict, step: int, where, trained: bool) -> tuple[list[dict], int, int]:
    """(optimizer groups, scheduler epoch, tokens seen) of the trainer state in ``extra``, each
    checked before it is written into the DCP (one line naming the field otherwise).
    ``trained``: the checkpoint holds optimizer state, so the groups and the token count must be there."""
    groups = extra.get("param_groups")
    if groups is None and not trained:
        groups = []
    elif not isinstance(groups, list) or not groups or len(groups) > 1024 or not all(
            isinstance(g, dict) and all(isinstance(k, str) and _plain(v) for k, v in g.items())
            and is_real(g.get("lr")) and _plain(g["lr"])
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


__all__ = ["Converted", "DcpReader", "GROUP_KEYS", "ParamMap", "Rows", "export_titan", "their_shapes"]
