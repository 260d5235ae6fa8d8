"""The process side of ``test_ckpt_crash.py``: saves that get killed (SIGKILL from the test)
or that end themselves with ``os._exit`` at an exact point of the commit.

Not a test module (pytest does not collect it). The test starts these functions in
processes forked from a ``multiprocessing`` fork server that has torch, h5py and hpcml
imported already (no MPI: each process initialises its own singleton MPI), so a process
is ready to save in a fraction of a second and twenty kills stay cheap.

Every save of generation ``gen`` fills every tensor with ``gen`` and records it in
``extra``, so a loaded checkpoint shows whether its tensors all come from the one save
its manifest names."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# (shape, dtype): several datasets, several dtypes, a scalar; ~300 KB a save
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model/embed.weight": ((128, 256), torch.float32),
    "model/layers.0.w": ((96, 128), torch.float32),
    "model/layers.1.w": ((96, 128), torch.bfloat16),
    "model/norm.weight": ((256,), torch.float32),
    "optim/layers.0.w/exp_avg": ((96, 128), torch.float64),
    "optim/layers.0.w/step": ((), torch.int64),
    "rank_state/rank_00000/torch_rng": ((5056,), torch.uint8),
}

CRASHED = 77  # exit status of a process that reached its crash point
MISSED = 78  # exit status of a process whose save finished without reaching it
NO_EXCHANGE = 79  # the file system cannot swap directories: the exchange path cannot be reached


def state(gen: int, shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor filled with ``gen`` (``gen % 256`` in uint8 and bfloat16, exact there)."""
    return {n: torch.full(s, gen % 256 if d in (torch.uint8, torch.bfloat16) else gen, dtype=d)
            for n, (s, d) in (shapes or SHAPES).items()}


def empty(shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """Destination tensors, filled with a value no save uses."""
    return {n: torch.full(s, 255 if d == torch.uint8 else -7, dtype=d) for n, (s, d) in (shapes or SHAPES).items()}


def save_loop(root: str, mode: str, plan: list[tuple[int, int]], log: str, keep: int | None, warm: str) -> None:
    """Save ``plan`` ((gen, step), ...) in order, synchronously or with an AsyncSaver, noting
    in ``log`` (O_APPEND lines, each one write) ``s GEN`` before a save starts and ``c GEN``
    once ``latest`` names it, and ``ready T`` / ``done T`` (``time.monotonic()``) around the
    saves. Its own process group: the test kills the async writer too. The async writer
    process is started and warm (one save into the scratch directory ``warm``) before
    ``ready``, so that the kills fall on saves, not on the writer's start."""
    import time

    os.setpgid(0, 0)
    from mpi4py import MPI

    from hpcml import ckpt

    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    comm = MPI.COMM_WORLD
    saver = ckpt.AsyncSaver(comm) if mode == "async" else None
    if saver is not None:
        saver.save(warm, 0, state(0))
        saver.wait()
    note(f"ready {time.monotonic()}")
    previous = None
    for gen, step in plan:
        note(f"s {gen}")
        if saver is None:
            ckpt.save(root, step, state(gen), comm=comm, extra={"gen": gen}, keep=keep)
            note(f"c {gen}")
        else:
            saver.save(root, step, state(gen), extra={"gen": gen}, keep=keep)  # commits the one before
            if previous is not None:
                note(f"c {previous}")
        previous = gen
    if saver is not None:
        saver.close()
        note(f"c {previous}")
    note(f"done {time.monotonic()}")


def save_once(root: str, gen: int, step: int, out: str) -> None:
    """One synchronous save; ``out`` gets ``saved`` or the exception's type and line. Then a
    full garbage collection, so that a library left in a bad state by the failure crashes
    here (a non-zero exit status) and not at some later point."""
    import gc

    from mpi4py import MPI

    from hpcml import ckpt

    try:
        ckpt.save(root, step, state(gen), comm=MPI.COMM_WORLD, extra={"gen": gen})
        result = "saved"
    except Exception as e:  # noqa: BLE001 -- the test judges it
        result = f"{type(e).__name__}: {e}"
        del e
    Path(out).write_text(result)
    gc.collect()


def resave_crash(root: str, before: list[tuple[int, int]], gen: int, step: int, where: str) -> None:
    """Save ``before`` ((gen, step), ...), then re-save ``step`` as ``gen`` and end the process
    (``os._exit(CRASHED)``, no cleanup of any kind) at ``where``:

    - ``between-renames``: no RENAME_EXCHANGE; ``step_N`` moved to ``step_N.old``, the new
      copy not yet renamed to ``step_N``;
    - ``after-both-renames``: no RENAME_EXCHANGE; the new copy is ``step_N``, ``step_N.old``
      still there, ``latest`` not yet rewritten;
    - ``after-exchange``: the two directories swapped (``step_N.tmp`` holds the old copy),
      before that copy is removed and ``latest`` rewritten.

    The fault is injected into hpcml's own commit (hpcml.ckpt.index), nothing else."""
    from mpi4py import MPI

    from hpcml import ckpt
    from hpcml.ckpt import format as fmt, index

    comm = MPI.COMM_WORLD
    for g, s in before:
        ckpt.save(root, s, state(g), comm=comm, extra={"gen": g})
    final = fmt.step_dir(step)
    if where in ("between-renames", "after-both-renames"):
        index._exchange = lambda a, b: False
        real_rename = Path.rename

        def rename(self, target):
            if where == "between-renames" and self.name == final + ".tmp" and Path(target).name == final:
                os._exit(CRASHED)  # step_N is step_N.old by now
            out = real_rename(self, target)
            if where == "after-both-renames" and Path(target).name == final:
                os._exit(CRASHED)
            return out
        Path.rename = rename
    elif where == "after-exchange":
        real_exchange = index._exchange

        def exchange(a, b):
            if not real_exchange(a, b):
                os._exit(NO_EXCHANGE)
            os._exit(CRASHED)
        index._exchange = exchange
    else:
        raise ValueError(where)
    ckpt.save(root, step, state(gen), comm=comm, extra={"gen": gen})
    os._exit(MISSED)


def prune_crash(root: str, keep: int) -> None:
    """Save steps 1..4 (gen = step) with ``keep``; the fourth save's pruning of step 1 ends
    the process (``os._exit(CRASHED)``) after the directory's files are removed and before
    the directory itself is, as a kill there leaves it."""
    import shutil

    from mpi4py import MPI

    from hpcml import ckpt
    from hpcml.ckpt import format as fmt

    comm = MPI.COMM_WORLD
    for g in (1, 2, 3):
        ckpt.save(root, g, state(g), comm=comm, extra={"gen": g}, keep=keep)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        p = Path(path)
        if p.name == fmt.step_dir(1):
            for f in p.iterdir():
                f.unlink()
            os._exit(CRASHED)
        return real_rmtree(path, *args, **kwargs)
    shutil.rmtree = rmtree
    ckpt.save(root, 4, state(4), comm=comm, extra={"gen": 4}, keep=keep)
    os._exit(MISSED)
