"""The ``hpcml`` command: a thin shell over the Python API.

Bad input ends in one line on stderr (``hpcml: error: ...``) and exit status 2, with no
traceback; under MPI only rank 0 prints a validation error, which every rank raised alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hpcml import safeio
from hpcml import env
from hpcml.errors import ConfigError, HpcmlError
from hpcml.grid.layout import DEGREE_AXES, DENSE_AXES, EXPERT_AXES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpcml", description="Machine learning at supercomputer scale.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("info", help="MPI, parallel HDF5, torch backends, devices and launch environment")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    from hpcml.plan.command import add_parser as add_plan

    add_plan(sub)

    from hpcml.data.command import add_parser as add_data
    from hpcml.interop.ckpt_command import add_parser as add_ckpt

    add_data(sub, _Parser)

    p = sub.add_parser("grid", help="print a process-grid layout, or build and check it under mpiexec")
    p.add_argument("--world", type=int, help="world size (default: the launcher's, or MPI's with --check)")
    for axis in DEGREE_AXES:
        p.add_argument(f"--{axis}", type=int, default=None if axis in ("dp", "etp") else 1,
                       help=f"degree of {axis}" + (" (default: tp)" if axis == "etp" else " (ep folds over cp x dp)"
                                                   if axis == "ep" else
                                                   f" (-1: infer{'; default: the rest' if axis == 'dp' else ''})"))
    p.add_argument("--pop", type=int, default=1, help="population members (outermost): the ranks split into POP "
                   "trainers of this layout each (docs/populations.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the groups")
    p.add_argument("--check", action="store_true",
                   help="build the real grid (MPI and torch.distributed) and check every group communicates")
    p.add_argument("--backend", help="torch.distributed backend for --check (default: by device)")
    p.add_argument("--interface", help="network interface rank 0 advertises for --check, e.g. hsn0")
    p = sub.add_parser("job", help="the batch script of a training run or campaign on a site (walltime "
                                   "signal, requeue); --submit submits it")
    p.add_argument("--site", required=True, help="site name (hpcml.ensemble.list_sites())")
    p.add_argument("--nodes", required=True, help="node count N, or MIN-MAX on Slurm (restart on fewer nodes)")
    p.add_argument("--walltime", required=True, help="HH:MM:SS")
    p.add_argument("--account", help="allocation to charge (default: $HPCML_ACCOUNT; required where the site "
                   "requires one)")
    p.add_argument("--queue", help="queue, partition or QOS (default: the site's table picks one from the nodes "
                   "and the walltime; a named one is checked against it)")
    p.add_argument("--ranks", type=int, help="training ranks (default: one per device of every node)")
    p.add_argument("--driver", action="store_true",
                   help="CMD is a campaign driver: run it as is on the first node; it launches its own steps")
    p.add_argument("--name", default="hpcml", help="job name (and output file name)")
    p.add_argument("--warn", type=int, dest="warn_s", help="seconds before the walltime that SIGUSR1 arrives "
                   "(default: a tenth of the walltime, 60..600)")
    p.add_argument("--no-requeue", action="store_true", help="do not requeue a job that exits 75 (not finished)")
    p.add_argument("--max-requeues", type=int, default=10)
    p.add_argument("--script", help="write the script here (with --submit: default NAME.sbatch|.pbs|.lsf)")
    p.add_argument("--submit", action="store_true", help="submit it and print the job id")
    p.add_argument("--explain", action="store_true",
                   help="print every line of the script with the reason and the source for it")
    p.add_argument("--campaign-jobs", action="store_true",
                   help="print what a campaign of --nodes (trainer and simulations) submits -- which jobs, in which "
                        "queues, how many at once -- checked against the queues' per-user limits")
    p.add_argument("--train-nodes", type=int, default=1, help="with --campaign-jobs: the trainer's nodes (default 1)")
    p.add_argument("--mode", choices=("auto", "pilot", "one-allocation"), default="auto",
                   help="with --campaign-jobs: how the campaign runs (default: a pilot when its jobs fit the limits, "
                        "else one allocation, else the trainer in another queue)")
    p.add_argument("--json", action="store_true", help="with --campaign-jobs: one JSON object")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    add_ckpt(sub, _Parser)
    return parser


def _campaign_jobs(args: argparse.Namespace) -> int:
    """``hpcml job --campaign-jobs``: the campaign's jobs and queues, or exit 2 when none fit."""
    from hpcml.ensemble import campaign_jobs, load_site
    from hpcml.ensemble.jobscript import parse_nodes

    lo, hi = parse_nodes(args.nodes)
    if lo != hi:
        raise ConfigError(f"--nodes {args.nodes}: --campaign-jobs plans a fixed node count (expected N)")
    got = campaign_jobs.plan(load_site(args.site), nodes=lo, walltime=args.walltime, train_nodes=args.train_nodes,
                             queue=args.queue, mode=args.mode, requeue=not args.no_requeue)
    print(json.dumps(got.to_dict()) if args.json else got.explain())
    return 0


def _cmd_job(args: argparse.Namespace) -> int:
    from hpcml.ensemble import jobscript
    from hpcml.ensemble.schedulers import SubmitError

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ConfigError("hpcml job needs the command after --, e.g. hpcml job ... -- python train.py")
    if args.script is not None:
        _check_out_file("--script", args.script)
    if args.campaign_jobs:
        return _campaign_jobs(args)
    spec = jobscript.job_spec(site=args.site, command=cmd, nodes=args.nodes, walltime=args.walltime,
                              account=args.account, queue=args.queue, ranks=args.ranks, driver=args.driver,
                              name=args.name, warn_s=args.warn_s, requeue=not args.no_requeue,
                              max_requeues=args.max_requeues, script_path=args.script)
    for note in spec.notes:
        print(f"hpcml job: note: {note}", file=sys.stderr)
    if args.explain:
        print(jobscript.explain(spec), end="")
        if args.driver and spec.nodes[0] == spec.nodes[1] > 1:  # a campaign in one allocation: against the limits
            from hpcml.ensemble import campaign_jobs

            print(campaign_jobs.plan(spec.site, nodes=spec.nodes[0], walltime=spec.walltime, queue=args.queue,
                                     mode="one-allocation", requeue=not args.no_requeue).explain())
        return 0
    if args.submit:
        path = args.script or f"{args.name}{spec.site.batch.suffix}"
        try:
            job_id = jobscript.submit(spec, path)
        except SubmitError as e:
            print(e.details(), file=sys.stderr)  # all the scheduler said; the one-line error follows
            raise
        print(job_id)
        print(f"hpcml job: submitted {path} as job {job_id}", file=sys.stderr)
        return 0
    text = jobscript.render(spec)
    if spec.site.batch.resubmits and spec.requeue_allowed and not args.script:
        suffix = spec.site.batch.suffix
        print(f"hpcml job: save it as {args.name}{suffix} in the directory you submit from: on exit 75 it submits "
              f"itself again from there (or set HPCML_JOB_SCRIPT, or use --script)", file=sys.stderr)
    if args.script:
        safeio.replace(args.script, text, mode=0o755)  # a FIFO or directory there is refused, a link replaced
        print(f"hpcml job: wrote {args.script}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def _check_out_file(flag: str, path: str) -> None:
    """``path`` can be written as a file: said before anything is rendered or submitted
    (``open`` would say only "Is a directory" or "No such file or directory")."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {p} is a directory: expected a file path, e.g. {p}/<name>")
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {p}: directory {p.parent} does not exist (create it first)")


def _degrees(args: argparse.Namespace) -> dict[str, int]:
    return {a: getattr(args, a) for a in DEGREE_AXES if getattr(args, a) is not None}


def _cmd_ckpt(args: argparse.Namespace) -> int:
    from hpcml.interop.ckpt_command import run

    return run(args)


def _cmd_data(args: argparse.Namespace) -> int:
    from hpcml.data.command import run

    return run(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from hpcml.plan.command import run

    return run(args)


def _cmd_info(args: argparse.Namespace) -> int:
    from hpcml import info

    data = info.collect()
    print(json.dumps(data) if args.json else info.format_text(data))
    return 0


def _check_world(args: argparse.Namespace) -> None:
    """A lone process (no --world, no launcher) asked for a layout of several ranks: the user
    forgot --world or mpiexec, which says more than "does not divide world size 1"."""
    if (args.world is not None and not args.check) or env.detect().world_size != 1:
        return
    given = {a: d for a, d in _degrees(args).items() if d > 1}
    if not given:
        return
    need = " x ".join(f"{a}({d})" for a, d in given.items())
    fix = "" if args.check else "add --world N to print the layout for N ranks, or "
    raise ConfigError(f"{need} needs a multiple of {math.prod(given.values())} ranks, but this is a single "
                      f"process: {fix}run it under mpiexec -n N")


#: ``hpcml grid --world`` at most: 50x the GPUs of today's largest machines, and the group
#: lists still print in a second (they grow with the world).
MAX_PRINT_WORLD = 1 << 22
#: Up to this world size the text form lists every group; above, the first ``SHOWN_GROUPS``
#: groups (and members) of each axis; ``--json`` lists them all.
SHOWN_ALL = 256
SHOWN_GROUPS = 8


def _cmd_grid(args: argparse.Namespace) -> int:
    from hpcml.grid.layout import Layout

    if args.world is not None and not 1 <= args.world <= MAX_PRINT_WORLD:
        raise ConfigError(f"--world {args.world}: expected 1 to {MAX_PRINT_WORLD} ranks")
    if args.check and args.backend is not None:
        _check_backend(args.backend)
    _check_world(args)
    if not args.check:
        world = args.world if args.world is not None else env.detect().world_size
        if args.pop < 1 or world % args.pop:
            raise ConfigError(f"--pop {args.pop}: expected a positive divisor of the {world} ranks (each member "
                              f"gets as many)")
        layout = Layout.from_degrees(world // args.pop, _degrees(args))
        if env.detect().rank == 0:
            head = (f"population: {args.pop} members of {world // args.pop} ranks; member m is world ranks "
                    f"m*{world // args.pop} onwards, each laid out as:\n") if args.pop > 1 else ""
            pop = {"pop": args.pop} if args.pop > 1 else {}
            print(json.dumps({**layout.to_dict(), **pop}) if args.json else head + _layout_text(layout))
        return 0

    from hpcml.grid import ProcessGrid, install_abort_handler
    from hpcml.grid.check import check_grid

    install_abort_handler()
    grid = ProcessGrid(pop=args.pop, **_degrees(args))
    if args.world is not None and args.world != grid.world_comm.Get_size():
        raise ConfigError(f"--world {args.world} != MPI world size {grid.world_comm.Get_size()}")
    grid.init_torch(backend=args.backend, interface=args.interface)
    results = check_grid(grid)
    if grid.world_comm.Get_rank() == 0:
        pop = {"pop": grid.pop} if grid.pop > 1 else {}
        print(json.dumps({**grid.layout.to_dict(), **pop}) if args.json else grid.describe())
        print(f"check passed: {len(results)} groups on each rank agree in layout, MPI and torch", file=sys.stderr)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _layout_text(layout) -> str:
    order = ", ".join(a for a in reversed(DENSE_AXES))
    if layout.moe:
        order = f"dense {order}; experts {', '.join(reversed(EXPERT_AXES))}"
    lines = [f"world {layout.world_size} = {layout.describe_degrees()}  (rank order innermost first: {order})"]
    for axis in layout.axis_names:
        groups = layout.group_array(axis)
        if layout.world_size <= SHOWN_ALL:
            lines.append(f"  {axis} groups: {groups.tolist()}")
            continue
        rows = [_short_list(g.tolist()) for g in groups[:SHOWN_GROUPS]]
        more = f", ... ({len(groups)} groups of {groups.shape[1]})" if len(groups) > SHOWN_GROUPS else ""
        lines.append(f"  {axis} groups: [{', '.join(rows)}{more}]")
    return "\n".join(lines)


def _short_list(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 2 * SHOWN_GROUPS else f"[{', '.join(map(str, xs[:SHOWN_GROUPS]))}, ..., {xs[-1]}]"


def _check_backend(backend: str) -> None:
    """A torch.distributed backend this torch build has, before any rank builds the grid
    (:func:`hpcml.grid.torch_dist.init` checks it again, for API callers)."""
    from hpcml.grid.torch_dist import check_backend

    try:
        check_backend(backend)
    except ConfigError as e:
        raise ConfigError(f"--{e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "job" and not args.cmd:  # `hpcml job ... -- cmd`: argparse left the command
        args.cmd, extra = extra, []
    if extra:
        if args.command == "grid" and extra[0].startswith("--"):
            parser.error(f"unknown axis {extra[0][2:]!r}: expected one of {', '.join(DEGREE_AXES)}")
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        commands = {"info": _cmd_info, "grid": _cmd_grid, "ckpt": _cmd_ckpt, "job": _cmd_job, "plan": _cmd_plan,
                    "data": _cmd_data}
        return commands[args.command](args)
    except HpcmlError as e:
        if not isinstance(e, ConfigError) or env.detect().rank == 0:
            print(f"hpcml: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `hpcml ckpt inspect ck | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # e.g. an output path that cannot be written
        print(f"hpcml: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
