"""One checkpoint made another root's own without copying its bytes: a population's best
member's step becomes the run's ``checkpoints/`` (:func:`hpcml.train.population_online.export_best`).
A checkpoint is immutable once committed, so hard links share its files safely; the step
directory is assembled aside and committed by one rename, as a save commits its own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpcml.ckpt import format as fmt
from hpcml.ckpt.index import point_latest
from hpcml.errors import CheckpointError


def link_step(src: str | os.PathLike, root: str | os.PathLike, *, replace: bool = False) -> Path:
    """Step directory ``src`` (of another root) as ``root/<its name>``, which ``root/latest``
    then names: every file hard-linked (copied where the file system refuses links), links
    inside ``src`` neither followed nor carried over. A step of that name already in ``root``
    is replaced only with ``replace``; CheckpointError otherwise, and nothing is changed."""
    src, root = Path(src), Path(root)
    if not fmt.STEP_RE.match(src.name) or src.is_symlink() or not (src / fmt.MANIFEST).is_file():
        raise CheckpointError(f"{src}: not a committed checkpoint step directory (step_N with its {fmt.MANIFEST})")
    dst = root / src.name
    if (dst.exists() or dst.is_symlink()) and not replace:
        raise CheckpointError(f"{dst} exists: not replacing a checkpoint step that is not this export's")
    tmp = root / f".{src.name}.link-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for here, dirs, files in os.walk(src):
        out = tmp / Path(here).relative_to(src)
        out.mkdir(parents=True)
        for name in files:
            path = os.path.join(here, name)
            if os.path.islink(path):
                continue
            try:
                os.link(path, out / name, follow_symlinks=False)
            except OSError:
                shutil.copy2(path, out / name, follow_symlinks=False)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(here, d))]
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.exists():
        shutil.rmtree(dst)
    os.rename(tmp, dst)
    point_latest(root, dst.name)
    return dst
