"""GPU readiness in one command: every figure only a GPU gives, each beside its peer and its limit.

    make bench-gpu                                   # = python benchmarks/gpu.py --json
    python benchmarks/gpu.py --json --sections mfu moe --steps 20
    python benchmarks/gpu.py --json --model-size small --peak-tflops 989.4

Sections (``--sections``; each runs in worker processes of its own, so an out-of-memory, a
crash or a hung collective costs that section only):

* ``mfu`` (a): the ~1B transformer (TinyLlama-1.1B's shape) in bf16 autocast on one GPU with
  hpcml's Trainer: tokens/s, model TFLOP/s, MFU against the device's dense bf16 peak (table in
  gpu_common.py, keyed by the device name; an unknown device gets peak null, never a guess),
  the measured bf16 GEMM rate, and plain eager PyTorch on the same model and batch.
* ``fsdp``, ``tp2`` (b): FSDP2 over every GPU, and tp=2 (dp over the rest), same per-replica
  batch; scaling efficiency against ``mfu``. Skipped (not failed) with fewer than 2 GPUs.
* ``moe`` (c): one MoE feed-forward, experts as grouped GEMMs (and as a per-expert loop),
  against the dense SwiGLU of the same active FLOPs, forward + backward in bf16.
* ``bringup`` (d): NCCL/RCCL bring-up on every GPU the hpcml way (MPI, ProcessGrid,
  ``init_torch``, first all-reduce) against plain ``init_process_group`` (file rendezvous).
* ``ckpt`` (e): hpcml's AsyncSaver on the 1B model's parameters and AdamW moments in GPU memory
  against a synchronous save, the device-to-host copy, ``dd conv=fsync`` of the same bytes on
  the same disk (``--dir``) and torch DCP's ``async_save``.
* ``field`` (f): the FieldTrainer (MLP surrogate) on the GPU against the CPU, same steps.

Launch: the driver imports no MPI. One-rank sections run as plain ``python`` (an MPI
singleton); ``fsdp``, ``tp2`` and ``bringup`` run as ``$MPIEXEC -n N`` (default ``mpiexec``)
with N = ``torch.cuda.device_count()``: one rank per visible GPU (CUDA_VISIBLE_DEVICES limits
them). Run the driver itself without mpiexec.

Exit status: 0 when every section ran or was skipped; 1 when some failed (one line on stderr
names them; each one's error is in the JSON); 69 (sysexits' EX_UNAVAILABLE) without a GPU: one
line on stderr, nothing else; 2 for bad usage.

``--cpu-smoke`` (for tests; not in ``--help``): every section with tiny sizes on the CPU over
gloo, ``--smoke-ranks`` (default 2) standing in for the GPUs; the JSON says ``"smoke": true``:
its figures exercise the code paths and are not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_common import EX_UNAVAILABLE, FULL, NO_GPU, SMOKE  # noqa: E402

SECTIONS = ("mfu", "fsdp", "tp2", "moe", "bringup", "ckpt", "field")
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
SMOKE_NOTE = "SMOKE RUN on the CPU with tiny sizes: the code paths ran; the figures are not measurements"


def plan(sections: list[str], n: int, smoke: bool) -> list[tuple[str, str, int, dict, str | None]]:
    """(section, worker, ranks, extra environment, reason to skip or None) of every launch."""
    what = "ranks (--smoke-ranks)" if smoke else "GPUs"
    few = f"needs >= 2 {what}, {n} visible" if n < 2 else None
    odd = few or (f"needs an even number of {what}, {n} visible" if n % 2 else None)
    out = []
    for s in sections:
        if s in ("mfu", "moe", "ckpt"):
            out.append((s, s, 1, {}, None))
        elif s in ("fsdp", "tp2"):
            out.append((s, s, n, {}, few if s == "fsdp" else odd))
        elif s == "bringup":
            out += [(s, "bringup_hpcml", n, {}, None), (s, "bringup_torch", n, {}, None)]
        elif s == "field":
            out += [(s, "field_gpu", 1, {}, None), (s, "field_cpu", 1, HIDE_GPUS, None)]
    return out


def worker_env(extra: dict) -> dict:
    """The driver's environment without any MPI launcher's per-process variables (a worker is
    a job of its own), the repository on PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def parse_output(rc: int, out: str, err: str) -> dict:
    """The worker's last JSON line (its result, or the error a rank reported), else the tail of
    its stderr."""
    for line in reversed(out.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "status" in row:
            if rc and row["status"] == "ok":
                return {"status": "error", "error": f"worker exited {rc} after its result", **row}
            return row
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1] if lines else "(no output)"
    return {"status": "error", "error": f"exit {rc}: {last}", "stderr_tail": err[-1500:]}


def run_worker(worker: str, ranks: int, spec: dict, extra_env: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--spec", json.dumps(spec)]
    if ranks > 1:
        launcher = shlex.split(os.environ.get("MPIEXEC") or "mpiexec")
        if not shutil.which(launcher[0]):
            return {"status": "error", "error": f"{ranks} ranks need an MPI launcher: {launcher[0]!r} not found "
                                                f"(set MPIEXEC)"}
        cmd = [*launcher, "-n", str(ranks), *cmd]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(extra_env),
                            start_new_session=True)  # its own process group: a timeout ends every rank
    try:
        out, err = proc.communicate(timeout=timeout)
        row = parse_output(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                out, err = proc.communicate(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                out, err = "", ""
        row = {"status": "error", "error": f"timed out after {timeout:.0f} s (--timeout)", "stderr_tail": err[-1500:]}
    row["wall_s"] = time.perf_counter() - t0
    return row


def combine(results: dict[str, list[tuple[str, dict]]]) -> dict[str, dict]:
    """One entry per section (parts of two-worker sections under their worker names) and the
    ratios that need two results."""
    sections: dict[str, dict] = {}
    for name, parts in results.items():
        if len(parts) == 1:
            sections[name] = parts[0][1]
            continue
        bad = [f"{w}: {r.get('error') or r.get('reason')}" for w, r in parts if r["status"] != "ok"]
        sections[name] = {"status": "error" if bad else "ok", **({"error": "; ".join(bad)} if bad else {}),
                          **{w.split("_", 1)[1]: r for w, r in parts}}
    mfu = sections.get("mfu", {})
    for name in ("fsdp", "tp2"):
        sec = sections.get(name, {})
        if sec.get("status") == "ok" and mfu.get("status") == "ok":
            sec["scaling_efficiency"] = sec["tokens_per_s"] / (sec["ranks"] * mfu["tokens_per_s"])
    up = sections.get("bringup", {})
    if up.get("status") == "ok":
        up["hpcml_over_torch_bringup"] = up["hpcml"]["bringup_s"] / up["torch"]["bringup_s"]
        up["hpcml_over_torch_first_allreduce"] = up["hpcml"]["first_allreduce_s"] / up["torch"]["first_allreduce_s"]
    fld = sections.get("field", {})
    if fld.get("status") == "ok":
        fld["gpu_over_cpu"] = fld["gpu"]["samples_per_s"] / fld["cpu"]["samples_per_s"]
    return sections


def resolve_spec(args) -> dict:
    spec = dict(SMOKE if args.cpu_smoke else FULL)
    for key in ("model_size", "seq_len", "batch", "micro_batch", "steps", "repeat", "field_steps", "ckpt_state"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    spec.update({"smoke": args.cpu_smoke, "peak_tflops": args.peak_tflops, "dir": args.dir})
    return spec


def drive(args) -> int:
    if int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        print("benchmarks/gpu.py: run the driver alone, not under mpiexec: it launches its own ranks", file=sys.stderr)
        return 2
    import torch

    from gpu_common import accelerator, device_count

    if args.cpu_smoke:
        n = args.smoke_ranks
    else:
        if accelerator() is None:
            print(NO_GPU, file=sys.stderr)
            return EX_UNAVAILABLE
        n = device_count()
    spec = resolve_spec(args)
    t0 = time.perf_counter()
    results: dict[str, list[tuple[str, dict]]] = {}
    rdzv_dir = tempfile.mkdtemp(prefix="hpcml-gpu-rdzv-", dir=args.dir)
    try:
        for section, worker, ranks, extra, skip in plan(args.sections, n, args.cpu_smoke):
            if skip:
                row = {"status": "skipped", "reason": skip}
            else:
                wspec = {**spec, "rendezvous": os.path.join(rdzv_dir, f"{worker}.store")}
                row = run_worker(worker, ranks, wspec, HIDE_GPUS if args.cpu_smoke else extra, args.timeout)
            print(f"benchmarks/gpu.py: {worker}: {row['status']} {row.get('error') or row.get('reason') or ''}",
                  file=sys.stderr, flush=True)
            results.setdefault(section, []).append((worker, row))
    finally:
        shutil.rmtree(rdzv_dir, ignore_errors=True)
    sections = combine(results)
    failed = [s for s, r in sections.items() if r["status"] == "error"]
    out = {"benchmark": "gpu", "smoke": args.cpu_smoke, **({"note": SMOKE_NOTE} if args.cpu_smoke else {}),
           "devices": n, "torch": torch.__version__, "cuda": torch.version.cuda,
           "hip": getattr(torch.version, "hip", None), "spec": spec, "sections": sections, "failed": failed,
           "skipped": [s for s, r in sections.items() if r["status"] == "skipped"],
           "wall_s": time.perf_counter() - t0}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1), flush=True)
    if failed:
        print(f"benchmarks/gpu.py: failed sections: {', '.join(failed)} (errors in the JSON)", file=sys.stderr)
        return 1
    return 0


def worker(name: str, spec: dict) -> int:
    """Run one section on this rank; a failure prints a JSON error line, then aborts the job."""
    try:
        if name in ("mfu", "moe"):
            import gpu_train

            getattr(gpu_train, name)(spec)
        elif name in ("fsdp", "tp2"):
            import gpu_train

            gpu_train.parallel(spec, name)
        else:
            import gpu_io

            if name.startswith("field_"):
                gpu_io.field(spec, name.split("_", 1)[1])
            else:
                getattr(gpu_io, name)(spec)
        return 0
    except BaseException as e:  # noqa: BLE001 -- reported in the JSON, then the job ends
        import traceback

        from hpcml import env

        text = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        sys.stdout.write(json.dumps({"status": "error", "error": text, "rank": env.detect().rank}) + "\n")
        sys.stdout.flush()
        traceback.print_exc()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
            time.sleep(0.5)  # let the launcher forward the lines above
            mpi.COMM_WORLD.Abort(1)
        return 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                   help=f"which to run, of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--model-size", help="'1b' (default: TinyLlama-1.1B's shape) or an hpcml preset (small, ...)")
    p.add_argument("--steps", type=int, help=f"timed training steps (default {FULL['steps']}, after "
                                             f"{FULL['warmup_steps']} warm-up steps)")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {FULL['seq_len']})")
    p.add_argument("--batch", type=int, help=f"sequences per step per model replica (default {FULL['batch']})")
    p.add_argument("--micro-batch", type=int, help=f"sequences per forward (default {FULL['micro_batch']})")
    p.add_argument("--repeat", type=int, help=f"timed repeats of the MoE layers (default {FULL['repeat']})")
    p.add_argument("--field-steps", type=int, help=f"FieldTrainer steps on GPU and CPU (default {FULL['field_steps']})")
    p.add_argument("--ckpt-state", choices=["train", "params"], help="save parameters and AdamW moments (train, "
                                                                       "default) or parameters only")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one device, overriding the table")
    p.add_argument("--dir", help="where checkpoints and the disk test write (default: the temp dir)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per worker launch (default 600)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--smoke-ranks", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, json.loads(args.spec))
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
