"""What a tournament's swap costs (issue 45): in memory between members of one layout, and
through checkpoints between members of different layouts, against the physical limits.

    mpiexec -n 4 python benchmarks/population_swap.py --json       # 2 members of 2 ranks

One model (``--dim``, ``--layers``), AdamW state created. Same layout: both members tp 2;
the swap is :func:`hpcml.train.population.transfer` (pack, one send and one receive per rank,
unpack). Its limit: the same bytes through one loopback socket pair's send and receive
(torch gloo, the transport the swap uses here) plus two copies (pack and unpack), timed as
the raw ``dist.batch_isend_irecv`` of a buffer of that size plus two ``copy_`` of it.
Different layouts: tp 2 against FSDP over dp 2; the swap is the tournament's save into
``--scratch`` (crash-safe: fsynced, committed by rename), the wait, and the load of the
partner's checkpoint resharded. Its limit: each rank writing its bytes with one ``write`` +
``fsync`` and reading the partner's file back (from the page cache, as the load does).
Median of ``--repeat``.
The last JSON line: ``state_mib_per_rank``, ``memory_swap_s``, ``memory_limit_s``,
``memory_ratio``, ``disk_swap_s``, ``disk_limit_s``, ``disk_ratio``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def _median(fn, repeat: int, comm) -> float:
    times = []
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--scratch", help="the shared directory for the disk swap (default: a new one under /tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcml.grid import ProcessGrid
    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.train import TrainConfig, Tournament, TournamentConfig
    from hpcml.train.population import member_tensors, pack, transfer, unpack
    from hpcml.train.recipe import build_llm_trainer

    world = MPI.COMM_WORLD
    if world.Get_size() != 4:
        raise SystemExit("population_swap.py: run it under mpiexec -n 4 (2 members of 2 ranks)")
    torch.set_num_threads(1)
    cfg = TransformerConfig(vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=8, ffn_hidden=4 * args.dim,
                            max_seq_len=64)
    train = TrainConfig(steps=1, global_batch=4, micro_batch=1, seq_len=32, progress=False)
    scratch = Path(world.bcast(args.scratch or tempfile.mkdtemp(prefix="hpcml-swap-") if world.rank == 0 else None))
    rows = []

    # -- one layout: the in-memory swap against a raw exchange of the same bytes ---------------------
    grid = ProcessGrid(pop=2, tp=2)
    trainer = build_llm_trainer(cfg, replace_seed(train, grid.member), ParallelConfig(), grid=grid)
    trainer.fit()  # AdamW's state exists
    tensors = member_tensors(trainer.model, trainer.optimizer)
    partner = 1 - grid.member
    swap_s = _median(lambda: transfer(grid, tensors, send_to=[partner], receive_from=partner), args.repeat, world)
    flat = pack(tensors)
    other = torch.empty_like(flat)
    peer = grid.torch_rank_of(partner)

    def raw():
        scratch_copy = flat.clone()  # the pack's copy
        ops = [dist.P2POp(dist.isend, scratch_copy, peer, group=grid.torch.pop_group),
               dist.P2POp(dist.irecv, other, peer, group=grid.torch.pop_group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        flat.copy_(other)  # the unpack's copy

    raw_s = _median(raw, args.repeat, world)
    unpack(tensors, flat)
    mib = flat.numel() / 2**20
    rows.append({"swap": "in memory, tp2 <-> tp2", "state_mib_per_rank": mib, "seconds": swap_s,
                 "limit": "gloo send+recv of the bytes + 2 copies", "limit_s": raw_s, "ratio": swap_s / raw_s})
    trainer.close()

    # -- two layouts: through checkpoints, against writing and reading the bytes once ----------------
    grid2 = ProcessGrid(members=[{"tp": 2}, {"dp": 2}])
    trainer2 = build_llm_trainer(cfg, replace_seed(train, grid2.member), ParallelConfig(fsdp=grid2.member == 1),
                                 grid=grid2)
    trainer2.fit()
    t = Tournament(grid2, trainer2.model, lambda: 0.0, optimizer=trainer2.optimizer,
                   config=TournamentConfig(every=1, scratch=scratch / "ckpt"))
    rounds = iter(range(1, 10_000))
    disk_s = _median(lambda: t.swap_through_checkpoints(1 - grid2.member, next(rounds)), args.repeat, world)
    mine = pack(member_tensors(trainer2.model, trainer2.optimizer)).numpy()
    raw_dir = scratch / "raw"
    raw_dir.mkdir(exist_ok=True)

    def raw_disk():
        path = raw_dir / f"rank{world.rank}.bin"
        with open(path, "wb") as f:
            f.write(mine.tobytes())
            f.flush()
            os.fsync(f.fileno())
        world.Barrier()
        theirs = raw_dir / f"rank{world.rank ^ 2}.bin"  # the rank at this place in the other member
        with open(theirs, "rb") as f:  # from the page cache, as the checkpoint's load reads it
            while f.read(8 << 20):
                pass

    raw_disk_s = _median(raw_disk, args.repeat, world)
    disk_mib = world.allreduce(mine.nbytes, op=MPI.MAX) / 2**20
    rows.append({"swap": "through checkpoints, tp2 <-> fsdp dp2", "state_mib_per_rank": disk_mib, "seconds": disk_s,
                 "limit": "write+fsync, then read the partner's bytes", "limit_s": raw_disk_s,
                 "ratio": disk_s / raw_disk_s})
    trainer2.close()
    if world.rank != 0:
        return
    last = {"state_mib_per_rank": mib, "memory_swap_s": swap_s, "memory_limit_s": raw_s,
            "memory_ratio": swap_s / raw_s, "disk_swap_s": disk_s, "disk_limit_s": raw_disk_s,
            "disk_ratio": disk_s / raw_disk_s}
    from population import emit  # benchmarks/population.py, beside this script

    emit(rows, last, args.json, lambda r: f"{r['swap']}: {r['state_mib_per_rank']:.1f} MiB a rank, "
                                          f"{r['seconds']:.3f} s; limit ({r['limit']}) {r['limit_s']:.3f} s: "
                                          f"{r['ratio']:.2f}x")


def replace_seed(train, member: int):
    from dataclasses import replace

    return replace(train, seed=10 + member)


if __name__ == "__main__":
    main()
