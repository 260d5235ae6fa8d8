"""hpcml HDF5 checkpoints vs torch.distributed.checkpoint (DCP) vs the disk: repeated, paired runs.

    mpiexec -n 2 python benchmarks/ckpt_vs_dcp.py --quick              # a check: 0.25 GiB x 5 (~45 s)
    mpiexec -n 2 python benchmarks/ckpt_vs_dcp.py --key --json         # the figures: 2 GiB x 5 (~4 min)
    mpiexec -n 2 python benchmarks/ckpt_vs_dcp.py --key --extras --json    # and the rest below (~8 min)

Run as root for cold loads (the page cache is dropped through /proc/sys/vm/drop_caches;
``caches_dropped`` says whether it was), on a quiet machine: the 1-minute load average
is recorded at the start of every repetition and printed with the figures.

The state is what FSDP leaves on each rank: a model's parameters and AdamW's two moments
as DTensors sharded on dim 0 over all ranks (1/3 parameters, 2/3 optimizer state).

Every figure is taken once per repetition (``--repeats``, default 5) and reported as the
median with min, max and quartiles; ratios are taken within a repetition (hpcml's save
against DCP's save of the same repetition, ...) and the median of those ratios is
reported. Within a repetition the saves, then the loads, run in a random order (seeded:
``--seed``; every order is in the JSON), so no figure always follows the same other one --
on this kind of virtual disk a write runs slower or faster after some writes than after
others, and a fixed or rotated order pairs the same neighbours every time. One
repetition:

* saves, each into a fresh directory, page cache dropped once before them: the disk limit
  twice -- every rank writes the bytes it saves (its real tensor bytes) to a file of its
  own, all ranks at once, once with ``O_DIRECT`` and once as buffered writes + ``fsync``
  (:mod:`ckpt_disk`; ``dd`` through the page cache is no limit) -- hpcml's ``ckpt.save``
  (file per rank), DCP's ``save`` (which fsyncs too), and with ``--key`` hpcml's save with
  a key, with ``--extras`` hpcml's collective single-file save (MPI-IO). The checkpoint
  directories' locks are taken before the timing, as ``CheckpointHook`` holds its
  directory's for a whole training;
* cold loads, the page cache dropped before each: hpcml into the same sharding, DCP into
  the same sharding, hpcml resharded (dim 1: every rank reads half the columns of every
  tensor from both shards), the read limit twice (``O_DIRECT`` reads, and buffered reads
  of a cold cache, of the limit files), with ``--key`` hpcml's keyed load, with
  ``--extras`` ``hpcml ckpt verify`` of the whole checkpoint; with ``--key`` also a warm
  load with and without the key (the key's CPU cost, without the disk's noise), and the
  key's own work (derive the key, sign the manifest, check the signature) timed alone --
  the disk's run-to-run swing is far above 2%, the paired wall-time ratios cannot resolve it;
* async: a memcpy of the rank's bytes into warm memory (the floor of a copying snapshot),
  then ``AsyncSaver.save`` -- the seconds it returns as blocked (the slowest rank's) --
  and the wait for the writer to finish; the saver's staging buffer is reserved before the
  first repetition, as ``CheckpointHook`` does, and every async save goes to one directory
  (``keep=1``). ``async_block_vs_sync`` is that blocked time over the same repetition's
  sync save; ``memcpy_vs_sync`` is the floor any copying snapshot has on that ratio;
* ``--extras``: DCP's ``async_save`` (block and total), the extra wall time of a synthetic
  training step (matmuls for about a sync save's length) that runs while an async save is
  written (``overlap`` off and on), the CRC-32 of the rank's bytes and the manifest check.

Targets (issue 24) are printed with pass/fail on the median and in how many repetitions
each was met. JSON: ``seconds`` and ``gbps`` (median, min, max, q1, q3 of each figure),
``ratios`` (the same of each per-repetition ratio, with its samples), ``targets``,
``samples_s`` (every raw sample; ``*_cpu``: CPU seconds of all ranks together, every
thread; ``*_write``: the slowest rank's shard write alone, from ``SaveResult``),
``loadavg_1min``, ``order`` (each repetition's order of saves, loads, warm loads).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_disk import (Target, aligned_buffer, direct_io_works, drop_caches, fill, paired, read_buffered,  # noqa: E402
                       read_direct, spread, write_direct, write_fsync)

__all__ = ["drop_caches", "parse_io_args"]

TARGETS = [
    Target("async_block_vs_sync", "<=", 0.05, "async save blocks <= 0.05 of a sync save"),
    Target("reshard_vs_same_load", "<=", 1.2, "resharding load <= 1.2x a same-layout load"),
    Target("save_vs_dcp", ">=", 1.3, "save >= 1.3x torch DCP's speed (DCP s / hpcml s)"),
    Target("load_vs_dcp", ">=", 1.5, "load >= 1.5x torch DCP's speed (DCP s / hpcml s)"),
    Target("key_save_overhead", "<=", 0.02, "a key adds <= 2% to the save"),
    Target("key_load_overhead", "<=", 0.02, "a key adds <= 2% to the (cold) load"),
    Target("key_load_warm_overhead", "<=", 0.02, "a key adds <= 2% to a warm load (no disk noise)"),
    Target("key_work_vs_save", "<=", 0.02, "the key's own work (derive, sign, check) <= 2% of the save"),
]


def parse_io_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The options every checkpoint benchmark shares (--dir, --json), then parse."""
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args()


def key_supported() -> bool:
    """Whether ``hpcml.ckpt.save`` and ``load`` take ``key=`` (signed checkpoints)."""
    from hpcml.ckpt import reader, writer

    return all("key" in inspect.signature(f).parameters for f in (writer.save, reader.load))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", "--gib", dest="size", type=float, default=None,
                   help="total state over all ranks, GiB (default 2; 0.25 with --quick)")
    p.add_argument("--repeats", type=int, default=5, help="repetitions; every figure is their median (default 5)")
    p.add_argument("--quick", action="store_true", help="a check: 0.25 GiB unless --size says otherwise")
    p.add_argument("--key", action="store_true", help="also save and load with a key (hpcml.ckpt key=): its overhead")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-repetition order of saves and of loads")
    p.add_argument("--extras", action="store_true",
                   help="also single-file save, verify, DCP async_save, training-step cost, CRC-32, manifest check")
    args = parse_io_args(p)
    size = args.size if args.size is not None else (0.25 if args.quick else 2.0)
    repeats = max(1, args.repeats)

    os.environ.setdefault("HPCML_LOG_LEVEL", "WARNING")  # no line per save on stderr
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from mpi4py import MPI
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpcml import ckpt
    from hpcml.grid import ProcessGrid

    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    grid = ProcessGrid(dp=world)
    grid.init_torch()
    mesh = grid.torch.mesh["dp"]
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-bench-", dir=args.dir) if rank == 0 else None))
    o_direct = comm.allreduce(int(direct_io_works(base)), op=MPI.MIN) == 1
    use_key = args.key and key_supported()
    key = comm.bcast(secrets.token_hex(32).encode() if rank == 0 else None) if use_key else None

    cols = 4096
    n_params = 8

    def make(total_gib: float, placement, zeros: bool = False):
        rows_total = int(total_gib * 2**30 / 4 / cols / 3)  # per parameter, 3 tensors each (param, exp_avg, exp_avg_sq)
        rows = max(world * 2, rows_total // n_params // (world * 2) * (world * 2))
        state = {}
        for i in range(n_params):
            for kind in ("model/w{}", "optim/w{}/exp_avg", "optim/w{}/exp_avg_sq"):
                if zeros:
                    state[kind.format(i)] = distribute_tensor(torch.zeros(rows, cols), mesh, [placement])
                else:
                    full = torch.randn(rows, cols) if rank == 0 else torch.empty(rows, cols)
                    state[kind.format(i)] = distribute_tensor(full, mesh, [placement], src_data_rank=0)
        return state, rows

    torch.manual_seed(0)
    state, rows = make(size, Shard(0))
    state_bytes = sum(t.numel() * 4 for t in state.values())
    mine = [v.to_local() for v in state.values()]
    local_bytes = sum(t.numel() * t.element_size() for t in mine)
    limit_bytes = comm.allreduce(local_bytes)  # the limit writes exactly the bytes the savers write, rank by rank
    same = {k: torch.zeros_like(v) for k, v in state.items()}
    resharded, _ = make(size, Shard(1), zeros=True)
    same_local = [same[k].to_local() for k in state]
    buf = aligned_buffer(local_bytes)
    fill(buf, [t.numpy() for t in mine])

    # warm-up (not timed): imports, DCP's planner, h5py, the async writer process, at a tiny size
    tiny, _ = make(0.002, Shard(0))
    warm = base / "warmup"
    ckpt.save(warm / "hpcml", 1, tiny, comm=comm)
    ckpt.load(warm / "hpcml", tiny, comm=comm)
    dcp.save(tiny, checkpoint_id=str(warm / "dcp"))
    dcp.load(tiny, checkpoint_id=str(warm / "dcp"))
    if use_key:
        ckpt.save(warm / "hpcml_key", 1, tiny, comm=comm, key=key)
        ckpt.load(warm / "hpcml_key", tiny, comm=comm, key=key)
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(warm, ignore_errors=True)
    del tiny

    def hold(root: Path) -> None:
        """Take the checkpoint directory's lock before timing, as ``CheckpointHook`` does
        once per training (a plain ``ckpt.save`` takes it, with an fsync, per save)."""
        try:
            from hpcml.ckpt import lock
        except ImportError:  # an hpcml without directory locks
            return
        lock.hold_on(root, comm)

    def release(root: Path) -> None:
        try:
            from hpcml.ckpt import lock
        except ImportError:
            return
        if rank == 0:
            lock.release(root)

    async_root = base / "async"  # one directory for every async save, pruned to the newest (keep=1)
    hold(async_root)
    saver = ckpt.AsyncSaver(comm)
    comm.Barrier()
    t0 = time.perf_counter()
    saver.reserve(state)  # as CheckpointHook does at the start of training
    comm.Barrier()
    reserve_s = time.perf_counter() - t0

    single_ok = False
    if args.extras:
        try:
            from hpcml.ckpt.single import require_parallel_hdf5

            require_parallel_hdf5()
            single_ok = True
        except Exception:  # noqa: BLE001 -- a serial h5py: the single-file save is left out
            single_ok = False

    samples: dict[str, list] = defaultdict(list)
    checks: dict[str, bool] = {}
    amp: dict[str, float] = {}
    caches_dropped = True

    def timed(name: str, fn, cpu: bool = False):
        """Wall seconds from a barrier to a barrier (the slowest rank), appended to ``samples[name]``;
        with ``cpu`` also the CPU seconds of all ranks together (every thread of each process)."""
        comm.Barrier()
        c0 = time.process_time()
        t = time.perf_counter()
        out = fn()
        c = time.process_time() - c0
        comm.Barrier()
        samples[name].append(time.perf_counter() - t)
        if cpu:
            samples[name + "_cpu"].append(comm.allreduce(c))
        return out

    def cold():
        nonlocal caches_dropped
        comm.Barrier()
        caches_dropped &= comm.allreduce(int(drop_caches()), op=MPI.MIN) == 1

    def same_equal() -> bool:
        ok = all(torch.equal(same[k].to_local(), state[k].to_local()) for k in state)
        for t in same_local:
            t.zero_()
        return ok

    order_rng = random.Random(args.seed)  # the same seed on every rank: the same order

    def shuffled(ops: list) -> list:
        ops = order_rng.sample(ops, len(ops))
        samples["order"].append([name for name, _ in ops])
        return ops

    async_step = 0  # the async saves' steps, in order (keep=1 prunes all but the newest)
    step_reps = None
    a = torch.randn(512, 512)

    def step():
        for _ in range(step_reps):
            a @ a

    for i in range(repeats):
        samples["loadavg_1min"].append(os.getloadavg()[0])
        d = base / f"r{i}"
        if i:
            for root in ("hpcml", "hpcml_key", "hpcml_single"):
                release(base / f"r{i - 1}" / root)
        if rank == 0:
            if i:
                shutil.rmtree(base / f"r{i - 1}", ignore_errors=True)
            d.mkdir()
        cold()  # the deletes written back; every save starts from the same state

        # -- saves ------------------------------------------------------------------------
        for root in ("hpcml", "hpcml_key", "hpcml_single"):
            hold(d / root)

        def hp_save(name, target, **kw):
            def run():
                r = ckpt.save(target, 1, state, comm=comm, **kw)
                samples[name + "_write"].append(comm.allreduce(r.write_seconds, op=MPI.MAX))
            return run

        saves = [
            ("hpcml_save", hp_save("hpcml_save", d / "hpcml")),
            ("dcp_save", lambda: dcp.save(state, checkpoint_id=str(d / "dcp"))),
            ("limit_write_fsync", lambda: write_fsync(d / f"limit_fsync_{rank}", buf, local_bytes)),
        ]
        if o_direct:
            saves.append(("limit_write_direct", lambda: write_direct(d / f"limit_direct_{rank}", buf, local_bytes)))
        if use_key:
            saves.append(("hpcml_key_save", hp_save("hpcml_key_save", d / "hpcml_key", key=key)))
        if single_ok:
            saves.append(("hpcml_single_save", lambda: ckpt.save(d / "hpcml_single", 1, state, comm=comm,
                                                                 single_file=True)))
        for name, fn in shuffled(saves):
            timed(name, fn, cpu=name in ("hpcml_save", "hpcml_key_save"))

        # -- cold loads -------------------------------------------------------------------
        def hp_load(name, src, dst, **kw):
            def run():
                r = ckpt.load(src, dst, comm=comm, **kw)
                amp.setdefault(name, comm.allreduce(r.read_amplification, op=MPI.MAX))
            return run

        loads = [
            ("hpcml_load", hp_load("hpcml_load", d / "hpcml", same)),
            ("dcp_load", lambda: dcp.load(same, checkpoint_id=str(d / "dcp"))),
            ("hpcml_reshard_load", hp_load("hpcml_reshard_load", d / "hpcml", resharded)),
            ("limit_read_cold", lambda: read_buffered(d / f"limit_fsync_{rank}", buf, local_bytes)),
        ]
        if o_direct:
            loads.append(("limit_read_direct", lambda: read_direct(d / f"limit_direct_{rank}", buf, local_bytes)))
        if use_key:
            loads.append(("hpcml_key_load", hp_load("hpcml_key_load", d / "hpcml_key", same, key=key)))
        if args.extras:
            from hpcml.ckpt import tools

            loads.append(("verify", lambda: tools.verify(d / "hpcml") if rank == 0 else []))
        for name, fn in shuffled(loads):
            cold()
            out = timed(name, fn, cpu=name in ("hpcml_load", "hpcml_key_load"))
            if i == 0 and name in ("hpcml_load", "dcp_load", "hpcml_key_load"):
                checks[name] = same_equal()
            elif i == 0 and name == "hpcml_reshard_load":
                checks[name] = all(torch.equal(resharded[k].full_tensor(), state[k].full_tensor())
                                   for k in list(state)[:3])
            elif name == "verify":
                checks.setdefault("verify", True)
                checks["verify"] &= not out
        if use_key:  # the key's own work, apart from any I/O: derive, sign the manifest, check the signature
            from hpcml.ckpt import format as fmt, keys

            body = (ckpt.resolve(d / "hpcml_key") / fmt.MANIFEST).read_bytes()
            t = time.perf_counter()
            for _ in range(10):
                ring = keys.keyring(key)
                ring.check(ring.sign(body), body, "manifest")  # the save signs, the load checks
            samples["key_work"].append(comm.allreduce((time.perf_counter() - t) / 10, op=MPI.MAX))
        if use_key:  # warm: the page cache holds both checkpoints; what is left is CPU work
            warm_loads = [("hpcml_load_warm", hp_load("w", d / "hpcml", same)),
                          ("hpcml_key_load_warm", hp_load("w", d / "hpcml_key", same, key=key))]
            for name, fn in shuffled(warm_loads):
                fn()  # the first read of its kind may still fault pages in
                timed(name, fn, cpu=True)

        # -- async --------------------------------------------------------------------------
        timed("memcpy", lambda: [dst.copy_(src) for dst, src in zip(same_local, mine)])
        async_step += 1
        blocked = timed("async_save_call", lambda: saver.save(async_root, async_step, state, keep=1))
        samples["async_block"].append(comm.allreduce(blocked, op=MPI.MAX))
        timed("async_wait", lambda: saver.wait())
        samples["async_total"].append(samples["async_save_call"][-1] + samples["async_wait"][-1])

        if args.extras:
            fut = []
            timed("dcp_async_block", lambda: fut.append(dcp.async_save(state, checkpoint_id=str(d / "dcp_async"))))
            timed("dcp_async_wait", lambda: fut[0].result())
            samples["dcp_async_total"].append(samples["dcp_async_block"][-1] + samples["dcp_async_wait"][-1])
            if step_reps is None:  # a synthetic training step of about the first sync save's length
                t = time.perf_counter()
                for _ in range(20):
                    a @ a
                step_reps = comm.allreduce(max(1, int(samples["hpcml_save"][0] / ((time.perf_counter() - t) / 20))),
                                           op=MPI.MIN)
            timed("step", step)
            for overlap in (False, True):
                name = "step_during_async_overlap" if overlap else "step_during_async"

                async_step += 1

                def step_during_save(ov=overlap, name=name, n=async_step):
                    b = saver.save(async_root, n, state, keep=1, overlap=ov)
                    samples[name + "_block"].append(comm.allreduce(b, op=MPI.MAX))  # overlap: the plan alone
                    step()
                    saver.wait_staged()  # before the optimizer step

                timed(name, step_during_save)
                saver.wait()
            import zlib

            views = [memoryview(t.numpy()).cast("B") for t in mine]
            timed("crc32", lambda: [zlib.crc32(m[j:j + (1 << 20)]) for m in views for j in range(0, len(m), 1 << 20)])
            del views
            from hpcml.ckpt.checked import Checkpoint

            timed("manifest_check", lambda: Checkpoint(d / "hpcml").close())
    saver.close()
    release(async_root)
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    buf.close()

    values_equal = comm.allreduce(int(all(checks.values())), op=MPI.MIN) == 1
    if rank == 0:
        s = dict(samples)
        order, loadavg = s.pop("order"), s.pop("loadavg_1min")
        gb = state_bytes / 1e9
        ratios: dict[str, list] = {}

        def ratio(name, num, den, minus_one=False):
            if num in s and den in s:
                r = paired(s[num], s[den])
                ratios[name] = [x - 1 if minus_one and x is not None else x for x in r]

        ratio("save_vs_dcp", "dcp_save", "hpcml_save")
        ratio("load_vs_dcp", "dcp_load", "hpcml_load")
        ratio("reshard_vs_same_load", "hpcml_reshard_load", "hpcml_load")
        ratio("reshard_vs_dcp_load", "dcp_load", "hpcml_reshard_load")
        ratio("async_block_vs_sync", "async_block", "hpcml_save")
        ratio("async_block_vs_memcpy", "async_block", "memcpy")
        ratio("memcpy_vs_sync", "memcpy", "hpcml_save")  # the floor of a copying snapshot, against the target
        ratio("async_total_vs_sync", "async_total", "hpcml_save")
        ratio("save_write_share", "hpcml_save_write", "hpcml_save")
        for lib in ("hpcml", "dcp"):  # speed as a fraction of the disk's (limit seconds / its seconds)
            for lim in ("direct", "fsync"):
                ratio(f"{lib}_save_vs_limit_{lim}", f"limit_write_{lim}", f"{lib}_save")
            for lim in ("direct", "cold"):
                ratio(f"{lib}_load_vs_limit_{lim}", f"limit_read_{lim}", f"{lib}_load")
        ratio("reshard_load_vs_limit_cold", "limit_read_cold", "hpcml_reshard_load")
        for kind, lims in (("write", ("limit_write_direct", "limit_write_fsync")),
                           ("read", ("limit_read_direct", "limit_read_cold"))):
            have = [s[k] for k in lims if k in s]  # the disk limit: the faster way, repetition by repetition
            if have:
                s[f"limit_{kind}_best"] = [min(x) for x in zip(*have)]
        for lib in ("hpcml", "dcp"):
            ratio(f"{lib}_save_vs_limit", "limit_write_best", f"{lib}_save")
            ratio(f"{lib}_load_vs_limit", "limit_read_best", f"{lib}_load")
        ratio("limit_write_direct_vs_fsync", "limit_write_fsync", "limit_write_direct")
        ratio("key_save_overhead", "hpcml_key_save", "hpcml_save", minus_one=True)
        ratio("key_load_overhead", "hpcml_key_load", "hpcml_load", minus_one=True)
        ratio("key_load_warm_overhead", "hpcml_key_load_warm", "hpcml_load_warm", minus_one=True)
        ratio("key_work_vs_save", "key_work", "hpcml_save")
        if use_key:  # the key's extra CPU seconds (all ranks) as a fraction of the plain wall time
            for what in ("save", "load", "load_warm"):
                plain = "hpcml_load_warm" if what == "load_warm" else f"hpcml_{what}"
                keyed = "hpcml_key_load_warm" if what == "load_warm" else f"hpcml_key_{what}"
                ratios[f"key_{what}_cpu_overhead"] = [(kc - pc) / world / pw for kc, pc, pw in
                                                      zip(s[keyed + "_cpu"], s[plain + "_cpu"], s[plain])]
        ratio("single_file_vs_save", "hpcml_save", "hpcml_single_save")
        ratio("dcp_async_block_vs_async_block", "dcp_async_block", "async_block")
        ratio("async_overlap_block_vs_sync", "step_during_async_overlap_block", "hpcml_save")  # overlap=True: the plan
        for which in ("", "_overlap"):  # what a training step running beside the write loses, per sync save
            if "step" in s:
                ratios[f"async{which}_step_cost_vs_sync"] = [
                    max(0.0, with_ - alone) / sync
                    for with_, alone, sync in zip(s[f"step_during_async{which}"], s["step"], s["hpcml_save"])]
        ratio("crc32_vs_save", "crc32", "hpcml_save")
        ratio("verify_vs_load", "verify", "hpcml_load")

        gbps_of = ["hpcml_save", "dcp_save", "limit_write_direct", "limit_write_fsync", "limit_write_best",
                   "hpcml_key_save", "hpcml_single_save", "hpcml_load", "dcp_load", "hpcml_reshard_load",
                   "limit_read_direct", "limit_read_cold", "limit_read_best", "hpcml_key_load"]
        targets = {t.ratio: t.judge(ratios[t.ratio]) for t in TARGETS if t.ratio in ratios}
        out = {
            "benchmark": "ckpt_vs_dcp", "ranks": world, "state_bytes": state_bytes, "bytes_per_rank": local_bytes,
            "limit_bytes": limit_bytes, "tensors": len(state), "tensor_shape": [rows, cols], "repeats": repeats,
            "order": order, "seed": args.seed, "caches_dropped": caches_dropped,
            "o_direct": o_direct, "values_equal": values_equal, "checks": checks,
            "key": ("signed" if use_key else "not available") if args.key else "not measured",
            "read_amplification": {k: v for k, v in amp.items() if k != "w"},
            "async_reserve_s": reserve_s,
            "loadavg_1min": {**spread(loadavg), "samples": loadavg},
            "seconds": {k: spread(v) for k, v in s.items()},
            "gbps": {k: spread([gb / x for x in s[k]]) for k in gbps_of if k in s},
            "ratios": {k: {**spread(v), "samples": v} for k, v in ratios.items()},
            "targets": targets,
            "samples_s": s,
        }
        if args.json:
            print(json.dumps(out))
        else:
            print(report(out))
    dist.destroy_process_group()


def report(out: dict) -> str:
    """The JSON as tables: seconds (and GB/s), ratios, targets with pass/fail."""
    def f(x, nd=3):
        return "—" if x is None else f"{x:.{nd}f}"

    lines = [f"ckpt_vs_dcp: {out['ranks']} ranks, {out['state_bytes'] / 2**30:.2f} GiB of state, "
             f"{out['repeats']} repetitions (median [min-max]); load average {f(out['loadavg_1min']['median'], 2)} "
             f"[{f(out['loadavg_1min']['min'], 2)}-{f(out['loadavg_1min']['max'], 2)}]; caches dropped: "
             f"{out['caches_dropped']}; O_DIRECT: {out['o_direct']}; values equal: {out['values_equal']}; "
             f"key: {out['key']}", "",
             "| target (issue 24) | median | min | max | bound | pass | met in |", "|---|---|---|---|---|---|---|"]
    for k, t in out["targets"].items():
        lines.append(f"| {t['text']} | {f(t['median'])} | {f(t['min'])} | {f(t['max'])} | {t['target']} | "
                     f"{'PASS' if t['pass'] else 'FAIL'} | {t['met_in']} of {t['of']} |")
    if out["key"] == "not available":
        lines.append("| a key adds <= 2% to save and load | key: not available | | | | | |")
    lines += ["", "| figure | median s | min s | max s | median GB/s |", "|---|---|---|---|---|"]
    for k, v in out["seconds"].items():
        g = out["gbps"].get(k, {}).get("median")
        lines.append(f"| {k} | {f(v['median'])} | {f(v['min'])} | {f(v['max'])} | {f(g)} |")
    lines += ["", "| ratio (per repetition) | median | min | max | target | pass | met in |",
              "|---|---|---|---|---|---|---|"]
    for k, v in out["ratios"].items():
        t = out["targets"].get(k)
        verdict = ("PASS" if t["pass"] else "FAIL") if t else ""
        met = f"{t['met_in']} of {t['of']}" if t else ""
        lines.append(f"| {k} | {f(v['median'])} | {f(v['min'])} | {f(v['max'])} | {t['target'] if t else ''} | "
                     f"{verdict} | {met} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
