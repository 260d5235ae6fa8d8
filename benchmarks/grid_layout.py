"""How fast is the grid's layout arithmetic at supercomputer scale, and its bring-up here?

Part 1 (one process): all groups of every axis and of dp x cp for worlds up to 131,072
ranks, side by side with
  * the peer: DeviceMesh's own way (``torch.arange(N).view(shape)``, swap the axis last,
    reshape: what ``init_device_mesh`` does for each dim), and
  * the physical limit: one memcpy of the N rank ids per group set (every group of an
    axis together holds each rank once, so writing them out is at least that copy).
Part 2 (under mpiexec, optional): ProcessGrid construction (sub-communicators by Split)
and torch.distributed bootstrap on this machine.

    python benchmarks/grid_layout.py --json
    mpiexec -n 4 python benchmarks/grid_layout.py --bringup --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def layout_case(world: int, degrees: dict[str, int], repeat: int) -> dict:
    import torch

    from hpcml.grid import Layout
    from hpcml.grid.layout import DENSE_AXES

    lay = Layout.from_degrees(world, degrees)
    sets = [(a,) for a in DENSE_AXES] + [("dp", "cp")]
    ours = _best(lambda: [lay.group_array(s) for s in sets], repeat)

    shape = lay.mesh_shape
    names = DENSE_AXES

    def device_mesh_way():
        mesh = torch.arange(world).view(shape)
        for s in sets:
            dims = [names.index(a) for a in s]
            rest = [d for d in range(len(shape)) if d not in dims]
            mesh.permute(rest + dims).reshape(-1, int(np.prod([shape[d] for d in dims]))).contiguous()

    peer = _best(device_mesh_way, repeat)
    ranks = np.arange(world, dtype=np.int64)
    limit = _best(lambda: [ranks.copy() for _ in sets], repeat)
    one_rank = _best(lambda: [lay.group_of(world // 3, s) for s in sets], repeat)
    return {"world_size": world, "layout": lay.describe_degrees(), "group_sets": len(sets),
            "hpcml_s": ours, "device_mesh_way_s": peer, "memcpy_limit_s": limit,
            "hpcml_one_rank_groups_s": one_rank,
            "ratio_vs_device_mesh_way": ours / peer, "ratio_vs_memcpy": ours / limit}


def bringup(repeat: int) -> dict | None:
    from mpi4py import MPI

    from hpcml.grid import ProcessGrid

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    degrees = {"tp": 2} if world % 2 == 0 else {}
    split_times = []
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        grid = ProcessGrid(**degrees)
        comm.Barrier()
        split_times.append(time.perf_counter() - t0)
        grid.free()
    comm.Barrier()
    t0 = time.perf_counter()
    sample = comm.allreduce(1)
    comm.Barrier()
    one_collective = (time.perf_counter() - t0) / 2
    grid = ProcessGrid(**degrees)
    comm.Barrier()
    t0 = time.perf_counter()
    grid.init_torch()
    comm.Barrier()
    torch_init = time.perf_counter() - t0
    import torch.distributed as dist

    dist.destroy_process_group()
    assert sample == world
    if comm.rank:
        return None
    return {"world_size": world, "layout": grid.layout.describe_degrees(),
            "process_grid_s_median": statistics.median(split_times), "one_collective_s": one_collective,
            "torch_init_and_mesh_s": torch_init}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--bringup", action="store_true", help="time ProcessGrid and torch bootstrap (under mpiexec)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.bringup:
        result = bringup(args.repeat)
        if result is None:
            return
        out = {"benchmark": "grid_bringup", **result}
    else:
        cases = [(8, {"tp": 2, "pp": 2}), (4096, {"tp": 8, "pp": 4}), (32768, {"tp": 8, "cp": 2, "pp": 8}),
                 (131072, {"tp": 8, "cp": 4, "pp": 16})]
        out = {"benchmark": "grid_layout", "cases": [layout_case(w, d, args.repeat) for w, d in cases]}
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
