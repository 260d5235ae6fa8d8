"""Megatron-core's gradient buckets in the planner's time (``timing._megatron_tail``): the last
bucket's reduction and the first bucket's parameter gather hide behind nothing, and a bucket is
``max(40e6, 1e6 x dp x cp)`` parameters (``DistributedDataParallelConfig.bucket_size``), so what
is exposed grows with the data ranks -- what makes NVIDIA's scaling tables' MFU fall with the GPU
count at a fixed batch a GPU."""

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


def test_the_exposed_data_parallel_time_is_the_bucket_tail_and_grows_with_the_data_ranks():
    rows = _rows()
    assert [c.layout.dp for c in rows] == [4, 8, 16, 32, 64, 128, 256, 512]
    dp_s = [predict(c.layout).parts_s["dp"] for c in rows]
    assert all(b > a for a, b in zip(dp_s, dp_s[1:])), dp_s
    assert dp_s[-1] > 10 * dp_s[0]
    for c, got in zip(rows, dp_s):  # the rest hides behind the micro-batches (overlap on): only the tail shows
        lay = c.layout
        dev = resolve_device(lay)
        st = rank_state(lay.model, lay, 0)
        ws = lay.dp * lay.cp
        share = min(1.0, max(40e6, 1e6 * ws) / st.compute_params)
        bw = timing._link(dev, ws, lay.tp)
        k = constants(dev)
        want = timing._ring(share * 4 * st.compute_params, ws, bw, k, 1.0) \
            + timing._ring(share * 2 * st.compute_params, ws, bw, k, 1.0)
        assert got == pytest.approx(want, rel=1e-9), c.label
    # and the MFU falls with the GPU count, as published (below 128 GPUs the distributed optimizer's
    # shrinking step outweighs the tail)
    mfu = [predict(c.layout).mfu for c in rows]
    assert mfu[-1] < mfu[0] and all(b < a for a, b in zip(mfu[3:], mfu[4:])), mfu


def test_no_tail_outside_megatron_and_a_bucket_never_exceeds_the_model():
    lay = _rows()[-1].layout
    other = replace(lay, framework="torchtitan")
    assert predict(other).parts_s["dp"] == 0.0  # all of it hidden: no bucket rule there
    dev, st = resolve_device(lay), rank_state(lay.model, lay, 0)
    c = constants(dev)
    bw = timing._link(dev, 512, lay.tp)
    small = replace(st, compute_params=int(10e6))  # a chunk smaller than one bucket: all of it is the tail
    whole = timing._ring(4 * 10e6, 512, bw, c, 1.0) + timing._ring(2 * 10e6, 512, bw, c, 1.0)
    assert timing._megatron_tail(lay, small, 512, bw, c, 4 * 10e6, 2 * 10e6) == pytest.approx(whole, rel=1e-12)
    assert timing._megatron_tail(lay, st, 1, bw, c, 4.0 * st.compute_params, 2.0 * st.compute_params) == 0.0


def test_the_fit_keeps_the_lowest_regularised_objective_of_its_starts():
    """The family fit is start-independent by construction: it runs the regularised descent from
    every start and keeps the lowest objective; the prior is 0 at the defaults and grows with the
    distance from them, in units of each grid's span (``attn_eff`` free)."""
    from hpcml.plan import fit as F
    from hpcml.plan.timing import Constants

    d = Constants()
    assert F.penalty(d) == 0.0 and F.penalty(replace(d, attn_eff=0.5)) == 0.0
    span = max(F.GRID["gemm_eff"]) - min(F.GRID["gemm_eff"])
    assert F.penalty(replace(d, gemm_eff=d.gemm_eff + span / 2)) == pytest.approx(0.25)
    cases = TABLES["foundry-h100-fp8"]()
    objective = F.regularised()
    assert objective(cases, d) == pytest.approx(F.score(cases, d))
    got = F.fit_family(cases)
    each = [F.descend(cases, replace(d, **s), objective)[1] for s in F.STARTS]
    assert objective(cases, got) == pytest.approx(min(each), rel=1e-12)
    assert len(F.STARTS) >= 3 and F.STARTS[0] == {}
