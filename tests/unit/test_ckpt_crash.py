"""Crashes and full disks during saves (issue 24), each checked on the values read back:

- a real small file system (tmpfs) that fills up during a sync or an async save, in the
  shard, in ``index.h5`` or in ``manifest.json``: one line saying so, the previous
  checkpoint resolves, verifies and loads bit for bit, no ``.tmp`` stays, space is freed,
  and the next save that fits works;
- ``kill -9`` at seeded random moments of repeated saves and re-saves (sync and async):
  ``latest`` always resolves to a complete checkpoint whose every tensor holds exactly the
  values of the one save its manifest names, and the next save over the stale ``.tmp`` works;
- the re-save crash window, hit exactly (the process ends with ``os._exit`` inside hpcml's
  commit): between the two renames where the file system cannot swap directories, after
  them, and after the atomic swap; resolve, verify and load give the old or the new copy
  whole, and the following saves clean up.

Every save of generation ``gen`` fills every tensor with ``gen`` (``ckpt_crash_child.state``)
and records ``gen`` in ``extra``: a mixture of two saves, or fill values, cannot pass."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcml import ckpt
from hpcml.ckpt import format as fmt, shard, sink, tools
from hpcml.errors import CheckpointError

from . import ckpt_crash_child as child

# ---------------------------------------------------------------- checks on what was saved


def _check(root: Path, steps: dict[int, int], *, lo: int | None = None, hi: int | None = None,
           gen: int | None = None) -> int:
    """``root`` (a root with ``latest``, or a step directory) resolves to a complete
    checkpoint that verifies clean, whose files are exactly those its manifest lists, and
    whose every tensor holds exactly the values of the one save (gen) its ``extra`` names,
    made for the step its manifest says (``steps``: gen -> step). That gen is ``gen``, or
    between ``lo`` and ``hi``; returns it."""
    path = ckpt.resolve(root)
    assert tools.verify(root) == []
    with ckpt.Checkpoint(root) as ck:
        assert ck.path == path
        files = set(ck.manifest["files"]) | {fmt.MANIFEST}
        saved = ck.extra["gen"]
        assert ck.step == steps[saved], f"gen {saved} was saved as step {steps[saved]}, manifest says {ck.step}"
    if path != root:  # reached through latest: step_N, or step_N.old while step_N is missing
        assert path.name in (fmt.step_dir(steps[saved]), fmt.step_dir(steps[saved]) + fmt.OLD_SUFFIX)
    assert set(os.listdir(path)) == files
    dst = child.empty()
    report = ckpt.load(root, dst)
    assert report.step == steps[saved] and report.extra["gen"] == saved
    want = child.state(saved)
    for name, t in dst.items():
        assert torch.equal(t, want[name]), f"{name}: not the values of gen {saved} (a mixture or fill values)"
    if gen is not None:
        assert saved == gen, f"loaded gen {saved}, expected {gen}"
    if lo is not None:
        assert lo <= saved, f"loaded gen {saved}, but gen {lo} had been committed"
    if hi is not None:
        assert saved <= hi, f"loaded gen {saved}, but no save after gen {hi} had begun"
    return saved


def _names(root: Path) -> list[str]:
    """The entries of a checkpoint root, less dot-files (the directory's ``.hpcml-lock``)."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


# ---------------------------------------------------------------------------- full disks


@pytest.fixture(params=["tmpfs", "ext4"])
def small_disk(request, tmp_path):
    """A real 4 MiB file system, unmounted after the test: tmpfs (saves write through the page
    cache: tmpfs has no O_DIRECT) and ext4 on a loop device (saves write their data with
    O_DIRECT, hpcml.ckpt.sink). Needs root (CI and `make test` have it here)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if request.param == "tmpfs":
        cmds = [["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mnt)]]
    else:
        img = tmp_path / "disk.img"
        with open(img, "wb") as f:
            f.truncate(4 << 20)
        cmds = [["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], ["mount", "-o", "loop", str(img), str(mnt)]]
    for cmd in cmds:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            r = subprocess.CompletedProcess(cmd, 127, "", str(e))
        if r.returncode:
            why = r.stderr.strip() or r.returncode
            pytest.skip(f"{cmd[0]} of a 4 MiB {request.param} is not permitted here ({why}): "
                        "the full-disk tests need a real small file system")
    if request.param == "ext4":
        assert sink.takes_direct_writes(mnt), "ext4 must take O_DIRECT writes"
    try:
        (mnt / "ckpt").mkdir()  # beside ext4's lost+found
        yield mnt / "ckpt"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


BIG = {"model/big": ((1024, 1024), torch.float32)}  # 4 MiB: never fits beside anything on the 4 MiB disk


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _one_line_no_space(e: pytest.ExceptionInfo, root: Path, step: int, file: str) -> None:
    """The error is the one line that names the step, the cause and the file."""
    name = fmt.step_dir(step)
    assert str(e.value) == f"saving {root / name} failed: rank 0: no space left on device writing " \
                           f"{root / (name + '.tmp') / file}"


@pytest.mark.parametrize("precheck", [True, False], ids=["free-space-check", "fallocate"])
def test_disk_full_sync_save_keeps_the_previous_checkpoint(small_disk, monkeypatch, precheck):
    steps = {1: 1, 2: 2, 3: 2, 4: 1}
    ckpt.save(small_disk, 1, child.state(1), extra={"gen": 1})
    _check(small_disk, steps, gen=1)
    free = _free(small_disk)
    if not precheck:  # the space runs out after the free-space check: the reservation must catch it
        monkeypatch.setattr(shard, "_free_bytes", lambda d: None)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(small_disk, 2, child.state(2, BIG), extra={"gen": 2})
    _one_line_no_space(e, small_disk, 2, "rank_00000.h5")
    assert _names(small_disk) == ["latest", "step_00000001"]  # no .tmp left
    assert _free(small_disk) == free  # nothing left taking space
    _check(small_disk, steps, gen=1)
    with pytest.raises(CheckpointError) as e:  # a re-save of the step latest names, too big
        ckpt.save(small_disk, 1, child.state(4, BIG), extra={"gen": 4})
    _one_line_no_space(e, small_disk, 1, "rank_00000.h5")
    assert _names(small_disk) == ["latest", "step_00000001"] and _free(small_disk) == free
    _check(small_disk, steps, gen=1)
    monkeypatch.undo()
    ckpt.save(small_disk, 2, child.state(3), extra={"gen": 3})  # the next save that fits works
    _check(small_disk, steps, gen=3)
    assert _names(small_disk) == ["latest", "step_00000001", "step_00000002"]
    _check(small_disk / "step_00000001", steps, gen=1)


def test_disk_full_async_save_keeps_the_previous_checkpoint(small_disk):
    steps = {1: 1, 2: 2, 3: 2, 4: 3}
    saver = ckpt.AsyncSaver(MPI.COMM_WORLD)
    try:
        saver.save(small_disk, 1, child.state(1), extra={"gen": 1})
        saver.wait()
        _check(small_disk, steps, gen=1)
        free = _free(small_disk)
        saver.save(small_disk, 2, child.state(2, BIG), extra={"gen": 2})
        with pytest.raises(CheckpointError) as e:
            saver.wait()
        _one_line_no_space(e, small_disk, 2, "rank_00000.h5")
        assert _names(small_disk) == ["latest", "step_00000001"] and _free(small_disk) == free
        _check(small_disk, steps, gen=1)
        saver.save(small_disk, 2, child.state(3), extra={"gen": 3})  # the same saver, a save that fits
        saver.wait()
        _check(small_disk, steps, gen=3)
        saver.save(small_disk, 3, child.state(4, BIG), extra={"gen": 4})  # full again: the error comes at close
        with pytest.raises(CheckpointError) as e:
            saver.close()
        _one_line_no_space(e, small_disk, 3, "rank_00000.h5")
    finally:
        saver.close()
    assert _names(small_disk) == ["latest", "step_00000001", "step_00000002"]
    _check(small_disk, steps, gen=3)


def _sizes(tmp: Path, gen: int) -> dict[str, int]:
    """The bytes of each file of a save of ``child.state(gen)`` (the same on any file system)."""
    ckpt.save(tmp, 1, child.state(gen), extra={"gen": gen})
    return {p.name: p.stat().st_size for p in (tmp / "step_00000001").iterdir()}


@pytest.mark.parametrize("small_disk", ["tmpfs"], indirect=True)  # its room is counted in tmpfs pages
@pytest.mark.parametrize("runs_out_in", [fmt.INDEX, fmt.MANIFEST])
def test_disk_full_while_writing_the_index_or_manifest(forked, small_disk, tmp_path, runs_out_in):
    """The shard fits, then the space runs out in rank 0's own files (``index.h5``, then
    ``manifest.json``): the same one line, nothing of the failed save stays, and the
    process lives on (the save runs in a process of its own: HDF5 is known to crash after
    a file close that failed, h5py#914)."""
    steps = {1: 1, 2: 2, 3: 2}
    sizes = _sizes(tmp_path / "probe", 2)
    ckpt.save(small_disk, 1, child.state(1), extra={"gen": 1})
    page = os.statvfs(small_disk).f_frsize
    pages = lambda n: -(-n // page) * page  # noqa: E731
    room = pages(sizes["rank_00000.h5"])
    if runs_out_in == fmt.MANIFEST:
        room += pages(sizes[fmt.INDEX])
    room += page  # less than the file that should not fit, whatever it is
    assert sizes[runs_out_in] > page, sizes
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, _free(small_disk) - room)
    finally:
        os.close(fd)
    assert _free(small_disk) == room
    out = tmp_path / "outcome"
    p = forked.Process(target=child.save_once, args=(str(small_disk), 2, 2, str(out)))
    p.start()
    p.join(60)
    outcome = out.read_text() if out.exists() else "(nothing: the process died inside the save)"
    assert p.exitcode == 0, f"the saving process died with exit status {p.exitcode}; it had said: {outcome}"
    assert outcome == (f"CheckpointError: saving {small_disk}/step_00000002 failed: rank 0: no space left on device "
                       f"writing {small_disk}/step_00000002.tmp/{runs_out_in}")
    assert _names(small_disk) == ["filler", "latest", "step_00000001"]
    assert _free(small_disk) == room
    _check(small_disk, steps, gen=1)
    filler.unlink()
    ckpt.save(small_disk, 2, child.state(3), extra={"gen": 3})
    _check(small_disk, steps, gen=3)


# ----------------------------------------------------------------- processes to crash


@pytest.fixture(scope="module")
def forked():
    """Processes forked from a fork server that has torch, h5py and hpcml imported (and no
    MPI: each process makes its own singleton), so that starting one costs little."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "h5py", "hpcml.ckpt.writer", "hpcml.ckpt.reader",
                                "hpcml.ckpt.checked", "tests.unit.ckpt_crash_child"])
    return ctx


def _group_gone(pgid: int, timeout: float = 20.0) -> None:
    """Wait until no live process is left in group ``pgid`` (the async writer included)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = Path(f"/proc/{d}/stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                if int(fields[2]) == pgid and fields[0] not in "ZX":
                    alive.append(int(d))
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} of group {pgid} outlived SIGKILL"
        time.sleep(0.005)


def _log(path: Path) -> tuple[list[int], list[int], float | None]:
    """Gens started, gens committed, and the seconds from ready to done (None: not done)."""
    lines = path.read_text().splitlines() if path.exists() else []
    started = [int(x[2:]) for x in lines if x.startswith("s ")]
    committed = [int(x[2:]) for x in lines if x.startswith("c ")]
    t = {x.split()[0]: float(x.split()[1]) for x in lines if x.startswith(("ready ", "done "))}
    return started, committed, t["done"] - t["ready"] if "done" in t else None


def _wait_ready(proc, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and "ready" in log.read_text()):
        if not proc.is_alive():
            assert log.exists() and "ready" in log.read_text(), \
                f"the saving process exited with status {proc.exitcode} before it was ready"
            return
        assert time.monotonic() < deadline, "the saving process was not ready in time"
        time.sleep(0.002)


KILLS = {"sync": 10, "async": 8}
KEEP = 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_at_random_moments_of_saves(forked, tmp_path, mode):
    """Repeated saves and re-saves of the same step, killed (SIGKILL to the process, or to
    it and its async writer) at seeded random moments: after every kill ``latest`` names a complete
    checkpoint of the last committed save or a later one, every tensor exactly its values;
    the next process re-saves the killed step over its stale ``.tmp`` and commits."""
    rng = random.Random(f"issue-24-{mode}")
    root = tmp_path / "ck"
    steps: dict[int, int] = {}
    counter = {"gen": 0}

    def plan(step: int, n: int) -> list[tuple[int, int]]:
        """``n`` saves from ``step`` on: about half re-save the step before."""
        out = []
        for k in range(n):
            if k and rng.random() < 0.5:
                step += 1
            counter["gen"] += 1
            steps[counter["gen"]] = step
            out.append((counter["gen"], step))
        return out

    def run(n: int, step: int, delay: float | None, i: int) -> tuple[list[int], list[int], float | None]:
        """A process saving ``n`` times from ``step`` on, killed ``delay`` seconds after it is
        ready (None: let it finish); what its log says. Every other async kill spares the
        writer process, which then ends its write and exits (the rank alone was killed: the
        OOM killer's choice); the others kill both, as a job's end does."""
        log = tmp_path / f"log{i}"
        p = forked.Process(target=child.save_loop,
                           args=(str(root), mode, plan(step, n), str(log), KEEP, str(tmp_path / "warm")))
        p.start()
        try:
            _wait_ready(p, log)
            if delay is None:
                p.join(60)
                assert p.exitcode == 0, f"the saving process failed (exit status {p.exitcode})"
            else:
                time.sleep(delay)
                try:
                    (os.kill if i % 2 else os.killpg)(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.join(10)
                # saving until killed: a save that failed on what an earlier kill left would end it first
                assert p.exitcode == -signal.SIGKILL, f"the saving process ended by itself (status {p.exitcode})"
        finally:
            if p.is_alive():
                os.killpg(p.pid, signal.SIGKILL)
                p.join(10)
        _group_gone(p.pid)
        return _log(log)

    started, committed, took = run(4, 1, None, 0)  # uncut: how long a save takes here
    per_save = took / 4
    assert committed == started == [1, 2, 3, 4]
    last = _check(root, steps, gen=4)
    stale_tmp = resumed = 0
    for i in range(1, KILLS[mode] + 1):
        before = counter["gen"]
        killed_step = steps[before]  # a killed save's step is re-saved first, over its .tmp
        # far more saves than the kill can reach: the uncut run's first saves are cold and slow, the
        # later ones warm and up to 10x faster (40 of them once ended before a 1.6 s kill, CI stop 72)
        started, committed, took = run(400, killed_step, rng.uniform(0.0, 3.0 * per_save), i)
        assert took is None
        first = started[0] if started else None
        if committed and first in committed:
            resumed += 1
        if committed:
            last = committed[-1]
        stale_tmp += any(p.name.startswith("step_") and p.name.endswith(".tmp") for p in root.iterdir())
        hi = started[-1] if started else before  # killed before its first save: as before
        last = _check(root, steps, lo=last, hi=hi)
        # the gens of this run not yet started are never saved: the next run continues after them
        counter["gen"] = hi
        for g in [g for g in steps if g > hi]:
            del steps[g]
    assert stale_tmp, "no kill landed inside a save: the kills prove nothing"
    # An async kill can leave two saves in flight: the one being committed and the next.
    # A stale step_N.tmp goes only when step N is saved again; save each such step now
    # (the stale .tmp in the way), then a new step: nothing stale may stay after that.
    leftover = sorted(int(p.name[5:-4]) for p in root.iterdir() if fmt.STEP_RE.match(p.name.removesuffix(".tmp"))
                      and p.name.endswith(".tmp"))
    assert set(leftover) <= set(steps.values()), leftover  # only steps some save had begun
    step = max(steps.values())
    for s in leftover + [step, step + 1]:
        counter["gen"] += 1
        steps[counter["gen"]] = s
        ckpt.save(root, s, child.state(counter["gen"]), extra={"gen": counter["gen"]}, keep=KEEP)
        _check(root, steps, gen=counter["gen"])
    names = _names(root)
    assert not [n for n in names if n.endswith((".tmp", fmt.OLD_SUFFIX))], names
    kept = [n for n in names if n != fmt.LATEST and (root / n / fmt.MANIFEST).exists()]
    assert len(kept) <= KEEP, names
    for n in kept:  # every step kept is complete and holds one save
        _check(root / n, steps)
    # a step directory without a manifest is what a kill inside the pruning leaves; that it
    # is never pruned is test_a_crash_while_pruning_leaves_nothing_behind's business
    print(f"{mode}: {KILLS[mode]} kills, {per_save * 1e3:.0f} ms a save, {stale_tmp} left a stale .tmp, "
          f"{resumed} next runs committed their first save, {len(leftover)} stale .tmp at the end")


# -------------------------------------------------------------- the re-save crash window

WINDOWS = ["between-renames", "after-both-renames", "after-exchange"]
BEFORE = {  # saves made first, (gen, step); then step 2 (step 1 for "older-step") is re-saved as gen 9
    "only-step": [(1, 2)],
    "latest-of-two": [(1, 1), (2, 2)],
    "older-step": [(1, 1), (2, 2)],
}


@pytest.mark.parametrize("case", list(BEFORE))
@pytest.mark.parametrize("where", WINDOWS)
def test_a_crash_inside_a_resave_leaves_one_whole_copy(forked, tmp_path, where, case):
    root = tmp_path / "ck"
    before = BEFORE[case]
    step = 1 if case == "older-step" else 2
    new = 9
    steps = {g: s for g, s in before} | {new: step}
    old = max(g for g, s in before if s == step)
    p = forked.Process(target=child.resave_crash, args=(str(root), before, new, step, where))
    p.start()
    p.join(60)
    if p.exitcode == child.NO_EXCHANGE:
        pytest.skip(f"the file system of {tmp_path} cannot swap directories (renameat2 RENAME_EXCHANGE)")
    assert p.exitcode == child.CRASHED, f"exit status {p.exitcode}: the crash point in hpcml's commit was not reached"
    final = root / fmt.step_dir(step)
    aside = root / (final.name + fmt.OLD_SUFFIX)
    tmp = root / (final.name + ".tmp")
    # the process ended exactly where it was meant to
    if where == "between-renames":
        assert not final.exists() and aside.is_dir() and tmp.is_dir()
        copies = {aside: old, tmp: new}
    elif where == "after-both-renames":
        assert final.is_dir() and aside.is_dir() and not tmp.exists()
        copies = {final: new, aside: old}
    else:
        assert final.is_dir() and tmp.is_dir() and not aside.exists()
        copies = {final: new, tmp: old}
    for path, gen in copies.items():  # each copy on disk is whole, with its own values
        _check(path, steps, gen=gen)
    assert (root / fmt.LATEST).read_text().strip() == fmt.step_dir(before[-1][1])  # not rewritten yet
    if case == "older-step":  # latest names another step, untouched
        _check(root, steps, gen=2)
    elif where == "between-renames":  # step_N is missing: the copy latest named, from step_N.old
        assert ckpt.resolve(root) == aside
        _check(root, steps, gen=old)
    else:  # step_N is the new copy, whole
        assert ckpt.resolve(root) == final
        _check(root, steps, gen=new)
    # the following saves: another step, then the crashed step again; nothing stale stays
    steps |= {10: 3, 11: step}
    ckpt.save(root, 3, child.state(10), extra={"gen": 10})
    _check(root, steps, gen=10)
    assert not aside.exists()
    ckpt.save(root, step, child.state(11), extra={"gen": 11})
    _check(root, steps, gen=11)
    assert _names(root) == sorted({fmt.LATEST, "step_00000003"} | {fmt.step_dir(s) for _, s in before})
    for gen, s in ((10, 3), (11, step)) + tuple((g, s) for g, s in before if s != step):
        _check(root / fmt.step_dir(s), steps, gen=gen)


def test_a_crash_while_pruning_leaves_nothing_behind(forked, tmp_path):
    """``keep`` prunes the oldest step after ``latest`` names the new one; a kill inside that
    removal (its files gone, the directory not yet) must not leave a step directory that
    no later prune removes."""
    root = tmp_path / "ck"
    p = forked.Process(target=child.prune_crash, args=(str(root), 3))
    p.start()
    p.join(60)
    assert p.exitcode == child.CRASHED, f"exit status {p.exitcode}: the crash point in the pruning was not reached"
    steps = {g: g for g in range(1, 8)}
    _check(root, steps, gen=4)  # the save whose pruning was killed is committed
    assert (root / "step_00000001").is_dir() and not os.listdir(root / "step_00000001")  # where it was killed
    for gen in (5, 6):
        ckpt.save(root, gen, child.state(gen), extra={"gen": gen}, keep=3)
        _check(root, steps, gen=gen)
    assert _names(root) == ["latest", "step_00000004", "step_00000005", "step_00000006"]
