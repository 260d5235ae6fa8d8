"""hpcml <-> torchtitan DCP conversion time vs the state's bytes and the disk, one process.

    python benchmarks/dcp_convert.py --json                    # ~1.1 GB of state (91M parameters)
    python benchmarks/dcp_convert.py --dim 256 --layers 2 --json

A Transformer and its AdamW state (parameters, exp_avg, exp_avg_sq: 12 bytes a parameter)
are saved as an hpcml checkpoint, converted to a torchtitan-layout DCP directory and back
(``hpcml.interop.torchtitan``), and the round trip is checked bitwise; the
reading half of each direction is timed alone (``read_hpcml_s``, ``read_dcp_s``). The
physical limit of a conversion is reading the state once and writing it once:
``dd bs=16M conv=fsync`` of the same bytes, then reading them back (page cache dropped
where the kernel allows it: ``caches_dropped``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_vs_dcp import drop_caches, parse_io_args  # noqa: E402


def disk_limit(base: Path, nbytes: int) -> tuple[float, float, bool]:
    """(seconds to write ``nbytes`` with fsync, seconds to read them back, caches dropped)."""
    f, count = base / "dd", max(1, nbytes // 2**24)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fsync"], capture_output=True,
                   check=True)
    write_s = time.perf_counter() - t0
    dropped = drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M"], capture_output=True, check=True)
    read_s = time.perf_counter() - t0
    f.unlink()
    scale = nbytes / (count * 2**24)
    return write_s * scale, read_s * scale, dropped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--fused", action="store_true", help="fused wqkv / w13 on the hpcml side")
    args = parse_io_args(p)

    import torch
    from mpi4py import MPI

    from hpcml import ckpt
    from hpcml.ckpt.dcp_safe import DcpReader
    from hpcml.models.transformer import Transformer, TransformerConfig
    from hpcml.interop import torchtitan as tt
    from hpcml.models.transformer.parallelize import TransformerPlan
    from hpcml.train.loop import LoopConfig, make_optimizer

    cfg = TransformerConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                            n_kv_heads=max(1, args.dim // 256), ffn_multiple=256, fused_qkv=args.fused,
                            fused_mlp=args.fused)
    torch.manual_seed(0)
    model = Transformer(cfg)
    loop = LoopConfig(steps=100)
    opt, sched = make_optimizer(model.parameters(), loop)
    for q in model.parameters():
        q.grad = torch.randn_like(q)
    opt.step()
    sched.step()
    tensors = ckpt.training_tensors(model.named_parameters(), opt)
    extra = {"step": 1, "scheduler": sched.state_dict(), "schedule": {"steps": loop.steps, "anchor": None},
             "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
             "train_config": {"global_batch": 8, "seq_len": 1024}, "model": cfg.describe()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    base = Path(tempfile.mkdtemp(prefix="hpcml-dcp-bench-", dir=args.dir))
    try:
        ckpt.save(base / "hpcml", 1, tensors, comm=MPI.COMM_SELF, extra=extra,
                  tensor_attrs=TransformerPlan(cfg).tensor_attrs())
        del model, opt, tensors
        write_s, read_s, dropped = disk_limit(base, nbytes)
        drop_caches()
        t0 = time.perf_counter()
        out = tt.to_dcp(base / "hpcml", base / "dcp", cfg)
        to_s = time.perf_counter() - t0
        drop_caches()
        t0 = time.perf_counter()
        back = tt.from_dcp(base / "dcp", base / "back", cfg)
        from_s = time.perf_counter() - t0
        drop_caches()
        t0 = time.perf_counter()  # the reading half of each direction alone
        a = ckpt.read_tensors(base / "hpcml", "")
        read_hpcml_s = time.perf_counter() - t0
        drop_caches()
        t0 = time.perf_counter()
        reader = DcpReader(base / "dcp")
        for key, entry in reader.entries.items():
            if entry.dtype is not None:
                reader.tensor(key)
        read_dcp_s = time.perf_counter() - t0
        b = ckpt.read_tensors(base / "back", "")
        exact = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        dcp_bytes = sum(f.stat().st_size for f in (base / "dcp").iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    limit = write_s + read_s
    result = {"params": cfg.num_params(), "state_bytes": nbytes, "dcp_bytes": dcp_bytes, "tensors": out.tensors,
              "to_dcp_s": round(to_s, 3), "from_dcp_s": round(from_s, 3), "limit_s": round(limit, 3),
              "read_hpcml_s": round(read_hpcml_s, 3), "read_dcp_s": round(read_dcp_s, 3),
              "disk_write_gbs": round(nbytes / write_s / 1e9, 3), "disk_read_gbs": round(nbytes / read_s / 1e9, 3),
              "to_dcp_x_limit": round(to_s / limit, 2), "from_dcp_x_limit": round(from_s / limit, 2),
              "to_dcp_gbs": round(nbytes / to_s / 1e9, 3), "from_dcp_gbs": round(nbytes / from_s / 1e9, 3),
              "round_trip_bitwise": exact, "caches_dropped": dropped, "fused": args.fused,
              "back_step": back.step, "cpus": os.cpu_count(), "torch": torch.__version__}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>18}: {v}")


if __name__ == "__main__":
    main()
