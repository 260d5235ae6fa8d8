"""Fitting the time model's constants on published runs: ``python -m hpcml.plan.fit`` writes
``data/calibration.json``; ``--check`` fits and fails if the stored constants differ; ``--choose``
prints the left-out error of each weight of the prior that holds the constants near their defaults."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from importlib import resources

from hpcml.plan.devices import Device
from hpcml.plan.constants import Constants


#: The values each constant may take in the fit (coordinate descent over these grids).
GRID: dict[str, list[float]] = {
    "gemm_eff": [x / 100 for x in range(40, 96, 2)],
    "elementwise_passes": [float(x) for x in range(0, 161, 8)],
    "softmax_passes": [float(x) for x in range(0, 25, 2)],
    "attn_eff": [0.0, *(x / 100 for x in range(8, 92, 2))],
    "fp8_eff": [x / 100 for x in range(20, 102, 2)],
    "comm_eff": [x / 100 for x in range(30, 96, 5)],
    "dp_overlap": [x / 10 for x in range(0, 11)],
    "tp_overlap": [x / 10 for x in range(0, 11)],
    "m_half": [0.0, 64.0, 128.0, 256.0, 512.0, 1024.0],
}


#: Constants fitted after the others, each alone with the rest held: a kernel only some of the
#: family's rows run (fitted jointly, Megatron's attention let the matmul constants move to where
#: its rows wanted them: llm-foundry's held-out H100 section went from Spearman 0.72 to 0.35).
STAGED: dict[str, list[float]] = {"attn_eff_fused": [0.0, *(x / 100 for x in range(8, 92, 2))],
                                  "compiled_passes": [x / 20 for x in range(0, 21)]}


#: How far from its default (its physical estimate, :class:`Constants`) each constant may move for
#: what it gains: ``score + PRIOR_WEIGHT x sum(((c - default) / grid span)^2)``. Without it the
#: descent's answer depended on where it started (the A100 family: gemm_eff 0.9 and comm_eff 0.6
#: from one start, generalising worse to held-out tables). Chosen by leaving each fitted table out
#: of its family's fit in turn (``--choose``), the held-out tables untouched.
PRIOR_WEIGHT = 0.005
#: Not pulled toward a default: 0 switches the attention kernel's own efficiency off.
UNPRIORED = frozenset({"attn_eff"})
#: The descent runs from each of these (the defaults first) to convergence; the lowest objective wins,
#: so the answer is not one start's.
STARTS: tuple[dict[str, float], ...] = (
    {}, {"gemm_eff": 0.9, "comm_eff": 0.6}, {"gemm_eff": 0.55, "dp_overlap": 1.0, "m_half": 0.0},
    {"elementwise_passes": 120.0, "tp_overlap": 0.0, "fp8_eff": 0.6})


def penalty(c: Constants) -> float:
    """Squared distance of ``c`` from the defaults, each constant in units of its grid's span."""
    d = Constants()
    return sum(((getattr(c, k) - getattr(d, k)) / (max(v) - min(v))) ** 2
               for k, v in GRID.items() if k not in UNPRIORED)


def regularised(weight: float = PRIOR_WEIGHT):
    """The fit's objective: :func:`score` plus ``weight`` x :func:`penalty`."""
    return lambda cases, c: score(cases, c) + weight * penalty(c)


def descend(cases, c: Constants, objective) -> tuple[Constants, float]:
    """Coordinate descent to convergence, then the first step of one grid point in two constants at
    once that helps (constants that trade off -- the matmul rate against the elementwise passes --
    stop a descent that moves one at a time on a ridge), and again, until neither moves. Back to
    single moves after each pair step, so a constant the cases do not see is never carried along."""
    names = list(GRID)
    while True:
        c, best = fit(cases, c, rounds=50, objective=objective)
        step = _pair_step(cases, c, best, objective, names)
        if step is None:
            return c, best
        c = step


def _neighbours(name: str, value: float) -> tuple[float | None, float | None]:
    """The grid points of ``name`` just below and just above ``value`` (None past an end), on the grid or not."""
    grid = GRID[name]
    return max((g for g in grid if g < value), default=None), min((g for g in grid if g > value), default=None)


def _pair_step(cases, c: Constants, best: float, objective, names: list[str]) -> Constants | None:
    near = {n: _neighbours(n, getattr(c, n)) for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for va in near[a]:
                for vb in near[b]:
                    if va is not None and vb is not None:
                        trial = replace(c, **{a: va, b: vb})
                        if objective(cases, trial) < best - 1e-12:
                            return trial
    return None


def fit_family(cases, weight: float = PRIOR_WEIGHT) -> Constants:
    """A family's constants: the regularised :func:`descend` from every start in :data:`STARTS`,
    the lowest objective kept (ties: the earlier start)."""
    objective, best = regularised(weight), None
    for start in STARTS:
        c, s = descend(cases, replace(Constants(), **start), objective)
        if best is None or s < best[1] - 1e-12:
            best = (c, s)
    assert best is not None
    return best[0]


def choose_weight(families: dict[str, list[str]], weights=(0.0, 0.001, 0.003, 0.005, 0.01, 0.02, 0.03, 0.1, 0.3, 1.0)
                  ) -> list[tuple[float, float]]:
    """Each prior weight's error on fitted tables left out of their family's fit one at a time (the
    sum of their mean squared log errors), for choosing :data:`PRIOR_WEIGHT`. The joint fit alone:
    the staged constants (``attn_eff_fused``, ``compiled_passes``) and a device's sustained share are not refitted per
    fold (the left-out tables' rows are priced without Megatron's own attention efficiency)."""
    from hpcml.plan.published import TABLES

    out = []
    for w in weights:
        total = 0.0
        for tables in families.values():
            for t in tables:
                c = fit_family([x for o in tables if o != t for x in TABLES[o]()], w)
                total += score(TABLES[t](), c)
        out.append((w, total))
    return out


def score(cases, c: Constants, dev: Device | None = None) -> float:
    """Mean squared log error of predicted against published tokens/s per GPU (on ``dev`` when
    given, instead of each layout's own device), each table weighing the same: a 52-row table
    does not outvote a 9-row one measured with another framework."""
    from hpcml.plan.predict import load_model, resolve_device, tokens_per_s

    errs: dict[str, list[float]] = {}
    for case in cases:
        if case.tokens_per_gpu is None:
            continue
        got = tokens_per_s(load_model(case.layout.model), dev or resolve_device(case.layout), c, case.layout) \
            / case.layout.gpus
        errs.setdefault(case.table, []).append(math.log(got / case.tokens_per_gpu) ** 2 if got > 0 else 100.0)
    return sum(sum(e) / len(e) for e in errs.values()) / max(1, len(errs))


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties ranked in order): how a prediction
    orders layouts against how they measured."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def fit(cases, start: Constants | None = None, rounds: int = 4,
        grid: dict[str, list[float]] | None = None, objective=None) -> tuple[Constants, float]:
    """Constants minimising :func:`score` (or ``objective(cases, c)``) on ``cases``, by coordinate
    descent over ``grid`` (default :data:`GRID`; deterministic: the same cases give the same constants)."""
    objective = objective or score
    c = start or Constants()
    best = objective(cases, c)
    for _ in range(rounds):
        moved = False
        for name, values in (GRID if grid is None else grid).items():
            for v in values:
                trial = replace(c, **{name: v})
                s = objective(cases, trial)
                if s < best - 1e-12:
                    c, best, moved = trial, s, True
        if not moved:
            break
    return c, best


def fit_sustained(cases, dev: Device, c: Constants) -> tuple[float, float]:
    """The share of its peak ``dev`` runs at, in its ``sustained_range`` (both ends and the
    hundredths between), minimising :func:`score` on ``cases``; with that score."""
    lo, hi = dev.sustained_range
    inner = range(math.ceil(lo * 100), math.floor(hi * 100) + 1)
    grid = sorted({round(lo, 4), round(hi, 4), *(x / 100 for x in inner)})
    return min(((s, score(cases, c, replace(dev, sustained=s))) for s in grid), key=lambda t: (t[1], t[0]))


def fit_reserved(cases) -> float:
    """The memory no count covers (runtime context, communicator buffers, allocator slack): the
    median of published minus counted over the rows that publish their memory, to 0.5 GiB."""
    from hpcml.plan.memory import memory
    from hpcml.plan.predict import load_model

    gaps = [c.memory_gib - memory(load_model(c.layout.model), c.layout).gib()["total"]
            for c in cases if c.memory_gib is not None]
    return round(2 * statistics.median(gaps)) / 2 if gaps else Constants().reserved_gib


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcml.plan.fit``: fit every family on its calibration tables and
    write ``data/calibration.json`` (with ``--check``: fit and compare, write nothing)."""
    import argparse
    from dataclasses import asdict
    from pathlib import Path

    from hpcml.plan.devices import device
    from hpcml.plan.published import CALIBRATION, DEVICE_CALIBRATION, MEMORY_CALIBRATION, STAGED_CALIBRATION, TABLES

    ap = argparse.ArgumentParser(prog="python -m hpcml.plan.fit")
    ap.add_argument("--check", action="store_true", help="fit, and fail if the stored constants differ")
    ap.add_argument("--choose", action="store_true", help="print each prior weight's left-out error, write nothing")
    args = ap.parse_args(argv)
    if args.choose:
        for w, err in choose_weight(CALIBRATION):
            print(f"prior weight {w:g}: fitted tables left out one at a time, summed mean squared log error {err:.5f}")
        return 0
    out = {"about": "Time-model constants per device family, fitted by `python -m hpcml.plan.fit` on the "
                    "published tables named in fitted_on (hpcml/plan/data/published/, sources inside each file), "
                    "each family's squared log error plus prior_weight x the constants' squared distance from their "
                    "defaults (in units of their grids' spans), from several starts to convergence; "
                    "the staged constants (attn_eff_fused, compiled_passes) on those and staged_fitted_on; every "
                    "other table is held out. reserved_gib (memory outside every count) is fitted on the "
                    "rows of reserved_fitted_on that publish their memory; a family without such a table keeps "
                    "the default. devices: the share of its peak a power-capped part runs at, fitted on its own table "
                    "inside the range its source gives (nothing else is fitted there).", "families": {}, "devices": {},
           "prior_weight": PRIOR_WEIGHT}
    fitted = {}
    for family, tables in CALIBRATION.items():
        cases = [c for t in tables for c in TABLES[t]()]
        c = fit_family(cases)
        staged = STAGED_CALIBRATION.get(family, [])
        c, _ = fit(cases + [x for t in staged for x in TABLES[t]()], c, grid=STAGED)
        s = score(cases, c)  # the family's own tables' error, the staged tables' left out
        consts = {k: v for k, v in asdict(c).items() if k in GRID or k in STAGED}
        entry = {"fitted_on": tables, "rms_log_error": round(math.sqrt(s), 4)}
        if staged:
            entry["staged_fitted_on"] = staged
        if family in MEMORY_CALIBRATION:
            entry["reserved_fitted_on"] = MEMORY_CALIBRATION[family]
            consts["reserved_gib"] = fit_reserved([x for t in MEMORY_CALIBRATION[family] for x in TABLES[t]()])
        out["families"][family] = {**entry, "constants": consts}
        fitted[family] = c
    for name, tables in DEVICE_CALIBRATION.items():
        dev = device(name)
        s, err = fit_sustained([c for t in tables for c in TABLES[t]()], dev, fitted.get(dev.family, Constants()))
        out["devices"][name] = {"fitted_on": tables, "sustained_range": [round(x, 4) for x in dev.sustained_range],
                                "rms_log_error": round(math.sqrt(err), 4), "sustained": s}
    path = Path(str(resources.files("hpcml.plan").joinpath("data/calibration.json")))
    text = json.dumps(out, indent=1) + "\n"
    if args.check:
        same = path.read_text() == text
        print("calibration.json is what the fit gives" if same else "calibration.json differs from the fit")
        return 0 if same else 1
    path.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
