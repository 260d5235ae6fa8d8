"""``framework: deepspeed`` (Megatron-DeepSpeed: Megatron's blocks on DeepSpeed's engine) as its
source runs it: the BF16_Optimizer's whole fp32 gradient copy, all-reduced after the last
micro-batch with nothing hidden, the bf16 weights all-gathered after a ZeRO-1 step; its pipeline
engine's limits (1F1B, ZeRO 0-1) refused by name, by a layout and by the search."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from hpcml.errors import ConfigError
from hpcml.models.transformer.config import TransformerConfig
from hpcml.plan import PlanLayout, predict
from hpcml.plan.calibration import constants
from hpcml.plan.memory import memory
from hpcml.plan.placement import rank_state
from hpcml.plan.predict import resolve_device
from hpcml.plan.timing import _link, _ring, step_time

CFG = TransformerConfig(vocab_size=32000, dim=2048, n_heads=16, n_layers=8, max_seq_len=2048)


def _lay(**kw) -> PlanLayout:
    base = dict(model=CFG, gpus=16, gpu="a100-80gb", seq_len=2048, global_batch=64, micro_batch=2, zero=1,
                framework="deepspeed")
    return PlanLayout(**{**base, **kw})


def test_bf16_optimizer_holds_bf16_gradients_and_a_whole_fp32_copy():
    """6 bytes a parameter of gradients (bf16 + the fp32 buffer it accumulates into), against
    Megatron's 4 (its main gradients alone); the same weights and optimizer shards."""
    ds, mg = memory(CFG, _lay()), memory(CFG, _lay(framework="megatron"))
    st = rank_state(CFG, _lay(), 0)
    assert ds.grads == 6.0 * st.grads and mg.grads == 4.0 * st.grads
    assert (ds.params, ds.optimizer) == (mg.params, mg.optimizer) == (2.0 * st.params, 12.0 * st.optimizer)
    assert memory(CFG, _lay(reduce_dtype="bf16")).grads == 2.0 * st.grads  # bf16 accumulation: no fp32 copy
    z3, z2 = rank_state(CFG, _lay(zero=3), 0), rank_state(CFG, _lay(zero=2), 0)
    assert memory(CFG, _lay(zero=3)).params == 2.0 * z3.params < 2.0 * z3.compute_params  # ZeRO-3: shards
    assert memory(CFG, _lay(zero=2)).params == 2.0 * z2.compute_params  # ZeRO-2: its bf16 weights whole
    assert memory(CFG, _lay(zero=2)).grads == 4.0 * z2.grads < 4.0 * z2.compute_params  # a fp32 partition


def test_the_gradients_are_all_reduced_whole_after_the_last_micro_batch():
    """ZeRO-1: an all-reduce of the whole fp32 gradients and an all-gather of the bf16 weights,
    none of it behind compute; Megatron's distributed optimizer reduce-scatters, hidden in part."""
    lay = _lay()
    dev = resolve_device(lay)
    c = constants(dev)
    st = rank_state(CFG, lay, 0)
    bw = _link(dev, lay.dp, lay.tp)
    expected = _ring(4.0 * st.compute_params, lay.dp, bw, c, 2.0) + _ring(2.0 * st.params, lay.dp, bw, c, 1.0)
    assert step_time(CFG, lay, dev, c).dp_s == pytest.approx(expected, rel=1e-12)
    mg = step_time(CFG, _lay(framework="megatron"), dev, c).dp_s
    assert mg < expected - _ring(4.0 * st.compute_params, lay.dp, bw, c, 1.0) + 1e-12
    zero0 = step_time(CFG, _lay(zero=0), dev, c).dp_s
    assert zero0 == pytest.approx(_ring(4.0 * st.compute_params, lay.dp, bw, c, 2.0), rel=1e-12)


def test_bloom_is_priced_as_deepspeed_runs_it():
    """BLOOM's small-batch rows: the step's fixed cost is its gradient sync, so DeepSpeed's
    (whole fp32 all-reduce, nothing hidden) predicts them slower than Megatron's would."""
    from hpcml.plan.published import TABLES

    small = TABLES["bloom-176b-a100"]()[0]
    assert small.layout.framework == "deepspeed"
    ds, mg = predict(small.layout), predict(replace(small.layout, framework="megatron"))
    assert ds.fits and ds.parts_s["dp"] > 1.4 * mg.parts_s["dp"] and ds.step_s > mg.step_s


@pytest.mark.parametrize("kw, words", [
    (dict(gpus=16, pp=2, zero=3), "DeepSpeed's pipeline engine runs ZeRO 0 or 1 only"),
    (dict(gpus=16, pp=2, zero=2), "pp 2 and zero 2"),
    (dict(gpus=16, pp=2, schedule="interleaved1f1b", stages_per_rank=2), "runs 1F1B only"),
    (dict(overlap=True), "all-reduces the gradients after the last micro-batch"),
])
def test_what_deepspeed_cannot_run_is_refused_by_name(kw, words):
    with pytest.raises(ConfigError) as e:
        _lay(**kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_deepspeed_search_keeps_to_what_its_engine_runs():
    from hpcml.plan.search import candidates

    base = PlanLayout(model=CFG, gpus=16, gpu="a100-80gb", seq_len=2048, global_batch=64, framework="deepspeed",
                      degrees_checked=False)
    lays = list(candidates(base, CFG, resolve_device(base)))
    assert {lay.zero for lay in lays if lay.pp == 1} == {0, 1, 2, 3}
    assert {lay.zero for lay in lays if lay.pp > 1} == {0, 1}
    assert {lay.schedule for lay in lays if lay.pp > 1} == {"1f1b"}
    assert {lay.recompute for lay in lays} == {"none", "selective", "full"}


def test_the_command_line_plans_deepspeed():
    out = subprocess.run([sys.executable, "-m", "hpcml.cli", "plan", "--model", "llama3-8b", "--gpus", "16",
                          "--gpu", "a100-80gb", "--seq-len", "4096", "--global-batch", "64", "--framework",
                          "deepspeed", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    best = json.loads(out.stdout)["best"]
    assert best and all(b["layout"]["framework"] == "deepspeed" for b in best)
    assert all(b["layout"]["pp"] == 1 or b["layout"]["zero"] <= 1 for b in best)
    bad = subprocess.run([sys.executable, "-m", "hpcml.cli", "plan", "--model", "llama3-8b", "--gpus", "16",
                          "--gpu", "a100-80gb", "--seq-len", "4096", "--global-batch", "64", "--framework",
                          "deepspeed", "--pp", "2", "--zero", "3", "--micro-batch", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "ZeRO 0 or 1 only" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
