"""Megatron-core's gradient buckets in the planner's time (``timing._megatron_tail``). With its
gradient reduction overlapped, Megatron-core fills buckets of ``max(40e6, 1e6 x dp x cp)``
parameters (``DistributedDataParallelConfig.bucket_size``) from the last parameter back, never
splitting one, and buckets only a rank's first model chunk; the last bucket -- the first
parameters, the whole embedding shard on the first stage -- is reduced after the backward and, at
ZeRO-1, gathered first before the next forward: nothing hides it. A pipeline drains on its first
rank, so that rank's tail follows the slowest rank's schedule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcml.plan import timing
from hpcml.plan.calibration import constants
from hpcml.plan.placement import rank_state
from hpcml.plan.predict import predict, resolve_device
from hpcml.plan.published import TABLES


def _rows():
    return [c for c in TABLES["nemo-nemotron4-15b-h100"]() if c.layout.precision != "fp8"]


def test_the_last_bucket_never_splits_a_tensor():
    last = timing._last_bucket
    # from the back: 40 closes a bucket, 30 + 20 another, then 10 + 393 (the embedding) the last
    assert last([393, 10, 20, 30, 40], 40) == 403
    assert last([393, 10, 20, 30, 40], 1000) == 493  # one bucket holds them all
    assert last([5, 50, 50], 40) == 5  # a remainder after the last full bucket is a bucket of its own
    assert last([50, 50], 40) == 50


def test_the_15b_recipes_exposed_time_is_its_embedding_bucket():
    """TP 4, no pipeline: the last bucket is the whole embedding shard (256,000 x 6,144 / 4
    parameters) and what was left before it; its reduce-scatter (fp32 gradients) and its gather
    (bf16 weights) are the data-parallel time, the rest hidden; more of it as the ring grows."""
    rows = _rows()
    assert [c.layout.dp for c in rows] == [4, 8, 16, 32, 64, 128, 256, 512]
    emb = 256000 * 6144 / 4
    dp_s = []
    for c in rows:
        lay = c.layout
        dev = resolve_device(lay)
        k, ws = constants(dev), lay.dp * lay.cp
        last = timing._last_bucket(timing._chunk0_tensors(lay.model, lay, tuple(range(32)), True),
                                   max(40e6, 1e6 * ws))
        assert emb <= last < emb + max(40e6, 1e6 * ws)
        bw = timing._link(dev, ws, lay.tp)
        want = timing._ring(4 * last, ws, bw, k, 1.0) + timing._ring(2 * last, ws, bw, k, 1.0)
        got = predict(lay).parts_s["dp"]
        assert got == pytest.approx(want, rel=1e-9), c.label
        dp_s.append(got)
    assert all(b > a for a, b in zip(dp_s, dp_s[1:])), dp_s
    mfu = [predict(c.layout).mfu for c in rows]
    assert mfu[-1] < mfu[0]


def test_no_tail_without_overlap_or_outside_megatron():
    lay = _rows()[-1].layout
    assert predict(replace(lay, framework="torchtitan")).parts_s["dp"] == 0.0  # all hidden, no bucket rule
    c, dev = constants(resolve_device(lay)), resolve_device(lay)
    # without overlap Megatron-core makes one bucket (bucket_size None): what hides behind the last
    # backward hides, nothing is a tail -- all of it hidden here, where the overlapped run shows its tail
    hidden = timing.step_time(lay.model, replace(lay, overlap=False), dev, replace(c, dp_overlap=1.0))
    tailed = timing.step_time(lay.model, lay, dev, replace(c, dp_overlap=1.0))
    assert hidden.dp_s == 0.0 and tailed.dp_s > 0.0


def test_a_pipeline_pays_its_first_ranks_tail_after_the_slowest_schedule():
    """Nemotron-4 340B's recipe (TP 8 x PP 8, 12 virtual stages): the step is at least the slowest
    rank's schedule plus the first rank's data-parallel time and optimizer step."""
    lay = TABLES["nemo-nemotron4-340b-h100"]()[-2].layout
    dev, cfg = resolve_device(lay), lay.model
    c = constants(dev)
    times = [timing._rank_time(cfg, lay, dev, c, r, rank_state(cfg, lay, r))
             for r in timing.rank_classes(cfg.n_layers, lay.pp, lay.v, lay.split, timing.moe_layers(cfg))]
    pipe = max(t.step_s - t.dp_s - t.optimizer_s for t in times)
    step = timing.step_time(cfg, lay, dev, c)
    assert step.step_s == pytest.approx(max(max(t.step_s for t in times), pipe + times[0].dp_s + times[0].optimizer_s))
    assert step.step_s > max(t.step_s for t in times)  # here the drain decides


def test_the_fit_keeps_the_lowest_regularised_objective_of_its_starts():
    """The family fit is start-independent by construction: it runs the regularised descent from
    every start and keeps the lowest objective; the prior is 0 at the defaults and grows with the
    distance from them, in units of each grid's span (``attn_eff`` free); a pair step moves to the
    grid points either side of a value, on the grid or not."""
    from hpcml.plan import fit as F
    from hpcml.plan.constants import Constants

    d = Constants()
    assert F.penalty(d) == 0.0 and F.penalty(replace(d, attn_eff=0.5)) == 0.0
    span = max(F.GRID["gemm_eff"]) - min(F.GRID["gemm_eff"])
    assert F.penalty(replace(d, gemm_eff=d.gemm_eff + span / 2)) == pytest.approx(0.25)
    assert F._neighbours("gemm_eff", 0.75) == (0.74, 0.76) and F._neighbours("m_half", 0.0) == (None, 64.0)
    cases = TABLES["foundry-h100-fp8"]()
    objective = F.regularised()
    assert objective(cases, d) == pytest.approx(F.score(cases, d))
    got = F.fit_family(cases)
    each = [F.descend(cases, replace(d, **s), objective)[1] for s in F.STARTS]
    assert objective(cases, got) == pytest.approx(min(each), rel=1e-12)
    assert F._pair_step(cases, got, objective(cases, got), objective, list(F.GRID)) is None  # converged
