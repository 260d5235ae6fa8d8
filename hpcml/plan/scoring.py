"""A published table's figures against the planner: what fits, each comparable row's error,
and how the planner ranks the rows -- the same figures for ``benchmarks/plan_validate.py
--tables`` and the tests that pin each table's bars."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hpcml.plan.fit import spearman
from hpcml.plan.predict import Prediction, predict
from hpcml.plan.published import Case


@dataclass(frozen=True)
class TableScore:
    cases: list[Case]
    predictions: list[Prediction]
    errors: list[float | None]
    """Per case: predicted over published tokens/s a GPU, minus 1; None where not comparable (no
    published figure, an out-of-memory row, or a row the planner refuses: those count in
    :attr:`fit_agrees` alone)."""

    @property
    def fit_agrees(self) -> float:
        return sum(p.fits == c.fits for c, p in zip(self.cases, self.predictions)) / len(self.cases)

    @property
    def abs_errors(self) -> list[float]:
        return sorted(abs(e) for e in self.errors if e is not None)

    @property
    def median(self) -> float | None:
        return statistics.median(self.abs_errors) if self.abs_errors else None

    @property
    def p90(self) -> float | None:
        """The 90th percentile, interpolated between ranks (numpy's default): never under the
        median, whatever the rows (a lower rank gave a 2-row table's p90 as its smaller error)."""
        errs = self.abs_errors
        if len(errs) < 2:
            return errs[0] if errs else None
        return statistics.quantiles(errs, n=10, method="inclusive")[8]

    @property
    def within_15pct(self) -> float:
        return sum(e <= 0.15 for e in self.abs_errors) / max(1, len(self.abs_errors))

    @property
    def spearman_mfu(self) -> float | None:
        """Rank correlation of predicted with published MFU over the comparable rows (the published
        MFU as the prediction's over 1 + error: unrounded, so no false ties)."""
        pairs = [(p.mfu, p.mfu / (1 + e)) for p, e in zip(self.predictions, self.errors) if e is not None]
        return spearman(*map(list, zip(*pairs))) if len(pairs) > 2 else None


def score_table(cases: list[Case]) -> TableScore:
    preds, errors = [], []
    for case in cases:
        p = predict(case.layout)
        preds.append(p)
        ok = case.tokens_per_gpu and case.fits and p.tokens_per_s > 0
        errors.append(p.tokens_per_s / case.layout.gpus / case.tokens_per_gpu - 1 if ok else None)
    return TableScore(cases, preds, errors)
