"""The planner on Megatron-Turing NLG 530B (Megatron-DeepSpeed on 2,240-3,360 A100s, held out):
a second table of BLOOM's stack, on InfiniBand rather than Omni-Path, and a model of the same
shape as SC'21's 530B row, which Megatron-LM ran on the same machine."""

from __future__ import annotations

import pytest

from hpcml.plan import predict
from hpcml.plan.published import CALIBRATION, DEVICE_CALIBRATION, MEMORY_CALIBRATION, TABLES, megatron_flops, published


def _error(case) -> float:
    return predict(case.layout).tokens_per_s / case.layout.gpus / case.tokens_per_gpu - 1


def test_mtnlg_table_is_held_out_and_read_as_published():
    """Held out of every fit; 1,920 x 2,048 tokens a step on 8 GPUs a node; the quoted TFLOP/s are
    Narayanan et al.'s count with the recompute factor at the quoted seconds (within 0.5%)."""
    fitted = {t for ts in (*CALIBRATION.values(), *DEVICE_CALIBRATION.values(), *MEMORY_CALIBRATION.values())
              for t in ts}
    assert "mtnlg-530b-a100" not in fitted
    cases = TABLES["mtnlg-530b-a100"]()
    rows = published("mtnlg_530b_a100_2022")["rows"]
    assert [(c.layout.gpus, c.layout.dp, c.layout.microbatches, c.step_s) for c in cases] == [
        (2240, 8, 240, 60.1), (2800, 10, 192, 50.2), (3360, 12, 160, 44.4)]
    for c, (_, step, tflops) in zip(cases, rows, strict=True):
        assert c.tokens_per_gpu * c.layout.gpus * step == pytest.approx(1920 * 2048, rel=1e-12)
        flops = megatron_flops(20480, 105, 2048, 50272, True)
        assert flops * c.tokens_per_gpu / 1e12 == pytest.approx(tflops, rel=5e-3)
    assert 529e9 < cases[0].layout.model.num_params() < 531e9


def test_mtnlg_fits_and_is_predicted_as_fast_as_megatron_lm_ran_the_same_shape():
    """Every row fits (under 40 GiB, whichever A100 it ran on). SC'21's 530B row is the same model
    and the same tp 8 x pp 35 on the same machine under Megatron-LM: 37.9 tokens/s a GPU, 1.30x
    MT-NLG's 2,240-GPU row (a 2% smaller bubble of that). The planner prices DeepSpeed's pipeline
    engine as its source runs it (four blocking sends a micro-batch; within 7% on SC'21's row under
    Megatron's), and MT-NLG's rows still come out 17-28% fast: docs/plan.md. The bounds keep the
    gap from growing unnoticed."""
    cases = TABLES["mtnlg-530b-a100"]()
    sc21 = next(c for c in TABLES["sc21-table1"]() if c.layout.gpus == 2520)
    assert (sc21.layout.model.dim, sc21.layout.model.n_layers, sc21.layout.tp, sc21.layout.pp) == (20480, 105, 8, 35)
    assert sc21.tokens_per_gpu / cases[0].tokens_per_gpu == pytest.approx(1.30, abs=0.01)
    assert abs(_error(sc21)) < 0.07
    errors = [_error(c) for c in cases]
    for c in cases:
        p = predict(c.layout)
        assert p.fits and p.memory_gib["total"] < 40
    assert all(0.17 <= e <= 0.28 for e in errors), errors
    assert errors == sorted(errors)  # faster the more GPUs share the batch: the bubble's share grows
