"""Sections of ``benchmarks/gpu.py`` around training: NCCL/RCCL bring-up from MPI against
plain torch.distributed (``bringup_hpcml``, ``bringup_torch``), the async checkpoint save from
device memory against the disk and torch DCP's ``async_save`` (``ckpt``), and the
FieldTrainer on the device against the CPU (``field_gpu``, ``field_cpu``)."""

from __future__ import annotations

import datetime
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_common import accelerator, device_count, device_name, emit, make_grid, ratio, sync, timed, transformer_config


def _first_and_warm_allreduce(dist, device) -> tuple[float, float, bool]:
    """Seconds of the first all-reduce (where a lazy communicator is built), the median of
    ten more, and whether the first summed correctly."""
    import torch

    x = torch.ones(1, device=device)
    sync(device)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    sync(device)
    first = time.perf_counter() - t0
    ok = float(x.item()) == dist.get_world_size()
    warm = timed(lambda: dist.all_reduce(x), device, warmup=0, repeat=10)["median_s"]
    return first, warm, ok


def _device_index(local_rank: int) -> int:
    """The device hpcml binds this local rank to (with the site's ``HPCML_GPU_MAP`` where this
    hpcml reads one), so both bring-ups open the same device."""
    from hpcml import env

    gpu_map = getattr(env, "gpu_map", None)
    if gpu_map is not None:
        return env.device_index(local_rank, device_count(), gpu_map())
    return env.device_index(local_rank, device_count())


def _context(torch, kind: str | None, index: int, smoke: bool):
    """Create this rank's device context first, so the figures below exclude it; (device, seconds)."""
    if kind is None or smoke:
        return torch.device("cpu"), 0.0
    device = torch.device(kind, index)
    t0 = time.perf_counter()
    getattr(torch, kind).set_device(device)
    torch.empty(1, device=device)
    sync(device)
    return device, time.perf_counter() - t0


def bringup_hpcml(spec: dict) -> None:
    """(d) hpcml's path: MPI, ProcessGrid, ``init_torch`` (rendezvous address broadcast by MPI,
    backend init with ``device_id``, DeviceMesh), first all-reduce. Slowest rank's figures."""
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    t0 = time.perf_counter()
    from mpi4py import MPI

    t_mpi = time.perf_counter() - t0
    import numpy as np
    import torch.distributed as dist

    from hpcml.grid import ProcessGrid, install_abort_handler

    install_abort_handler()
    t0 = time.perf_counter()
    grid = ProcessGrid()
    t_grid = time.perf_counter() - t0
    kind = accelerator()
    index = _device_index(grid.local_rank) if kind else 0
    _, t_ctx = _context(torch, kind, index, spec["smoke"])
    t0 = time.perf_counter()
    td = grid.init_torch(backend="gloo" if spec["smoke"] else None)
    t_init = time.perf_counter() - t0
    first, warm, ok = _first_and_warm_allreduce(dist, td.device)
    mine = np.array([t_torch, t_mpi, t_grid, t_ctx, t_init, first, warm, 0.0 if ok else 1.0])
    worst = np.empty_like(mine)
    grid.comm.Allreduce(mine, worst, op=MPI.MAX)
    worst = worst.tolist()
    emit(grid.rank, {"status": "ok", "ranks": grid.world_size, "backend": td.backend, "device": device_name(td.device),
                     "import_torch_s": worst[0], "mpi_init_s": worst[1], "process_grid_s": worst[2],
                     "device_context_s": worst[3], "init_torch_s": worst[4], "first_allreduce_s": worst[5],
                     "allreduce_s": worst[6], "allreduce_correct": worst[7] == 0,
                     "bringup_s": worst[1] + worst[2] + worst[4] + worst[5]})


def bringup_torch(spec: dict) -> None:
    """(d) The peer: plain ``init_process_group`` with a file rendezvous (rank and size from
    the launcher's variables, no MPI), same backend and ``device_id``, first all-reduce."""
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist

    t_torch = time.perf_counter() - t0
    from hpcml import env

    le = env.detect()
    kind = accelerator()
    device, t_ctx = _context(torch, kind, _device_index(le.local_rank) if kind else 0, spec["smoke"])
    backend = "gloo" if device.type == "cpu" else ("nccl" if kind == "cuda" else "xccl")
    t0 = time.perf_counter()
    dist.init_process_group(backend=backend, init_method=f"file://{spec['rendezvous']}", rank=le.rank,
                            world_size=le.world_size, device_id=device if device.type != "cpu" else None,
                            timeout=datetime.timedelta(seconds=120))  # no MPI to abort a rank left waiting
    t_init = time.perf_counter() - t0
    first, warm, ok = _first_and_warm_allreduce(dist, device)
    worst = torch.tensor([t_torch, t_ctx, t_init, first, warm, 0.0 if ok else 1.0], dtype=torch.float64,
                         device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    w = worst.tolist()
    emit(le.rank, {"status": "ok", "ranks": le.world_size, "backend": backend, "device": device_name(device),
                   "import_torch_s": w[0], "device_context_s": w[1], "init_process_group_s": w[2],
                   "first_allreduce_s": w[3], "allreduce_s": w[4], "allreduce_correct": w[5] == 0,
                   "bringup_s": w[2] + w[3]})
    dist.destroy_process_group()


def disk_write(path: Path, nbytes: int) -> tuple[float, str]:
    """The disk's write rate (GB/s) for at least ``nbytes``: ``dd bs=16M conv=fsync`` (or the
    same in Python without dd) -- the physical limit of any save to this directory."""
    bs = 16 << 20
    count = max(1, math.ceil(nbytes / bs))
    t0 = time.perf_counter()
    if shutil.which("dd"):
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "conv=fsync"],
                       capture_output=True, check=True)
        how = f"dd if=/dev/zero bs=16M count={count} conv=fsync"
    else:
        block = os.urandom(bs)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(count):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        how = f"os.write 16 MiB x {count} + fsync"
    seconds = time.perf_counter() - t0
    path.unlink()
    return count * bs / 1e9 / seconds, how


def fs_type(path: Path) -> str:
    """The file system ``path`` is on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fs = line.split()[:3]
                if str(path.resolve()).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                    best, kind = mnt, fs
    except OSError:
        pass
    return kind


def _d2h_gbps(state: dict, device, probe_gib: float) -> tuple[float, float | None]:
    """Device-to-host copy rates of the whole state into pageable memory (second pass: pages
    touched) and of a ``probe_gib`` probe into pinned memory (None on the CPU): what a staging
    buffer that is pinned would give."""
    import torch

    tensors = [v for v in state.values() if v.numel()]
    dst = [torch.empty(v.shape, dtype=v.dtype) for v in tensors]
    nbytes = sum(v.numel() * v.element_size() for v in tensors)
    t = timed(lambda: [d.copy_(v) for d, v in zip(dst, tensors)], device, warmup=1, repeat=1)["best_s"]
    dst.clear()
    pinned = None
    if device.type != "cpu":
        n = max(1 << 20, min(nbytes, int(probe_gib * 2**30)))
        src = torch.empty(n, dtype=torch.uint8, device=device)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pinned = n / 1e9 / timed(lambda: host.copy_(src), device, warmup=1, repeat=3)["best_s"]
        del src, host
    return nbytes / 1e9 / t, pinned


def _dcp_async(state: dict, path: Path) -> tuple[float, float]:
    """torch DCP's ``async_save`` on a gloo group (it needs a CPU backend): (blocking, total) seconds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = dist.new_group(backend="gloo")
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=str(path), process_group=group)
    block = time.perf_counter() - t0
    (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
    return block, time.perf_counter() - t0


def ckpt(spec: dict) -> None:
    """(e) hpcml's AsyncSaver on the ~1B model's state in device memory (parameters, and AdamW's
    moments with ``ckpt_state`` train): blocking time and total of a first and a second save,
    against a synchronous hpcml save, the device-to-host copy, the disk and DCP's async_save."""
    import torch

    from hpcml import ckpt as hckpt
    from hpcml.models.transformer import Transformer

    grid = make_grid(spec)
    device = grid.torch.device
    torch.manual_seed(0)
    model = Transformer(transformer_config(spec["model_size"], spec["seq_len"])).to(device)
    opt = torch.optim.AdamW(model.parameters()) if spec["ckpt_state"] == "train" else None
    state = hckpt.training_tensors(model.named_parameters(), opt, create=True)
    for name, t in state.items():
        if name.endswith(("exp_avg", "exp_avg_sq")):
            t.normal_()  # not zeros: no filesystem may compress them away
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gb = nbytes / 1e9
    base = Path(tempfile.mkdtemp(prefix="hpcml-gpu-bench-", dir=spec.get("dir")))
    out: dict[str, Any] = {"device": device_name(device), "state": spec["ckpt_state"], "tensors": len(state),
                           "state_bytes": nbytes, "dir": str(base), "dir_fs": fs_type(base)}
    try:
        free = shutil.disk_usage(base).free
        if free < 2.2 * nbytes:  # the second async save writes while the first is still there
            raise OSError(f"{base} has {free / 1e9:.1f} GB free; the saves need {2.2 * nbytes / 1e9:.1f} GB: "
                          f"pass --dir")
        saver = hckpt.AsyncSaver(grid.comm)
        t0 = time.perf_counter()
        saver.reserve(state)  # as CheckpointHook does at the start of training; pages fill meanwhile
        out["async_reserve_s"] = time.perf_counter() - t0
        out["d2h_pageable_gbps"], out["d2h_pinned_gbps"] = _d2h_gbps(state, device, spec["d2h_probe_gib"])
        out["disk_write_gbps"], out["disk_method"] = disk_write(base / "dd", nbytes)
        t0 = time.perf_counter()
        hckpt.save(base / "sync", 1, state, comm=grid.comm)
        out["sync_save_s"] = time.perf_counter() - t0
        shutil.rmtree(base / "sync", ignore_errors=True)
        for i, label in ((1, "first"), (2, "second")):
            t0 = time.perf_counter()
            blocked = saver.save(base / "async", i, state, keep=1)
            sync(device)
            out[f"async_block_{label}_s"] = max(blocked, time.perf_counter() - t0)
            result = saver.wait()
            out[f"async_total_{label}_s"] = time.perf_counter() - t0
            out[f"async_writer_{label}_gbps"] = ratio(result.bytes_written / 1e9, result.write_seconds)
        saver.close()
        shutil.rmtree(base / "async", ignore_errors=True)
        out["dcp_async_block_s"], out["dcp_async_total_s"] = _dcp_async(state, base / "dcp")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    block = out["async_block_second_s"]
    out.update({"sync_save_gbps": gb / out["sync_save_s"], "async_total_gbps": gb / out["async_total_second_s"],
                "dcp_async_total_gbps": gb / out["dcp_async_total_s"]})
    out.update({
        "async_block_vs_sync": block / out["sync_save_s"],
        "async_block_vs_d2h": block / (gb / out["d2h_pageable_gbps"]),
        "async_block_vs_dcp_block": block / out["dcp_async_block_s"],
        "async_total_vs_disk": out["async_total_gbps"] / out["disk_write_gbps"],
        "sync_save_vs_disk": out["sync_save_gbps"] / out["disk_write_gbps"],
        "async_total_vs_dcp_total": out["dcp_async_total_s"] / out["async_total_second_s"]})
    emit(grid.rank, {"status": "ok", **out})


def field(spec: dict, on: str) -> None:
    """(f) The FieldTrainer (MLP surrogate, one rank) for ``field_steps`` steps after 3 warm-up
    steps, on the device (``gpu``) or the CPU (``cpu``, every core): samples/s."""
    import numpy as np
    import torch

    from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
    from hpcml.stream.buffer import Sample
    from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer

    grid = make_grid(spec, cpu=on == "cpu")
    device = grid.torch.device
    nx, b, n = spec["field_nx"], spec["field_batch"], spec["field_steps"]
    rng = np.random.default_rng(0)
    batch = [Sample(sim=i, step=i, t=float(rng.random()), params=rng.random(4).astype(np.float32),
                    fields=rng.random((1, nx, nx)).astype(np.float32)) for i in range(b)]
    scales = FieldScales(param_lo=(0.0,) * 4, param_hi=(1.0,) * 4, t_max=1.0)
    cfg = MLPSurrogateConfig(n_params=4, shape=(nx, nx), hidden=spec["field_hidden"], depth=3)
    torch.manual_seed(0)
    model = MLPSurrogate(cfg)
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=10**6, batch=b, progress=False), scales)
    for _ in range(3):  # warm-up: kernels chosen, memory pools grown
        trainer.train_step(batch)
    t = timed(lambda: [trainer.train_step(batch) for _ in range(n)], device, warmup=0, repeat=1)["best_s"]
    emit(grid.rank, {"status": "ok", "device": device_name(device), "threads": torch.get_num_threads(),
                     "params": sum(p.numel() for p in model.parameters()), "field": [nx, nx], "batch": b,
                     "steps": n, "step_s": t / n, "samples_per_s": b * n / t,
                     "final_loss": trainer.history[-1]["loss"]})
