"""hpcml HDF5 checkpoints vs torch.distributed.checkpoint (DCP) vs the disk, in one run.

    mpiexec -n 2 python benchmarks/ckpt_vs_dcp.py --json            # 2 GiB of state by default
    mpiexec -n 2 python benchmarks/ckpt_vs_dcp.py --gib 0.25 --json

The state is what FSDP leaves on each rank: a model's parameters and AdamW's two moments
as DTensors sharded on dim 0 over all ranks (1/3 parameters, 2/3 optimizer state). Both
libraries save it, then load it into the same sharding, and hpcml also loads it resharded
(dim 1), and hpcml's collective single-file (MPI-IO) save. Async: blocking time of hpcml's
AsyncSaver (the staging copy; and, with the copy overlapping a synthetic training step,
that step's extra wall time) vs the synchronous save, vs a memcpy of the same bytes and vs
torch DCP's async_save. The limit:
``dd bs=16M conv=fsync`` of the same number of bytes per rank, all ranks at once. Page
caches are dropped before loads where the kernel allows it (``caches_dropped`` says).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def parse_io_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The options every checkpoint benchmark shares (--dir, --json), then parse."""
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args()


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="total state over all ranks, GiB")
    p.add_argument("--repeats", type=int, default=2, help="cold loads of each kind, alternating; the best counts")
    args = parse_io_args(p)

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

    cols = 4096
    rows_total = int(args.gib * 2**30 / 4 / cols / 3)  # per parameter, 3 tensors each (param, exp_avg, exp_avg_sq)
    n_params = 8
    rows = max(world * 2, rows_total // n_params // (world * 2) * (world * 2))
    torch.manual_seed(0)

    def make(placement):
        state = {}
        for i in range(n_params):
            for kind in ("model/w{}", "optim/w{}/exp_avg", "optim/w{}/exp_avg_sq"):
                full = torch.randn(rows, cols) if rank == 0 else torch.empty(rows, cols)
                state[kind.format(i)] = distribute_tensor(full, mesh, [placement], src_data_rank=0)
        return state

    state = make(Shard(0))
    state_bytes = sum(t.numel() * 4 for t in state.values())
    local_bytes = state_bytes // world

    def timed(fn):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        comm.Barrier()
        return time.perf_counter() - t0, out

    # the physical limit: every rank writes its share with dd + fsync at once
    dd_file = base / f"dd_{rank}"
    dd_s, _ = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={dd_file}", "bs=16M",
                                            f"count={max(1, local_bytes // 2**24)}", "conv=fsync"],
                                           capture_output=True, check=True))
    dd_bytes = max(1, local_bytes // 2**24) * 2**24 * world
    dd_file.unlink()

    hp_save_s, _ = timed(lambda: ckpt.save(base / "hpcml", 1, state, comm=comm))
    dcp_save_s, _ = timed(lambda: dcp.save(state, checkpoint_id=str(base / "dcp")))
    single_save_s, _ = timed(lambda: ckpt.save(base / "hpcml_single", 1, state, comm=comm, single_file=True))

    # cold loads, caches dropped before each: hpcml same layout, DCP, hpcml resharded, in turn
    # (--repeats rounds; the best of each kind counts, and every sample is in the JSON)
    same = {k: torch.zeros_like(v) for k, v in state.items()}
    same2 = {k: torch.zeros_like(v) for k, v in state.items()}
    resharded = {k: distribute_tensor(torch.zeros(rows, cols), mesh, [Shard(1)]) for k in state}
    dropped = comm.allreduce(int(drop_caches()), op=MPI.MIN) == 1
    samples: dict[str, list[float]] = {"hpcml_same": [], "dcp": [], "hpcml_reshard": []}
    for _ in range(max(1, args.repeats)):
        drop_caches()
        s_, report = timed(lambda: ckpt.load(base / "hpcml", same, comm=comm))
        samples["hpcml_same"].append(s_)
        drop_caches()
        s_, _ = timed(lambda: dcp.load(same2, checkpoint_id=str(base / "dcp")))
        samples["dcp"].append(s_)
        drop_caches()
        s_, rreport = timed(lambda: ckpt.load(base / "hpcml", resharded, comm=comm))
        samples["hpcml_reshard"].append(s_)
    hp_load_s, dcp_load_s, reshard_s = (min(samples[k]) for k in ("hpcml_same", "dcp", "hpcml_reshard"))
    ok_same = all(torch.equal(same[k].to_local(), state[k].to_local()) for k in state)
    ok_dcp = all(torch.equal(same2[k].to_local(), state[k].to_local()) for k in state)
    ok_reshard = all(torch.equal(resharded[k].full_tensor(), state[k].full_tensor()) for k in list(state)[:3])
    del resharded, same, same2

    # the cost of each integrity check, on this rank's bytes as they sit in memory (the save
    # takes the CRC-32 of each chunk while it writes it, the load as it reads it; the metadata
    # SHA-256 and the manifest check are per file) and a full `hpcml ckpt verify` (cold)
    import zlib

    from hpcml.ckpt import tools
    from hpcml.ckpt.checked import Checkpoint

    mine = [memoryview(v.to_local().numpy()).cast("B") for v in state.values()]
    crc_s, _ = timed(lambda: [zlib.crc32(m[i:i + (1 << 20)]) for m in mine for i in range(0, len(m), 1 << 20)])
    del mine
    manifest_s, _ = timed(lambda: Checkpoint(base / "hpcml").close())
    drop_caches()
    verify_s, problems = timed(lambda: tools.verify(base / "hpcml") if rank == 0 else [])
    assert not problems, problems

    saver = ckpt.AsyncSaver(comm)
    reserve_s, _ = timed(lambda: saver.reserve(state))  # as CheckpointHook does at the start of training
    time.sleep(5.0)  # training runs before the first save; the staging buffer fills its pages meanwhile
    async_block_s, _ = timed(lambda: saver.save(base / "hpcml_async", 1, state))
    # training would run here; the writer process works meanwhile
    async_total_s, _ = timed(lambda: saver.wait())
    async_total_s += async_block_s
    async_block2_s, _ = timed(lambda: saver.save(base / "hpcml_async", 2, state, keep=1))  # steady state
    saver.wait()
    # overlap: the copy runs beside a training step's forward and backward (here a matmul
    # loop of about the sync save's length); what counts is the step's extra wall time
    a = torch.randn(512, 512)
    t_mm = time.perf_counter()
    for _ in range(20):
        a @ a
    reps = comm.allreduce(max(1, int(hp_save_s / ((time.perf_counter() - t_mm) / 20))), op=MPI.MIN)

    def step():
        for _ in range(reps):
            a @ a

    step_s, _ = timed(step)
    blocked = []

    def step_during_save(overlap: bool):
        blocked.append(saver.save(base / "hpcml_async", 3 + overlap, state, keep=1, overlap=overlap))
        step()
        saver.wait_staged()  # before the optimizer step

    plain_s, _ = timed(lambda: step_during_save(False))
    saver.wait()
    overlapped_s, _ = timed(lambda: step_during_save(True))
    saver.close()
    # what a training step running while a save is written loses: the copy (unless
    # overlapped) plus the writer process's CPU time where cores are shared
    plain_cost_s, overlap_cost_s = max(0.0, plain_s - step_s), max(0.0, overlapped_s - step_s)
    overlap_block_s = comm.allreduce(blocked[1], op=MPI.MAX)
    # the peer: torch DCP's async_save (its default: stage to host memory, write in a thread)
    fut = None

    def dcp_async():
        nonlocal fut
        fut = dcp.async_save(state, checkpoint_id=str(base / "dcp_async"))

    dcp_async_block_s, _ = timed(dcp_async)
    dcp_async_total_s, _ = timed(lambda: fut.result())
    dcp_async_total_s += dcp_async_block_s
    if rank == 0:
        shutil.rmtree(base / "dcp_async", ignore_errors=True)
    # the limit of a blocking snapshot: one memcpy of this rank's bytes into warm memory
    local = [v.to_local() for v in state.values()]
    dst = [torch.empty_like(t) for t in local]
    for d, t in zip(dst, local):
        d.copy_(t)
    memcpy_s, _ = timed(lambda: [d.copy_(t) for d, t in zip(dst, local)])
    del dst, local

    all_ok = comm.allreduce(int(ok_same and ok_dcp and ok_reshard), op=MPI.MIN) == 1
    amp = comm.allreduce(report.read_amplification, op=MPI.MAX)
    ramp = comm.allreduce(rreport.read_amplification, op=MPI.MAX)
    if rank == 0:
        gb = state_bytes / 1e9
        out = {
            "benchmark": "ckpt_vs_dcp", "ranks": world, "state_bytes": state_bytes, "tensors": len(state),
            "tensor_shape": [rows, cols], "caches_dropped": dropped, "values_equal": all_ok,
            "disk_write_gbps": dd_bytes / 1e9 / dd_s,
            "hpcml_save_s": hp_save_s, "hpcml_save_gbps": gb / hp_save_s,
            "dcp_save_s": dcp_save_s, "dcp_save_gbps": gb / dcp_save_s,
            "hpcml_single_file_save_gbps": gb / single_save_s,
            "hpcml_load_gbps": gb / hp_load_s, "dcp_load_gbps": gb / dcp_load_s,
            "same_layout_load_s": hp_load_s, "dcp_load_s": dcp_load_s, "reshard_load_s": reshard_s,
            "load_samples_s": samples,
            "sync_save_s": hp_save_s, "async_reserve_s": reserve_s, "async_block_s": async_block_s,
            "async_block_second_s": async_block2_s, "async_total_s": async_total_s, "memcpy_s": memcpy_s,
            "dcp_async_block_s": dcp_async_block_s, "dcp_async_total_s": dcp_async_total_s,
            "async_overlap_block_s": overlap_block_s, "async_overlap_step_cost_s": overlap_cost_s,
            "async_step_cost_s": plain_cost_s,
            "step_s": step_s,
            "read_amplification_same": amp, "read_amplification_reshard": ramp,
            "crc32_s": crc_s, "manifest_check_s": manifest_s, "verify_s": verify_s,
            "ratios": {"save_vs_dcp": dcp_save_s / hp_save_s, "save_vs_disk": (gb / hp_save_s) / (dd_bytes / 1e9 / dd_s),
                       "load_vs_dcp": dcp_load_s / hp_load_s, "reshard_vs_same_layout": reshard_s / hp_load_s,
                       "async_block_vs_sync": async_block_s / hp_save_s,
                       "async_block_second_vs_sync": async_block2_s / hp_save_s,
                       "async_block_vs_memcpy": async_block_s / memcpy_s,
                       "async_block_vs_dcp_async_block": async_block_s / dcp_async_block_s,
                       "async_step_cost_vs_sync": plain_cost_s / hp_save_s,
                       "async_overlap_step_cost_vs_sync": overlap_cost_s / hp_save_s,
                       "crc32_vs_save": crc_s / hp_save_s, "crc32_vs_load": crc_s / hp_load_s,
                       "verify_vs_load": verify_s / hp_load_s},
        }
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
