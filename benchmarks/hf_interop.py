"""Hugging Face interop: export time, and import time and bytes read per rank against the model's size.

    python benchmarks/hf_interop.py --preset small --json                        # 1 rank reads it all
    mpiexec -n 2 python benchmarks/hf_interop.py --preset small --tp 2 --json
    mpiexec -n 2 python benchmarks/hf_interop.py --preset megatron-1.7b --dtype bfloat16 --fsdp --json

Rank 0 writes an hpcml checkpoint of the model (weights only, as the Trainer would with its
``extra["model"]``) and exports it (``export_hf``: read the checkpoint, split / permute,
write safetensors). Then every rank builds the model on the layout (``--tp``, ``--pp``,
``--fsdp``; dp takes the rest) and reads its own pieces from the HF directory
(``load_hf_into``). The limit: reading the HF files once (``state_bytes``), so the sum of
``bytes_read`` over ranks / ``state_bytes`` is 1 plus what is replicated (norms under tp),
and one rank's share is 1/ranks of it. ``disk_read_s``: one sequential read of the files
(16 MiB blocks), the time the bytes alone take. Page caches are dropped before each read
where the kernel allows it (``caches_dropped``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_vs_dcp import drop_caches, parse_io_args  # noqa: E402


def empty_model(cfg, dtype):
    """The model with uninitialised weights (what import overwrites), fast: built on meta, then allocated."""
    import torch

    from hpcml.models.transformer import Transformer, rope_tables

    torch.set_default_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    torch.set_default_dtype(torch.float32)
    model.to_empty(device="cpu")
    model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def read_once(path: Path) -> float:
    t0 = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
    return time.perf_counter() - t0


def idle_wait(comm) -> None:
    """A barrier that sleeps: waiting ranks leave the 2 cores to the one working."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--fsdp", action="store_true", help="shard every parameter over dp (FSDP2)")
    args = parse_io_args(p)

    import torch
    from mpi4py import MPI

    from hpcml import ckpt
    from hpcml.grid import Layout, ProcessGrid
    from hpcml.models.transformer import TransformerConfig
    from hpcml.interop.hf import export_hf, load_hf_into
    from hpcml.models.transformer.parallelize import TransformerPlan
    from hpcml.parallel import ParallelConfig, parallelize

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    dtype = getattr(torch, args.dtype)
    untie = {"tie_embeddings": False} if args.tp > 1 or args.pp > 1 else {}
    cfg = TransformerConfig.preset(args.preset, **untie)
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcml-hf-", dir=args.dir) if rank == 0 else None))
    result: dict = {"preset": args.preset, "dtype": args.dtype, "params": cfg.num_params(), "ranks": comm.size}
    if rank == 0:
        model = empty_model(cfg, dtype)
        with torch.no_grad():
            for p_ in model.parameters():
                p_.normal_(0, 0.02)
        ckpt.save(base / "ck", 1, ckpt.training_tensors(model.named_parameters(), None), comm=MPI.COMM_SELF,
                  extra={"model": cfg.describe()}, tensor_attrs=TransformerPlan(cfg).tensor_attrs())
        del model
        result["caches_dropped"] = drop_caches()
        out = export_hf(base / "ck" / "step_00000001", base / "hf")
        result["export"] = {"seconds": out["seconds"], "read_seconds": out["read_seconds"], "bytes": out["bytes"],
                            "files": len(out["files"]),
                            "GB_per_s": out["bytes"] / out["seconds"] / 1e9}
        drop_caches()
        result["disk_read_s"] = read_once(base / "hf")
    idle_wait(comm)

    layout = Layout.from_degrees(comm.size, {"tp": args.tp, "pp": args.pp})
    grid = ProcessGrid(layout)
    grid.init_torch()
    n_micro = max(layout.pp, 1)
    pmodel = parallelize(empty_model(cfg, dtype), grid, ParallelConfig(fsdp=args.fsdp), n_microbatches=n_micro)
    if rank == 0:
        drop_caches()
    idle_wait(comm)
    report = load_hf_into(pmodel, base / "hf")
    reads, seconds = comm.gather(report.bytes_read), comm.gather(report.seconds)
    if rank == 0:
        result["layout"] = {**layout.degrees, "fsdp": args.fsdp}
        result["import"] = {"seconds_max": max(seconds), "bytes_read_per_rank": reads, "state_bytes": report.hf_bytes,
                            "read_ratio_total": sum(reads) / report.hf_bytes,
                            "read_ratio_max_rank": max(reads) / report.hf_bytes,
                            "GB_per_s": sum(reads) / max(seconds) / 1e9}
        shutil.rmtree(base)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)
    comm.Barrier()
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
