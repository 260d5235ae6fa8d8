"""The planner on 3-D parallelism at scale (issue 42): FSDP under a pipeline synchronises once a
step, as torch.distributed.pipelining runs it, and Llama 3 405B's published configurations on
8,192-16,384 H100s, held out of every fit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcml.errors import ConfigError
from hpcml.plan import PlanLayout, predict
from hpcml.plan.memory import memory
from hpcml.plan.placement import rank_state
from hpcml.plan.predict import load_model
from hpcml.plan.published import CALIBRATION, DEVICE_CALIBRATION, MEMORY_CALIBRATION, TABLES, llama3_405b


def _pp_fsdp(framework: str, global_batch: int, zero: int = 2) -> PlanLayout:
    cfg = replace(load_model("llama3-8b"), n_layers=8)
    return PlanLayout(model=cfg, gpus=64, gpu="h100-80gb", seq_len=4096, global_batch=global_batch, tp=2, pp=4,
                      zero=zero, framework=framework)


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_under_a_pipeline_gathers_and_reduces_once_a_step(zero, monkeypatch):
    """torch.distributed.pipelining keeps an FSDP stage's parameters gathered and its gradients
    unreduced until the last micro-batch (``set_requires_gradient_sync(False)`` on every other
    backward): the data-parallel time does not grow with the micro-batches, and the unsharded
    fp32 gradients are held meanwhile. Without a pipeline torchtitan's FSDP syncs every one."""
    few, many = predict(_pp_fsdp("torchtitan", 16, zero)), predict(_pp_fsdp("torchtitan", 64, zero))
    assert many.parts_s["dp"] == pytest.approx(few.parts_s["dp"], rel=1e-9) and few.parts_s["dp"] > 0
    cfg = _pp_fsdp("torchtitan", 16).model
    flat = replace(_pp_fsdp("torchtitan", 16, zero), pp=1, tp=8)  # 8 data ranks, no pipeline
    flat_many = replace(flat, global_batch=64)
    assert predict(flat_many).parts_s["dp"] > 3 * predict(flat).parts_s["dp"]
    lay = _pp_fsdp("torchtitan", 64, zero)
    one_mb = replace(lay, global_batch=8)  # one micro-batch a data rank: nothing to accumulate
    from hpcml.plan import memory as memory_module

    monkeypatch.setattr(memory_module, "_stage_output_bytes", lambda cfg, lay, how, mine: (0.0,) * len(mine))
    for r in range(lay.pp):  # (torchtitan's split: the ranks hold 2, 3, 2 and 1 blocks)
        grads = 4 * rank_state(cfg, lay, r).compute_params
        assert memory(cfg, lay, pp_rank=r).buffers - memory(cfg, one_mb, pp_rank=r).buffers == pytest.approx(
            grads, rel=1e-9)


def test_zero3_under_a_pipeline_gathers_again_in_each_backward():
    """Resharding after forward (ZeRO-3), each micro-batch's backward gathers the stage again (its
    parameters then serve the next forward unsharded): m + 1 gathers a step, against ZeRO-2's one.
    On 256 data ranks of short sequences the traffic is exposed, so the difference is m gathers."""
    cfg = replace(load_model("llama3-8b"), n_layers=8)
    extra = []
    for batch in (256, 1024):
        dp = [predict(PlanLayout(model=cfg, gpus=512, gpu="h100-80gb", seq_len=256, global_batch=batch, pp=2,
                                 zero=zero, framework="torchtitan")).parts_s["dp"] for zero in (2, 3)]
        extra.append(dp[1] - dp[0])
    assert extra[0] > 0 and extra[1] == pytest.approx(4 * extra[0], rel=1e-9)  # 1 and 4 micro-batches


def test_sequence_parallel_with_cp_is_priced_for_other_frameworks_and_refused_for_hpcml():
    base = dict(model="llama3-8b", gpus=64, gpu="h100-80gb", seq_len=32768, global_batch=16, tp=4, cp=2, pp=2,
                zero=1, sequence_parallel=True)
    sp = predict(PlanLayout(**base, framework="megatron"))
    no_sp = predict(PlanLayout(**{**base, "sequence_parallel": False}, framework="megatron"))
    assert sp.fits and sp.memory_gib["activations"] < no_sp.memory_gib["activations"]
    with pytest.raises(ConfigError, match="sequence_parallel with cp 2 > 1 is not supported by hpcml's trainer"):
        PlanLayout(**base, framework="hpcml")


def test_llama3_405b_table_is_held_out_and_read_as_published():
    cases = TABLES["llama3-405b-h100"]()
    fitted = {t for ts in (*CALIBRATION.values(), *DEVICE_CALIBRATION.values(), *MEMORY_CALIBRATION.values())
              for t in ts}
    assert "llama3-405b-h100" not in fitted
    assert [(c.layout.gpus, c.layout.tp, c.layout.cp, c.layout.pp, c.layout.dp) for c in cases] == [
        (8192, 8, 1, 16, 64), (16384, 8, 1, 16, 128), (16384, 8, 16, 16, 8)]
    assert all(c.layout.global_batch * c.layout.seq_len == 1 << 24 for c in cases)  # 16M tokens a step
    assert [round(c.notes["mfu"], 3) for c in cases] == [0.435, 0.404, 0.384]
    assert 400e9 < cases[0].layout.model.num_params() < 410e9


def test_llama3_405b_at_8k_within_five_percent_with_the_papers_schedule():
    """The paper's schedule (section 3.3.2): interleaved, the first chunk the embedding alone and the
    last the output alone -- 126 blocks + 2 in 128 one-block chunks, 8 a rank (torchtitan's split).
    Its 8K rows within 5%; four virtual stages within 10%; plain 1F1B's bubble is the lower bound.
    The 128K row is not met: flash attention's efficiency fitted on llm-foundry's FA2 runs prices
    its attention ~3x slower than Meta's kernels ran it."""
    def errors(**kw) -> list[float]:
        return [predict(c.layout).tokens_per_s / c.layout.gpus / c.tokens_per_gpu - 1 for c in llama3_405b(**kw)]

    papers = errors()
    assert llama3_405b()[0].layout.v == 8 and all(abs(e) <= 0.05 for e in papers[:2]), papers
    assert -0.5 < papers[2] < -0.3, papers  # the 128K row, as documented
    assert all(abs(e) <= 0.10 for e in errors(stages_per_rank=4)[:2])
    plain = errors(schedule="1f1b", stages_per_rank=None)[:2]
    assert all(-0.45 < e < -0.2 for e in plain), plain


def test_a_config_hashes_its_fields_once_and_keeps_the_hash_to_itself():
    import pickle
    from dataclasses import fields

    cfg = load_model("llama3-8b")
    assert hash(cfg) == hash(tuple(getattr(cfg, f.name) for f in fields(cfg))) == hash(replace(cfg))
    assert cfg.__dict__["_hash"] == hash(cfg) and replace(cfg) == cfg and replace(cfg, n_layers=3) != cfg
    assert "_hash" not in repr(cfg) and "_hash" not in cfg.to_dict()
    back = pickle.loads(pickle.dumps(cfg))
    assert "_hash" not in back.__dict__ and back == cfg and hash(back) == hash(cfg)


def test_megatrons_fused_blocks_keep_three_tensors_of_the_mlp_and_no_normalised_copy():
    """Megatron-core's bias-SwiGLU saves its input (gate and up) and fc2 the product: three tensors
    of the MLP's width, not eager torch's four (the SiLU too); Transformer Engine's RMSNorm its input
    and 1/rms. The planner counts it for ``framework: megatron`` only."""
    from hpcml.models.transformer import footprint as fp
    from hpcml.plan.memory import saved_how

    cfg = replace(load_model("llama3-8b"), n_layers=2)
    lay = PlanLayout(model=cfg, gpus=8, gpu="h100-80gb", seq_len=4096, global_batch=8, tp=4, zero=1,
                     sequence_parallel=True, framework="megatron")
    how = saved_how(lay)
    assert how.fused_blocks and not saved_how(replace(lay, framework="torchtitan")).fused_blocks
    eager = replace(how, fused_blocks=False)
    diff = fp.layer_saved(cfg, 0, 4096, eager) - fp.layer_saved(cfg, 0, 4096, how)
    assert diff == pytest.approx(2 * cfg.hidden / 4 + 2 * 2 * cfg.dim / 4, rel=1e-12)  # bf16: a width / tp, two norms
    assert memory(cfg, lay).activations < memory(cfg, replace(lay, framework="torchtitan")).activations


def test_gradients_accumulated_unsharded_are_held_in_the_reduce_dtype():
    """FSDP2 keeps a gradient that is not synchronised yet in its reduce dtype
    (``FSDPParam.to_accumulated_grad_if_needed``): a bf16 reduction holds 2 bytes a parameter of the
    stage between micro-batches, not 4."""
    lay = _pp_fsdp("torchtitan", 64)
    cfg = lay.model
    grads = rank_state(cfg, lay, memory(cfg, lay).pp_rank).compute_params
    bf16 = replace(lay, reduce_dtype="bf16")
    assert memory(cfg, lay).buffers - memory(cfg, bf16).buffers == pytest.approx(2 * grads, rel=1e-9)


def test_with_recompute_is_replace_without_the_other_checks():
    lay = _pp_fsdp("torchtitan", 64)
    assert lay.with_recompute("full") == replace(lay, recompute="full") and lay.recompute == "none"
    with pytest.raises(ConfigError, match="recompute='most': expected one of"):
        lay.with_recompute("most")


def test_with_zero_is_replace_where_no_rule_reads_the_stage_and_checks_in_full_where_one_does():
    """The search's ZeRO loop: a plain layout at another stage equals ``replace``'s; where a rule
    reads the stage (hpZ needs zero 3, NeMo's remainders zero 0-1, the range) the full check names it."""
    lay = _pp_fsdp("torchtitan", 64)
    for zero in (0, 1, 2, 3):
        assert lay.with_zero(zero) == replace(lay, zero=zero)
    assert lay.with_zero(1).zero == 1 and lay.zero == 2  # a copy
    with pytest.raises(ConfigError, match="zero=4: expected 0, 1, 2 or 3"):
        lay.with_zero(4)
    base = dict(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=4096, global_batch=8)
    with pytest.raises(ConfigError, match="hpz True.*with zero 2"):
        PlanLayout(**base, zero=3, hpz=True).with_zero(2)
    with pytest.raises(ConfigError, match="master_weights remainder with framework megatron, zero 2"):
        PlanLayout(**base, zero=1, framework="megatron", master_weights="remainder").with_zero(2)


def test_nemo_llama31_405b_table_is_held_out_and_read_as_published():
    """NVIDIA's recipe at 32-2,304 H100s: TP 8 x CP 2, 63 micro-batches a pipeline in every column,
    16 query groups as its config has; tokens/s a GPU from its seconds a step."""
    from hpcml.plan.published import nemo_llama31_405b

    cases = nemo_llama31_405b()
    fitted = {t for ts in (*CALIBRATION.values(), *DEVICE_CALIBRATION.values(), *MEMORY_CALIBRATION.values())
              for t in ts}
    assert "nemo-llama31-405b-h100" not in fitted and len(cases) == 12
    assert {(c.layout.tp, c.layout.cp, c.layout.microbatches, c.layout.model.n_kv_heads) for c in cases} == {
        (8, 2, 63, 16)}
    assert [(c.layout.gpus, c.layout.pp, c.layout.v, c.layout.model.n_layers) for c in cases[::2]] == [
        (32, 1, 1, 7), (96, 3, 7, 21), (192, 3, 7, 42), (576, 9, 7, 126), (1152, 9, 7, 126), (2304, 9, 7, 126)]
    row = cases[6]  # 576 GPUs, BF16: the README's 120,022 tokens/s
    assert row.layout.precision == "bf16" and row.tokens_per_gpu * 576 == pytest.approx(120022, abs=1)


def test_nemo_llama31_405b_meets_the_throughput_bars():
    """Held out: median |error| <= 10%, p90 <= 25%, Spearman of MFU >= 0.6 (the issue's bars for
    its hidden tables); fit right on 12 of 12 -- the two 576-GPU rows, sized to the last GiB, fit
    with NeMo's optimizer as it runs (BF16: master weights as 16-bit remainders; FP8: weights in
    FP8), and were 0.2 GiB over without (docs/plan.md)."""
    import statistics

    from hpcml.plan.fit import spearman

    errs, mfu_p, mfu_m, wrong = [], [], [], []
    for c in TABLES["nemo-llama31-405b-h100"]():
        p = predict(c.layout)
        e = p.tokens_per_s / c.layout.gpus / c.tokens_per_gpu - 1
        errs.append(abs(e))
        mfu_p.append(p.mfu)
        mfu_m.append(p.mfu / (1 + e))
        if not p.fits:
            wrong.append((c.layout.gpus, round(p.memory_gib["total"] - 79.11, 2)))
    errs.sort()
    assert statistics.median(errs) <= 0.10 and errs[int(0.9 * (len(errs) - 1))] <= 0.25
    assert spearman(mfu_p, mfu_m) >= 0.6
    assert wrong == []
    for c in TABLES["nemo-llama31-405b-h100"]()[6:8]:  # 576 GPUs, as Megatron-core's optimizer would run them
        plain = replace(c.layout, master_weights="fp32", fp8_params=False)
        assert c.layout.gpus == 576 and 0 < predict(plain).memory_gib["total"] - 79.11 < 0.5


def test_megatrons_embedding_gradient_is_a_shard():
    """Megatron's vocabulary-parallel embedding is a plain shard with a shard's gradient; torch's
    DTensor plan (hpcml, torchtitan) hands back a replicated gradient of the whole table (measured
    with torch 2.13, as memory.py says): tp - 1 shards' worth more on the first pipeline rank."""
    cfg = replace(load_model("llama3-8b"), n_layers=4)
    lay = PlanLayout(model=cfg, gpus=16, gpu="h100-80gb", seq_len=4096, global_batch=16, tp=8, pp=2, zero=1,
                     sequence_parallel=True, framework="megatron")
    shard = cfg.padded_vocab * cfg.dim // 8
    titan = replace(lay, framework="torchtitan")
    assert rank_state(cfg, titan, 0).grads - rank_state(cfg, lay, 0).grads == 7 * shard
    assert rank_state(cfg, titan, 1).grads == rank_state(cfg, lay, 1).grads  # the output layer: a shard in both


def test_the_allocators_reserve_is_fsdps_only_under_fsdp():
    """The H100 family's reserve (7.5 GiB) is fitted on torchtitan's FSDP runs: FSDP gathers and
    reduce-scatters each unit on streams of its own, into buffers the allocator cannot reuse. A
    layout whose parameters and gradients stay in place keeps the planner's base, 2 GiB."""
    from hpcml.plan.calibration import constants
    from hpcml.plan.predict import resolve_device
    from hpcml.plan.constants import BASE_RESERVED_GIB

    cfg = replace(load_model("llama3-8b"), n_layers=4)
    base = PlanLayout(model=cfg, gpus=16, gpu="h100-80gb", seq_len=4096, global_batch=16, framework="torchtitan")
    assert constants(resolve_device(base)).reserved_gib == 7.5 and BASE_RESERVED_GIB == 2.0
    for zero, reserve in ((0, 2.0), (1, 2.0), (2, 7.5), (3, 7.5)):
        lay = replace(base, zero=zero)
        counted = memory(cfg, lay).gib()["total"]
        assert predict(lay).memory_gib["total"] - counted == pytest.approx(reserve, abs=1e-9), zero


def test_nemotron4_340b_table_meets_the_throughput_bars():
    """NVIDIA's Nemotron-4 340B recipe, held out: 128-2,048 H100s at TP 8 x PP 8 x 12 virtual
    stages, BF16 and FP8. Median |error| <= 10%, p90 <= 25%; the 128-GPU rows (two data ranks: the
    distributed optimizer's fp32 state in halves) are predicted over the device in BF16 -- its
    config's optimizer ``dtype: bf16`` is not read as halving that state (unverified), docs/plan.md;
    in FP8 its weights are held in FP8 (NeMo's ``fp8_params``) and it fits."""
    import statistics

    cases = TABLES["nemo-nemotron4-340b-h100"]()
    assert len(cases) == 10 and {c.layout.microbatches for c in cases} == {16}
    assert cases[0].tokens_per_gpu * 128 == pytest.approx(28432, abs=1)  # the README's 128-GPU BF16 figure
    assert 340e9 < cases[0].layout.model.num_params() < 342e9
    errs, oom = [], []
    for c in cases:
        p = predict(c.layout)
        errs.append(abs(p.tokens_per_s / c.layout.gpus / c.tokens_per_gpu - 1))
        if not p.fits:
            oom.append(c.layout.gpus)
    errs.sort()
    assert statistics.median(errs) <= 0.10 and errs[int(0.9 * (len(errs) - 1))] <= 0.25, errs
    assert oom == [128]


def test_megatrons_main_gradients_are_held_in_the_reduce_dtype():
    """Megatron-core's gradient buffer is the one it reduces: in bf16 without
    ``--accumulate-allreduce-grads-in-fp32``, 2 bytes a parameter less; FSDP keeps its sharded
    fp32 gradients whatever it reduces in."""
    from hpcml.plan.memory import state_bytes

    cfg = replace(load_model("llama3-8b"), n_layers=4)
    lay = PlanLayout(model=cfg, gpus=16, gpu="h100-80gb", seq_len=4096, global_batch=16, tp=8, zero=1,
                     sequence_parallel=True, framework="megatron")
    st = rank_state(cfg, lay, 0)
    assert state_bytes(lay, st)[1] - state_bytes(replace(lay, reduce_dtype="bf16"), st)[1] == 2 * st.grads
    fsdp = replace(lay, framework="torchtitan", zero=3, sequence_parallel=False, tp=1)
    st = rank_state(cfg, fsdp, 0)
    assert state_bytes(fsdp, st) == state_bytes(replace(fsdp, reduce_dtype="bf16"), st)


def test_nemo_llama31_70b_table_is_held_out_and_priced():
    """NVIDIA's Llama 3.1 70B recipe (64-2,048 H100s, TP 4 x CP 2 x PP 4 x 5 virtual stages), held
    out: every row fits as it ran; BF16 predicted 2-4% fast, FP8 9-14% fast (median 6.5%, p90
    12.4%: docs/benchmarks.md; 4-6% and 10-15% before session 33 priced a cp rank's matmuls at
    its own tokens, 5-7% and 12-17% before session 32's refit of tp_overlap). With
    cuDNN's attention at FlashAttention-2's efficiency it was 7-12% slow (median 10.7%), at the
    efficiency Megatron-core's table alone gave 2-9% slow."""
    import statistics

    cases = TABLES["nemo-llama31-70b-h100"]()
    assert len(cases) == 12 and {(c.layout.microbatches, c.layout.v, c.layout.cp) for c in cases} == {(64, 5, 2)}
    assert cases[0].tokens_per_gpu * 64 == pytest.approx(71235, abs=1)  # the README's 64-GPU BF16 throughput
    errs = []
    for c in cases:
        p = predict(c.layout)
        assert p.fits
        errs.append(p.tokens_per_s / c.layout.gpus / c.tokens_per_gpu - 1)
    bf16, fp8 = errs[::2], errs[1::2]
    assert all(0.015 < e < 0.05 for e in bf16) and all(0.08 < e < 0.15 for e in fp8), errs
    assert statistics.median(abs(e) for e in errs) <= 0.10


def test_megatrons_fused_attention_has_its_own_efficiency_fitted_after_the_rest():
    """``attn_eff_fused`` prices Megatron's own attention (Transformer Engine's pick on Hopper:
    cuDNN's kernel) and nothing else -- not FlashAttention-2 under Megatron (``attention:
    flash-attn``, as with ``NVTE_FUSED_ATTN=0``); it is fitted alone after the family's joint fit
    (``fit.STAGED``), on the fitted tables and NVIDIA's Llama 3.1 8B recipe
    (``STAGED_CALIBRATION``), so the other constants are what they were without it: H100 0.64
    (0.58 before session 33 priced a cp rank's matmuls at its own tokens: the recipe runs cp 2)
    against FlashAttention-2's 0.18; A100's tables run Megatron with its unfused softmax only, so
    it stays 0 (``attn_eff`` used)."""
    from hpcml.plan.calibration import constants
    from hpcml.plan.fit import GRID, STAGED
    from hpcml.plan.predict import resolve_device
    from hpcml.plan.timing import step_time

    assert "attn_eff_fused" in STAGED and "attn_eff_fused" not in GRID
    cfg = replace(load_model("llama3-8b"), n_layers=4)
    lay = PlanLayout(model=cfg, gpus=16, gpu="h100-80gb", seq_len=16384, global_batch=16, tp=8, zero=1,
                     sequence_parallel=True, framework="megatron")
    dev = resolve_device(lay)
    c = constants(dev)
    assert (c.attn_eff_fused, c.attn_eff) == (0.64, 0.18)
    assert constants(resolve_device(replace(lay, gpu="a100-80gb"))).attn_eff_fused == 0.0
    plain = replace(c, attn_eff_fused=0.0)
    assert step_time(cfg, lay, dev, c).compute_s < step_time(cfg, lay, dev, plain).compute_s
    for other in (replace(lay, framework="torchtitan"), replace(lay, attention="flash-attn")):
        assert step_time(cfg, other, dev, c).compute_s == step_time(cfg, other, dev, plain).compute_s
    assert step_time(cfg, replace(lay, attention="flash-attn"), dev, c).compute_s == \
        step_time(cfg, replace(lay, framework="torchtitan"), dev, c).compute_s
    from hpcml.plan.published import STAGED_CALIBRATION
    assert STAGED_CALIBRATION == {"nvidia-h100": ["nemo-llama31-8b-h100", "torchtitan-h100-compile"]}


def test_nemotron4_15b_table_is_read_as_published_and_meets_the_throughput_bars():
    """NVIDIA's Nemotron-4 15B recipe, held out: TP 4 on 16-2,048 H100s (4 to 512 data ranks), four
    micro-batches of 4 a replica, BF16 and FP8. Every row fits; median |error| <= 10%, p90 <= 25%.
    Its MFU falls 4-5% from 16 to 2,048 GPUs; the planner's falls too, by Megatron-core's last
    gradient bucket and first parameter gather, which grow with the data ranks and hide behind
    nothing (``timing._megatron_tail``): the Spearman of MFU passes 0.6 (0.53 without it)."""
    from hpcml.plan.published import CALIBRATION
    from hpcml.plan.scoring import score_table

    assert all("nemo-nemotron4-15b-h100" not in t for t in CALIBRATION.values())
    cases = TABLES["nemo-nemotron4-15b-h100"]()
    assert len(cases) == 16 and {c.layout.microbatches for c in cases} == {4}
    assert {c.layout.dp for c in cases} == {4, 8, 16, 32, 64, 128, 256, 512}
    assert cases[0].tokens_per_gpu * 16 == pytest.approx(92630, abs=1)  # the README's 16-GPU BF16 figure
    assert cases[-1].tokens_per_gpu * 2048 == pytest.approx(15391941, abs=1)  # and its 2,048-GPU FP8 one
    assert 15.5e9 < cases[0].layout.model.num_params() < 16e9
    sc = score_table(cases)
    assert sc.fit_agrees == 1.0 and all(p.fits for p in sc.predictions)
    assert sc.median <= 0.10 and sc.p90 <= 0.25, sc.errors
    assert sc.spearman_mfu >= 0.6, sc.spearman_mfu


def test_nemos_optimizer_remainders_and_fp8_weights():
    """NeMo's Apex distributed Adam keeps a bf16 weight's master copy as its 16 dropped bits (2
    bytes a parameter of sharded state, not 4); Transformer Engine's FP8 weights are 1 byte, and
    the ZeRO-1 all-gather sends them as such. Where neither can run, one line says why."""
    from hpcml.errors import ConfigError
    from hpcml.plan.memory import state_bytes

    cfg = replace(load_model("llama3-8b"), n_layers=4)
    lay = PlanLayout(model=cfg, gpus=16, gpu="h100-80gb", seq_len=4096, global_batch=16, tp=4, zero=1,
                     sequence_parallel=True, framework="megatron")
    st = rank_state(cfg, lay, 0)
    p, g, o = state_bytes(lay, st)
    assert state_bytes(replace(lay, master_weights="remainder"), st) == (p, g, o - 2 * st.optimizer)
    fp8 = replace(lay, precision="fp8")
    assert state_bytes(replace(fp8, fp8_params=True), st) == (p - st.params, g, o)
    assert predict(replace(fp8, fp8_params=True)).parts_s["dp"] <= predict(fp8).parts_s["dp"]
    for bad, words in ((dict(master_weights="remainder", zero=3), "remainders complete bf16 weights"),
                       (dict(master_weights="remainder", framework="torchtitan"), "framework torchtitan"),
                       (dict(fp8_params=True), "fp8_params with precision bf16"),
                       (dict(precision="fp8", fp8_params=True, framework="deepspeed"), "framework deepspeed"),
                       (dict(precision="fp8", fp8_params=True, master_weights="remainder"), "fp8_params True"),
                       (dict(master_weights="fp16"), "master_weights='fp16': expected one of fp32, remainder"),
                       (dict(fp8_params="yes"), "fp8_params='yes': expected true or false")):
        with pytest.raises(ConfigError) as e:
            replace(lay, **bad)
        assert words in str(e.value), (bad, str(e.value))


def test_the_command_line_takes_nemos_optimizer_flags():
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "hpcml.cli", "plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-80gb",
            "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron", "--tp", "4", "--zero", "1",
            "--micro-batch", "1", "--json"]
    got = {}
    for extra in ([], ["--master-weights", "remainder"]):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        got[tuple(extra)] = r["memory_gib"]["optimizer"]
        assert r["layout"]["master_weights"] == (extra[-1] if extra else "fp32")
    assert got[("--master-weights", "remainder")] == pytest.approx(got[()] * 10 / 12, rel=1e-3)
    bad = subprocess.run(base + ["--fp8-params"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "fp8_params with precision bf16" in bad.stderr
