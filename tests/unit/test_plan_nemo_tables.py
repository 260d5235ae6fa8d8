"""Two more of NVIDIA's recipe tables: GPT-3 175B (held out: GeLU, LayerNorm, biases, learned
positions and a tied output layer under a pipeline, FlashAttention-2 through Transformer Engine)
and Llama 3.1 8B (cuDNN's attention at 8K on TP 1: the table ``attn_eff_fused`` is fitted on)."""

from __future__ import annotations

import pytest

from hpcml.plan.published import CALIBRATION, STAGED_CALIBRATION, TABLES
from hpcml.plan.scoring import score_table


def test_gpt3_175b_table_is_held_out_read_as_published_and_meets_the_bars():
    assert all("nemo-gpt3-175b-h100" not in t for t in (*CALIBRATION.values(), *STAGED_CALIBRATION.values()))
    cases = TABLES["nemo-gpt3-175b-h100"]()
    assert len(cases) == 10
    assert cases[0].tokens_per_gpu * 128 == pytest.approx(58843, abs=1)  # the README's 128-GPU BF16 figure
    assert cases[-1].tokens_per_gpu * 2048 == pytest.approx(1344328, abs=1)  # and its 2,048-GPU FP8 one
    lay = cases[0].layout
    assert (lay.tp, lay.pp, lay.v, lay.microbatches, lay.attention) == (4, 8, 12, 64, "flash-attn")
    cfg = lay.model
    assert (cfg.activation, cfg.norm, cfg.bias, cfg.positions, cfg.tie_embeddings) == (
        "gelu", "layernorm", True, "learned", True)
    assert 174e9 < cfg.num_params() < 176e9 and cfg.padded_vocab == 50688
    assert [c.layout.fp8_params for c in cases] == [False, True] * 5  # the config's fp8_params, FP8 runs only
    sc = score_table(cases)
    assert sc.fit_agrees == 1.0 and sc.median <= 0.10 and sc.p90 <= 0.25, sc.errors


def test_llama31_8b_table_fits_megatrons_attention_and_is_read_as_published():
    """Fitted on (``attn_eff_fused`` alone, the other constants held): within 5% on every row."""
    assert STAGED_CALIBRATION["nvidia-h100"] == ["nemo-llama31-8b-h100", "torchtitan-h100-compile"]
    cases = TABLES["nemo-llama31-8b-h100"]()
    assert len(cases) == 10
    assert cases[0].tokens_per_gpu * 8 == pytest.approx(81222, abs=1)  # the README's 8-GPU BF16 figure
    assert cases[-1].tokens_per_gpu * 128 == pytest.approx(1708474, abs=1)
    lay = cases[0].layout
    assert (lay.tp, lay.cp, lay.pp, lay.microbatches, lay.attention, lay.sequence_parallel) == (
        1, 2, 1, 32, "flash", False)
    sc = score_table(cases)
    assert sc.fit_agrees == 1.0 and all(abs(e) <= 0.05 for e in sc.errors), sc.errors


def test_a_tables_p90_is_interpolated_and_never_under_its_median():
    """Between ranks, as numpy's default: a 2-row table's p90 is not its smaller error."""
    from hpcml.plan.scoring import TableScore

    class Pred:
        mfu, fits = 0.5, True

    def p90(errs):
        return TableScore([None] * len(errs), [Pred()] * len(errs), errs).p90

    assert p90([0.014, 0.018]) == pytest.approx(0.0176) and p90([0.018, -0.014]) == pytest.approx(0.0176)
    assert p90([0.1]) == 0.1 and p90([None]) is None
    assert p90([i / 100 for i in range(11)]) == pytest.approx(0.09)
    sc = score_table(TABLES["torchtitan-h100"]())
    assert sc.p90 >= sc.median
