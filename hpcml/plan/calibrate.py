"""``hpcml plan calibrate``: the time model's constants fitted on a few steps measured on the
user's own machine, written as a device file the planner then uses (``--device-file``).

The published tables fit a device family's constants once (:mod:`hpcml.plan.fit`); a user's
machine differs from them -- another interconnect, another software stack, a CPU. Five measured
layouts are enough to fit what sets the step time there: the matmul rate, the memory-bound
work, the fixed cost per block and per step, the links, and each parallelism's fixed cost per
block. The fit is the same coordinate descent as the family fit, in log error, over grids that
span each constant's plausible range. A constant no run exercises cannot be fitted: it keeps
its starting value and the report names it, so the user knows which layout to add.

Runs come as JSON lines (a layout's keys, as ``hpcml plan --layouts`` takes them, plus the
measured ``step_s`` or ``tokens_per_s``) or as run directories of ``llm_pretrain.py`` (its
``config.json`` gives the layout and the model, ``metrics.jsonl`` the step times; ``--model``
for a directory written before the trainer recorded its model).
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.plan import devfile
from hpcml.plan.predict import measured_ok, measured_step, pop_measured
from hpcml.plan.published import Case
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.constants import Constants

MAX_RUN_FILE = 16 << 20
MAX_RUNS = 10_000
WARMUP_STEPS = 2
"""Steps of a run directory left out of its median (compilation, allocator growth, first gathers)."""


def _geometric(lo: float, hi: float, per_octave: int = 4) -> list[float]:
    n = int(round(math.log2(hi / lo) * per_octave))
    return [lo * 2 ** (k / per_octave) for k in range(n + 1)]


_FIXED = [0.0, *_geometric(1e-5, 0.5)]
#: What calibration fits, over which values: rates as factors of their start, fixed costs absolute.
GRID: dict[str, list[float]] = {
    "gemm_eff": _geometric(0.125, 4.0), "elementwise_passes": _geometric(0.125, 8.0), "comm_eff": _geometric(0.05, 4.0),
    "block_s": _FIXED, "step_overhead_s": [0.0, *_geometric(1e-4, 10.0)], "latency_s": [0.0, *_geometric(1e-6, 1e-2)],
    "tp_block_s": _FIXED, "sp_block_s": _FIXED, "cp_block_s": _FIXED, "fsdp_unit_s": _FIXED,
    "dp_overlap": [x / 10 for x in range(11)]}
_RELATIVE = ("gemm_eff", "elementwise_passes", "comm_eff")
#: Weight of the elementwise passes' squared log distance from their start (the device's figure, a
#: CPU's as measured) beside the runs' mean squared log error. Five runs fit ten constants exactly
#: in many ways, and the matmul rate and the elementwise passes trade off: the search stopped at
#: passes of 0.0005 on one of this machine's runs, 445 on another (126-140 measured), the ten
#: layouts checked p90 24-32% off; held near the start, 8-10% (benchmarks.md). A factor of 2
#: costs what a 2.2% error does.
PRIOR = 1e-3
PRIOR_ON = ("elementwise_passes",)


@dataclass(frozen=True)
class Measured:
    layout: PlanLayout
    step_s: float
    source: str


def _line_run(d, where: str, defaults: dict) -> Measured:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a JSON object (a layout with step_s or tokens_per_s)")
    d = {k: v for k, v in d.items() if k not in ("gpu", "site")}
    measured = pop_measured(d, where)
    if measured is None:
        raise ConfigError(f"{where}: give exactly one of step_s (seconds a step) or tokens_per_s (all ranks)")
    try:
        lay = PlanLayout.from_dict(d, **defaults)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    _runs_here(lay, where)
    return Measured(lay, measured_step(lay, *measured), where)


def _run_dir(path: Path, defaults: dict) -> Measured:
    """A run directory of the project's trainer: its layout from ``config.json``, the median
    step time of ``metrics.jsonl`` past the first :data:`WARMUP_STEPS`."""
    where = f"run directory {path}"
    cfg = safeio.read_json(path / "config.json", 1 << 20)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("layout"), dict) or not isinstance(cfg.get("train"), dict):
        raise ConfigError(f"{where}: config.json has no 'layout' and 'train' (not a run directory of hpcml's trainer)")
    lay_d, train, par = cfg["layout"], cfg["train"], cfg.get("parallel") or {}
    if not isinstance(par, dict):
        raise ConfigError(f"{where}: config.json: parallel={str(par)[:60]}: expected an object (the trainer's "
                          f"ParallelConfig)")
    steps, torn = [], None
    for n, line in enumerate(safeio.iter_lines(path / "metrics.jsonl", 1 << 16), 1):
        if torn is not None:  # a line that does not parse, with more after it: not a killed job's last line
            raise torn
        try:
            rec = (safeio.parse_json(line, f"{path}/metrics.jsonl line {n}", max_depth=4, constants=True)  # NaN: a
                   if line.strip() else None)  # skipped step's loss
        except safeio.FileRefused as e:
            torn = ConfigError(f"{where}: {e}")
            continue
        v = rec.get("step_s") if isinstance(rec, dict) else None
        if measured_ok(v):
            steps.append(float(v))
    if len(steps) <= WARMUP_STEPS:
        raise ConfigError(f"{where}: {len(steps)} timed steps in metrics.jsonl: expected more than {WARMUP_STEPS} "
                          f"(the first {WARMUP_STEPS} warm up)")
    if not isinstance(cfg.get("model"), dict) and "model" not in defaults:
        raise ConfigError(f"{where}: config.json names no model (an hpcml before its trainer recorded it): "
                          f"give --model, the preset or config it trained")
    try:
        degrees = {k: _whole(lay_d, k) for k in ("tp", "pp", "cp", "dp")}
        d = {**{k: degrees[k] for k in ("tp", "pp", "cp")}, "ep": _whole(lay_d, "ep"),
             "gpus": math.prod(degrees.values()), "seq_len": train["seq_len"], "global_batch": train["global_batch"],
             "micro_batch": train["micro_batch"], "precision": "bf16" if train.get("bf16") else "fp32",
             "zero": (3 if par.get("reshard_after_forward", True) else 2) if par.get("fsdp") else 0,
             "sequence_parallel": bool(par.get("sequence_parallel", False)),
             "schedule": par.get("pp_schedule") or "1f1b",
             "recompute": "full" if par.get("activation_checkpointing") else "none",
             "fpdt_chunk": int(par.get("fpdt_chunk") or 0), "loss_chunk": int(par.get("loss_chunk") or 0)}
        if par.get("fsdp") and degrees["pp"] == 1:  # a record without the key: its trainer synced once a step
            d["grad_sync"] = par.get("grad_sync", "step") or "microbatch"
        if par.get("stages_per_rank"):
            d["stages_per_rank"] = int(par["stages_per_rank"])
        if isinstance(cfg.get("model"), dict) and "model" not in defaults:  # the trainer's own record of the model
            from hpcml.models.transformer.config import TransformerConfig

            d["model"] = TransformerConfig.from_dict(cfg["model"])
        lay = PlanLayout.from_dict(d, **defaults)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{where}: config.json: {str(e).splitlines()[0][:200]}") from None
    _runs_here(lay, where)
    return Measured(lay, statistics.median(steps[WARMUP_STEPS:]), str(path))


def _whole(layout: dict, key: str) -> int:
    """A degree of a run's recorded layout (1 when absent): a whole number, not 2.7, "2" or true."""
    v = layout.get(key, 1)
    if not is_int(v) or v < 1:
        raise ValueError(f"layout {key}={repr(v)[:40]}: expected a whole number >= 1")
    return v


def _runs_here(lay, where: str) -> None:
    """A measured layout the model's plan refuses (tp 3 against 8 heads) cannot have run: one
    line, not a NaN prediction fitted into the device's constants."""
    from hpcml.plan.predict import load_model, model_rules

    refused = model_rules(load_model(lay.model), lay)
    if refused:
        raise ConfigError(f"{where}: the model's plan refuses this layout ({refused}): it cannot be a measured run")


def read_runs(paths: list[str], defaults: dict) -> list[Measured]:
    """The measured runs in ``paths`` (JSON-lines files, run directories), layouts completed by
    ``defaults`` (the options given beside them; the device is the calibration's, whatever a line names)."""
    out: list[Measured] = []
    defaults = {"gpu": "measured", **{k: v for k, v in defaults.items() if v is not None and k not in ("gpu", "site")}}
    for p in paths:
        path = Path(p)
        if path.is_dir():
            out.append(_run_dir(path, defaults))
            continue
        text = safeio.read_text(path, MAX_RUN_FILE, "JSON lines of measured runs")
        if text is None:
            raise ConfigError(f"runs {p}: no such file or directory")
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                out.append(_line_run(safeio.parse_json(line, f"{p} line {n}", max_depth=8, unique=True),
                                     f"{p} line {n}", defaults))
        if len(out) > MAX_RUNS:
            raise ConfigError(f"runs: more than {MAX_RUNS} measured runs")
    if not out:
        raise ConfigError(f"runs {' '.join(paths)[:200]}: no measured run in them")
    return out


def _cases(runs: list[Measured], name: str) -> list[Case]:
    return [Case("calibration", r.source, replace(r.layout, gpu=name, site=None),
                 tokens_per_gpu=r.layout.global_batch * r.layout.seq_len / r.step_s / r.layout.gpus) for r in runs]


def exercised(cases: list[Case], c: Constants) -> list[str]:
    """The constants of :data:`GRID` that move some case's prediction (the rest cannot be fitted)."""
    from hpcml.plan.fit import score

    base = score(cases, c)
    out = []
    for k in GRID:
        v = getattr(c, k)
        if k in _RELATIVE:
            probe = 2 * v
        elif k == "dp_overlap":
            probe = 0.0 if v == 0.5 else 0.5
        else:  # a fixed cost, perhaps 0
            probe = max(2 * v, 0.05)
        if abs(score(cases, replace(c, **{k: probe})) - base) > 1e-9:
            out.append(k)
    return out


def _to_x(k: str, v: float) -> float:
    """A constant in the coordinates the refinement steps in: the log of a rate, the log of a
    fixed cost above a floor (so that 0 is reachable), an overlap as it is."""
    return v if k == "dp_overlap" else math.log(v) if k in _RELATIVE else math.log(v + _FLOOR)


def _from_x(k: str, x: float) -> float:
    lo, hi = devfile.RANGES[k]
    v = x if k == "dp_overlap" else math.exp(x) if k in _RELATIVE else math.exp(x) - _FLOOR
    v = 0.0 if k not in _RELATIVE and v < 1e-3 * _FLOOR else v
    return min(hi, max(lo, v))


_FLOOR = 1e-6


def _in_range(k: str, values: list[float]) -> list[float]:
    """A grid's values inside what a device file may hold (a factor of 4 on a start of 1 gave
    comm_eff 3.8, and the device file written was refused by its own check)."""
    lo, hi = devfile.RANGES[k]
    return sorted({min(hi, max(lo, v)) for v in values})


def refine(cases: list[Case], c: Constants, best: float, names: list[str], objective, tol: float = 1e-3
           ) -> tuple[Constants, float]:
    """Pattern search (Hooke and Jeeves) from the grid's answer: each constant stepped both ways
    in :func:`_to_x` coordinates, the step halved when none improves, until it is ``tol``. The
    grid alone stalls where two constants trade off (matmul rate against the elementwise passes)."""
    x = {k: _to_x(k, getattr(c, k)) for k in names}
    step = 0.5
    while step > tol:
        moved = False
        for k in names:
            for d in (step, -step):
                trial = replace(c, **{k: _from_x(k, x[k] + d)})
                s = objective(cases, trial)
                if s < best - 1e-12:
                    c, best, x[k], moved = trial, s, x[k] + d, True
                    break
        if not moved:
            step /= 2
    return c, best


def calibrate(runs: list[Measured], base: devfile.DeviceFile, name: str) -> tuple[devfile.DeviceFile, dict]:
    """Fit ``base``'s constants on ``runs``; the calibrated device file (called ``name``) and a
    report: the fitted constants, each run's error before and after, what could not be fitted."""
    from hpcml.plan.fit import fit, score
    from hpcml.plan.predict import evaluate, load_model, resolve_device

    if len(runs) < 2:
        raise ConfigError(f"{len(runs)} measured run: calibration needs at least 2 (5 or more layouts that "
                          f"differ in their axes fit best)")
    trial = devfile.register(replace(base, name=name))
    cases = _cases(runs, trial)
    start = base.constants
    moving = exercised(cases, start)
    grid = {k: _in_range(k, [v * getattr(start, k) for v in GRID[k]] if k in _RELATIVE else GRID[k]) for k in moving}
    before = score(cases, start)
    rates = [k for k in PRIOR_ON if k in moving]

    def objective(cases: list[Case], c: Constants) -> float:  # the runs' error, and a weak pull to the start
        return score(cases, c) + PRIOR * sum(math.log((getattr(c, k) + _FLOOR) / (getattr(start, k) + _FLOOR)) ** 2
                                             for k in rates)
    fitted, _ = refine(cases, *fit(cases, start=start, grid=grid, rounds=6, objective=objective), moving, objective)
    after = score(cases, fitted)
    notes = []
    if "sp_block_s" not in moving and "tp_block_s" in moving:
        # sequence parallelism does what tp does a block and more (it gathers and scatters around
        # the norms): at least tp's cost, the lower bound taken
        fitted = replace(fitted, sp_block_s=fitted.tp_block_s)
        notes.append("sp_block_s set to tp_block_s, a lower bound (no run with sequence parallelism)")
    unfitted = [k for k in GRID if k not in moving]
    stamp = datetime.date.today().isoformat()
    rows = []
    for r, case in zip(runs, cases):
        cfg, dev = load_model(case.layout.model), resolve_device(case.layout)
        p0 = evaluate(cfg, dev, start, case.layout)
        p1 = evaluate(cfg, dev, fitted, case.layout)
        rows.append({"run": r.source, "measured_step_s": round(r.step_s, 6),
                     "start_step_s": _sig(p0.step_s), "calibrated_step_s": _sig(p1.step_s),
                     "error": round(p1.step_s / r.step_s - 1, 4)})
    report = {"runs": len(runs), "date": stamp, "rms_log_error_before": round(math.sqrt(before), 4),
              "rms_log_error": round(math.sqrt(after), 4), "fitted": {k: _sig(getattr(fitted, k)) for k in moving},
              "unfitted": unfitted, "notes": notes, "rows": rows}
    devfile.unregister(trial)
    out = replace(base, name=name, constants=fitted, calibration={k: v for k, v in report.items() if k != "rows"})
    if out.device is not None:
        out = replace(out, device=replace(out.device, name=name, family=devfile.family(name),
                                          source=f"{out.device.source}; calibrated on {len(runs)} runs {stamp}"))
    return out, report


def base_of(gpu: str | None, site: str | None, device_file: str | None, cpu: bool) -> devfile.DeviceFile:
    """The device calibration starts from: a device file, a known device or site (its family's
    fitted constants), or this machine's CPU measured now (``cpu``: ~15 s)."""
    from hpcml.plan import calibration
    from hpcml.plan.devices import device, site_device

    if sum(x is not None and x is not False for x in (gpu, site, device_file, cpu or None)) != 1:
        raise ConfigError("hpcml plan calibrate: give exactly one of --gpu, --site, --device-file or --cpu "
                          "(the device the runs were measured on)")
    if device_file:
        return devfile.load(device_file)
    if cpu:
        from hpcml.plan.cpu import cpu_device, measure

        facts = measure()
        _, c = cpu_device(facts, 1, {})
        return devfile.DeviceFile(name="cpu", constants=c, cpu=facts)
    dev = calibration.calibrated(site_device(site) if site else device(gpu))
    return devfile.DeviceFile(name=dev.name, constants=calibration.constants(dev), device=dev)


def with_network(base: devfile.DeviceFile, gbps: float | None, runs: list[Measured]) -> devfile.DeviceFile:
    """``base`` with its nodes' injection bandwidth ``gbps`` (GB/s a node, ``--node-injection-gbps``;
    None: as it is): the network the runs ran on, written into the device file, so every later plan
    prices it without the flag. Given per run instead it would be fitted on and lost: refused."""
    for r in runs:
        if r.layout.node_injection_gbps is not None:
            raise ConfigError(f"{r.source}: node_injection_gbps in a run: give the network once, with "
                              f"--node-injection-gbps (it is written into the device file)")
    if gbps is None:
        return base
    if base.device is None:
        raise ConfigError("--node-injection-gbps: a CPU calibration measures its own links (gloo's bus bandwidth): "
                          "not with --cpu or a CPU device file")
    return replace(base, device=replace(base.device, inter_gbps=gbps / base.device.gpus_per_node))


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def summary(report: dict) -> str:
    lines = [f"calibrated on {report['runs']} runs: rms log error {report['rms_log_error_before']} -> "
             f"{report['rms_log_error']}", "fitted: " + ", ".join(f"{k}={v:g}" for k, v in report["fitted"].items())]
    if report["unfitted"]:
        lines.append("not exercised by any run, kept: " + ", ".join(report["unfitted"])
                     + " (add a layout that uses them to fit them)")
    lines += report["notes"]
    lines += [f"  {r['run']}: measured {r['measured_step_s']:.4g} s, calibrated {r['calibrated_step_s']:.4g} s "
              f"({r['error']:+.1%})" for r in report["rows"]]
    return "\n".join(lines)

