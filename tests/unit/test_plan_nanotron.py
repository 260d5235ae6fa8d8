"""Hugging Face's Ultra-Scale Playbook runs (nanotron, 1-64 nodes of 8 H100s), held out: 1,751
layouts of DP x TP x PP with ZeRO-0/1 read from their run names, 1,283 that ran and 468 that ran
out of memory. The planner gets the out-of-memory outcome right on 96% of them; their speed it
gets within a node (median 12%) and not across nodes, where HF's cluster measured a falling
all-reduce bus bandwidth (458 GB/s in one node, 13 at 64) and ran slower still (docs/plan.md)."""

from __future__ import annotations

import statistics

import pytest

from hpcml.plan.calibration import constants
from hpcml.plan.predict import predict, resolve_device
from hpcml.plan.published import CALIBRATION, TABLES
from hpcml.plan.published_nanotron import _layout, nanotron_h100


@pytest.fixture(scope="module")
def priced():
    cases = TABLES["nanotron-h100"]()
    return cases, [predict(c.layout) for c in cases]


def test_the_table_is_read_as_published(priced):
    cases, _ = priced
    assert all("nanotron-h100" not in t for t in CALIBRATION.values())
    assert len(cases) == 1751 and sum(c.fits for c in cases) == 1283
    first = cases[0]  # job 14113488: the Playbook's plot shows it as 40,150 tok/s/gpu, 50.2 GB
    assert first.label.endswith("(job 14113488)") and first.tokens_per_gpu == 40149.94 and first.memory_gib == 50.18
    lay = first.layout
    assert (lay.gpus, lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.microbatches, lay.zero) == (8, 1, 1, 8, 2, 16, 0)
    assert lay.global_batch * lay.seq_len == 1 << 20  # the Playbook's 1M tokens a step
    assert 1.3e9 < lay.model.num_params() < 1.4e9 and lay.model.tie_embeddings
    big = _layout("80G_dp2_tp4_pp16_acc64_mbs2_zero1_vocab49k_gqa8", {"80G": [80, 8192, 64, 28672]})
    assert (big.model.n_kv_heads, big.model.vocab_size, big.gpus, big.pp, big.sequence_parallel) == \
        (8, 49152, 128, 16, True)
    with pytest.raises(ValueError, match="run name '8B_dp2' is not one"):
        _layout("8B_dp2", {})


def test_out_of_memory_is_predicted_right_on_nine_in_ten(priced):
    cases, preds = priced
    agree = sum(c.fits == p.fits for c, p in zip(cases, preds)) / len(cases)
    assert agree >= 0.95, agree
    assert sum(c.fits and not p.fits for c, p in zip(cases, preds)) <= 5  # a run that ran, called OOM: rare


def test_speed_within_a_node_and_not_across_nodes(priced):
    """Held to what it is, so a change that moves it shows: within one node median |error| ~12%;
    from 4 nodes the planner is 40-470% fast, and 29-63% fast even priced on each job's own
    measured all-reduce bandwidth (``measured_network``)."""
    cases, preds = priced

    def errors(pairs, lo, hi):
        return [p.tokens_per_s / c.layout.gpus / c.tokens_per_gpu - 1 for c, p in pairs
                if c.fits and lo <= c.layout.gpus <= hi]

    pairs = list(zip(cases, preds))
    one = errors(pairs, 1, 8)
    assert len(one) == 64 and statistics.median(abs(e) for e in one) <= 0.15
    many = errors(pairs, 32, 512)
    assert statistics.median(many) > 0.4
    c = constants(resolve_device(cases[0].layout)).comm_eff
    measured = nanotron_h100(measured_network=True, comm_eff=c)
    got = errors([(m, predict(m.layout)) for m in measured if m.fits and m.layout.gpus >= 32], 32, 512)
    assert len(got) == len(many) and 0.2 < statistics.median(got) < statistics.median(many)
