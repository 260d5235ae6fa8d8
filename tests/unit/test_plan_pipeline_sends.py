"""The planner's pipeline sends and DeepSpeed's per-micro-batch work, as the frameworks' sources run
them: Megatron and DeepSpeed send a 1/tp slice of an activation that is not sequence-parallel and
all-gather it after the receive (torch's pipelining sends it whole); DeepSpeed's schedule makes a
micro-batch's four sends and receives blocking calls one after the other (Megatron two batched
pairs); DeepSpeed's BF16_Optimizer adds each micro-batch's bf16 gradients into its fp32 copy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcml.plan import PlanLayout
from hpcml.plan.calibration import constants
from hpcml.plan.memory import saved_how
from hpcml.plan.placement import rank_state
from hpcml.plan.predict import resolve_device
from hpcml.plan.published import TABLES
from hpcml.plan.timing import _link, _rank_time, _ring


def _lay(**kw) -> PlanLayout:
    """BLOOM's full-batch row: tp 4 x pp 12, micro-batch 2, 128 micro-batches a pipeline."""
    return replace(TABLES["bloom-176b-a100"]()[-1].layout, **kw)


def _rank(lay: PlanLayout, r: int = 5):
    dev = resolve_device(lay)
    c = constants(dev)
    st = rank_state(lay.model, lay, r)
    return _rank_time(lay.model, lay, dev, c, r, st), dev, c, st


def test_pipeline_sends_as_each_framework_runs_them():
    """A middle rank's send time a step, from the bytes: the slice over one NIC's share and the
    all-gather over NVLink (Megatron, DeepSpeed), the whole over the NIC (hpcml), DeepSpeed's
    twice Megatron's; sequence-parallel activations are sent as the slices they are, not gathered."""
    mega = _lay(framework="megatron")
    t, dev, c, _ = _rank(mega)
    whole = mega.micro_batch * mega.seq_len * mega.model.dim * 2  # bf16 activation of one micro-batch
    assert saved_how(mega).stream_bytes == 2
    nic = _link(dev, mega.pp, mega.tp * mega.dp)
    assert nic == pytest.approx(50e9 / 8)  # one device's share of BLOOM's 50 GB/s node
    one = whole / mega.tp / (nic * c.comm_eff) + c.latency_s
    gather = _ring(whole, mega.tp, _link(dev, mega.tp, 1), c, 1.0)
    assert 0 < gather < one / 5
    m = mega.microbatches
    assert t.pp_s == pytest.approx(m * (2 * one + 2 * gather), rel=1e-12)
    ds = _rank(_lay(framework="deepspeed"))[0]
    assert ds.pp_s == pytest.approx(m * (4 * one + 2 * gather), rel=1e-12)
    hpcml = _lay(framework="hpcml", attention="flash", zero=0)
    hp = _rank(hpcml)[0]  # torch's pipelining: the whole tensor, its residual stream in fp32
    assert saved_how(hpcml).stream_bytes == 4
    assert hp.pp_s == pytest.approx(m * 2 * (2 * whole / (nic * c.comm_eff) + c.latency_s), rel=1e-12)
    sp = _rank(_lay(framework="megatron", sequence_parallel=True))[0]
    assert sp.pp_s == pytest.approx(m * 2 * one, rel=1e-12)
    one_tp = _rank(_lay(framework="megatron", tp=1, gpus=96))[0]  # nothing to slice: the whole, no gather
    assert one_tp.pp_s == pytest.approx(m * 2 * (whole / (_link(dev, 12, 8) * c.comm_eff) + c.latency_s),
                                        rel=1e-12)


def test_bf16_optimizer_accumulates_each_micro_batch_in_fp32():
    """18 bytes a parameter of HBM traffic a micro-batch (bf16 read, fp32 temporary written and
    read, the fp32 copy read and written), only under DeepSpeed's BF16_Optimizer: ZeRO 0-1 with
    fp32 gradients; with 16-bit gradient reduction (DeepSpeed before 2022-04, fp16 ZeRO-1), at
    ZeRO-2, in fp32, or under Megatron none."""
    lay = _lay()
    t, dev, _, st = _rank(lay)
    plain = _rank(replace(lay, reduce_dtype="bf16"))[0]
    extra = lay.microbatches * 18 * st.compute_params / (dev.hbm_gbps * 1e9)
    assert t.compute_s - plain.compute_s == pytest.approx(extra, rel=1e-9)
    assert 2.5 < extra < 6  # 3.7e9 parameters a rank, 128 micro-batches, 2,039 GB/s: 4.2 s of a ~100 s step
    assert t.flops_per_rank == plain.flops_per_rank  # memory traffic, no FLOPs
    mega = _rank(replace(lay, framework="megatron"))[0]
    assert mega.compute_s == pytest.approx(plain.compute_s, rel=1e-12)
    flat = replace(lay, pp=1, tp=4, gpus=32, global_batch=64, micro_batch=1)
    fl, dev1, _, st1 = _rank(flat, 0)
    assert fl.compute_s - _rank(replace(flat, reduce_dtype="bf16"), 0)[0].compute_s == pytest.approx(
        flat.microbatches * 18 * st1.compute_params / (dev1.hbm_gbps * 1e9), rel=1e-9)
    z2 = replace(flat, zero=2)
    assert _rank(z2, 0)[0].compute_s == pytest.approx(_rank(replace(z2, reduce_dtype="bf16"), 0)[0].compute_s,
                                                      rel=1e-12)


def test_mtnlg_ran_before_the_bf16_optimizer_existed():
    """DeepSpeed's BF16_Optimizer came with 'bf16+pipeline parallelism' (#1801, 2022-04-19), after
    MT-NLG trained (paper 2022-01): its rows are priced with 16-bit gradients, BLOOM's (2022-03 on,
    the optimizer named in its README) with the fp32 copy."""
    assert {c.layout.reduce_dtype for c in TABLES["mtnlg-530b-a100"]()} == {"bf16"}
    assert {c.layout.reduce_dtype for c in TABLES["bloom-176b-a100"]()} == {"fp32"}


def test_sends_scale_with_the_chunks_a_rank_holds_and_the_tokens_a_cp_rank_has():
    """Interleaved: each of a rank's v chunks sends and receives once a micro-batch each way, so a
    middle rank's send time is v times 1F1B's; context parallelism: a rank sends its 1/cp of the
    sequence (the same link: one device's share of its node)."""
    base = _lay(framework="megatron", sequence_parallel=True, global_batch=768, micro_batch=1)  # 96 micro-batches
    one = _rank(base)[0].pp_s
    two = _rank(replace(base, schedule="interleaved1f1b", stages_per_rank=2))[0].pp_s
    assert two == pytest.approx(2 * one, rel=1e-12)
    cp2 = replace(base, cp=2, gpus=base.gpus * 2)
    t, dev, c, _ = _rank(cp2)
    m = cp2.microbatches
    sent = cp2.micro_batch * cp2.seq_len / 2 * cp2.model.dim * 2 / cp2.tp
    assert t.pp_s == pytest.approx(m * 2 * (sent / (_link(dev, cp2.pp, cp2.tp * 2 * cp2.dp) * c.comm_eff)
                                            + c.latency_s), rel=1e-12)
    assert t.pp_s < one
