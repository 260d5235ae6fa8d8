"""The on-disk names and encodings of an hpcml checkpoint (spec: docs/checkpoint-format.md).

numpy only, no torch: listing and inspecting checkpoints (``hpcml ckpt ls``) and the async
writer process start fast. Tensor <-> array conversion is in :mod:`hpcml.ckpt.codec`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcml import safeio
from hpcml.errors import CheckpointError
from hpcml.numeric import is_int

FORMAT_VERSION = "2.0"
"""2.0: ``manifest.json`` binds every file to its save with digests (1.x had none and is not read)."""
INDEX = "index.h5"
MANIFEST = "manifest.json"
LATEST = "latest"
MAX_LATEST_BYTES = 256
STEP_RE = re.compile(r"^step_(\d{8,})$")
MEMBER_RE = re.compile(r"^member_(\d{1,6})$")  # a population member's own root, under the run's
OLD_SUFFIX = ".old"  # a step moved aside while a re-save of it commits (see hpcml.ckpt.index.commit)

#: name recorded in a tensor's 'dtype' attribute -> numpy dtype stored in HDF5
#: (bfloat16 as its 16-bit pattern, since numpy has no bfloat16)
STORED_DTYPES: dict[str, type] = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
                                  "bfloat16": np.uint16, "int64": np.int64, "int32": np.int32, "uint8": np.uint8,
                                  "bool": np.bool_}


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a tensor of a checkpoint (None: it can): a plain HDF5 path --
    printable, no spaces, no empty, ``.`` or ``..`` parts, no leading ``/``, at most 1,024
    characters. The save and the reader apply the same rule."""
    if not isinstance(name, str):
        return f"tensor name {name!r} ({type(name).__name__}): expected a str"
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")) or len(name) > 1024 \
            or not name.isprintable() or " " in name:
        return f"tensor name {name[:80]!r} is not a plain HDF5 path (printable, no spaces)"
    return None


def extra_problem(extra: object) -> str | None:
    """Why ``extra`` cannot be a checkpoint's non-tensor state (None: it can): a dict of JSON
    values -- no NaN or infinity (the reader refuses them), no tensors or other objects,
    nested at most 64 deep -- checked at the save, since a manifest the reader refuses would
    leave ``latest`` naming a checkpoint nobody can load."""
    if extra is None:
        return None
    if not isinstance(extra, dict):
        return f"extra is of type {type(extra).__name__}: expected a dict of JSON values"
    return _json_problem(extra, "extra", 0)


def _json_problem(v: object, where: str, depth: int) -> str | None:
    if depth > 64:
        return f"{where}: nested more than 64 deep"
    if v is None or isinstance(v, (str, bool, int)):
        return None
    if isinstance(v, float):
        return None if np.isfinite(v) else (f"{where} is {v}: JSON has no NaN or infinity (a reader refuses it); "
                                            f"store None or a string")
    if isinstance(v, (list, tuple)):
        return next((w for i, x in enumerate(v) if (w := _json_problem(x, f"{where}[{i}]", depth + 1))), None)
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                return f"{where}: key {k!r} is of type {type(k).__name__}: JSON keys are strings"
            if w := _json_problem(x, f"{where}[{k!r}]", depth + 1):
                return w
        return None
    hint = "; numpy's: convert with float() or int()" if isinstance(v, np.generic) else ""
    return (f"{where} is of type {type(v).__name__}: expected JSON values (numbers, strings, lists, dicts); "
            f"tensors go with the tensors{hint}")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"


def numpy_dtype(dtype_name: str) -> type:
    """The numpy dtype HDF5 stores for a recorded dtype name."""
    if dtype_name not in STORED_DTYPES:
        raise CheckpointError(f"unknown stored dtype {dtype_name!r}: expected one of {', '.join(STORED_DTYPES)}")
    return STORED_DTYPES[dtype_name]


def step_dirs(root: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) ``step_N`` directories of ``root``, oldest first: real directories
    only (a link is never one), complete when they hold a manifest."""
    root = Path(root)
    if not root.is_dir():
        return [], []
    steps = sorted(p for p in root.iterdir() if STEP_RE.match(p.name) and not p.is_symlink() and p.is_dir())
    complete = [p for p in steps if (p / MANIFEST).is_file()]
    return complete, [p for p in steps if p not in complete]


def member_roots(root: str | os.PathLike) -> list[Path]:
    """A population's member checkpoint roots under ``root`` (``member_K``, in K order; a link
    there is never followed), or [] for one trainer's."""
    try:
        found = [(int(m.group(1)), p) for p in Path(root).iterdir()
                 if (m := MEMBER_RE.match(p.name)) and not p.is_symlink() and p.is_dir()]
    except OSError:
        return []
    return [p for _, p in sorted(found)]


def steps_of(root: str | os.PathLike) -> list[int]:
    """The steps ``root`` holds complete, oldest first."""
    return [int(STEP_RE.match(p.name).group(1)) for p in step_dirs(root)[0]]


def common_step(views) -> int | None:
    """The newest step found in every one of ``views`` (each root's complete steps), or None."""
    views = [set(v) for v in views]
    common = views[0].intersection(*views[1:]) if views else set()
    return max(common) if common else None


@dataclass(frozen=True, kw_only=True)
class Keep:
    """What a save's rotation keeps of checkpoint roots saved in lock-step (a population's
    members, each its own root): its ``last`` newest steps, and the newest step every root of
    ``group`` holds complete -- what they resume from together. Without it, a member whose
    save finished would rotate out the step before while another's save of the same step was
    killed, and the roots would hold no step in common."""

    last: int
    group: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if not is_int(self.last) or self.last < 1:
            raise ValueError(f"Keep(last={self.last!r}): expected a whole number >= 1 of steps to keep")

    def spared(self) -> int | None:
        """The step no rotation may remove now (None: none)."""
        return common_step([steps_of(r) for r in self.group]) if self.group else None


def held(root: str | os.PathLike) -> str | None:
    """What ``root`` already holds of a run's saves, in words (its newest complete step, or a
    ``latest`` file), ``None`` for nothing: a run that does not resume must not save over it."""
    root = Path(root)
    complete, _ = step_dirs(root)
    if complete:
        newest = complete[-1].name
        return f"a checkpoint at step {int(STEP_RE.match(newest).group(1))} ({newest})"
    if os.path.lexists(root / LATEST):
        return f"a '{LATEST}' file"
    return None


def refuse_saves_over(root: str | os.PathLike, advice: str) -> None:
    """A run that starts afresh where an earlier run saved would write over its saves (``latest``
    pointed back at step 0's, the newest steps rotated out by ``keep``): refused on every rank,
    before anything collective, naming what is there and ``advice`` (how to resume instead)."""
    what = held(root)
    if what is not None:
        raise CheckpointError(f"{root} already holds {what} from an earlier run, and this run starts at step 0: "
                              f"its saves would replace that one; {advice}")


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory: ``path`` itself if it holds ``manifest.json``, else the step
    that ``path/latest`` names -- a plain ``step_N`` name of a real directory beside it,
    never a path or a symlink leading elsewhere."""
    p = Path(path)
    if os.path.lexists(p / MANIFEST):  # whatever it is: reading it says what is wrong (a FIFO, a link)
        return p
    latest = p / LATEST
    if latest.is_symlink() or latest.exists():
        name = _read_latest(latest)
        if not STEP_RE.match(name):
            raise CheckpointError(f"{latest} names {name[:60]!r}: expected a step name like step_00000100")
        target = p / name
        old = p / (name + OLD_SUFFIX)
        if not target.exists() and not target.is_symlink() and old.is_dir() and not old.is_symlink() \
                and (old / MANIFEST).is_file():
            return old  # a re-save killed between its two renames: the copy `latest` named, moved aside
        if target.is_symlink() or not target.is_dir():
            raise CheckpointError(f"{latest} names {name}, which is "
                                  f"{'a symlink' if target.is_symlink() else 'missing'}: "
                                  "a step is a directory beside it")
        if os.path.lexists(target / MANIFEST):
            return target
        raise CheckpointError(f"{latest} names {name}, which has no {MANIFEST}: an incomplete checkpoint")
    if (p / INDEX).is_file():
        raise CheckpointError(f"{p} has {INDEX} but no {MANIFEST}: a lone index (its shards' values cannot be "
                              f"checked), or a checkpoint of format 1.x, which this hpcml does not read")
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist")
    if not p.is_dir():  # e.g. a plain HDF5 file (once a KeyError), or a shard of a checkpoint
        raise CheckpointError(f"no checkpoint at {p}: it is a file; expected a checkpoint directory (a step_N "
                              f"with {MANIFEST}, or the run directory with '{LATEST}')")
    members = member_roots(p)
    if members:  # a population's run, before (or without) its best member's export
        raise CheckpointError(f"no checkpoint at {p}: it holds a population's members, each with checkpoints of its "
                              f"own: name one ({members[0]}, ...; hpcml ckpt ls {p} lists them)")
    raise CheckpointError(f"no checkpoint at {p}: expected {MANIFEST} or a '{LATEST}' file")


def _read_latest(latest: Path) -> str:
    """The step name in ``latest``: a regular file (opened non-blocking: a FIFO planted there
    is refused, not waited on) of at most :data:`MAX_LATEST_BYTES`."""
    raw = safeio.read_bytes(latest, MAX_LATEST_BYTES, "a step name", error=CheckpointError, required=True)
    return raw.decode("ascii", "replace").strip()


def dumps(obj) -> str:
    """JSON for attributes: non-tensor state is JSON, never pickle."""
    return json.dumps(obj, sort_keys=True)
