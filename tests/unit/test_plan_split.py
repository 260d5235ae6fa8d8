"""How the planner splits a pipeline's blocks over its stages, framework by framework (issue 42):
torchtitan's split counts the embedding and the output as a block each (Llama 3 405B's), Megatron's
does with its account-for flags, hpcml's trainer and DeepSpeed split the blocks alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcml.errors import ConfigError
from hpcml.models.transformer import TransformerConfig
from hpcml.plan import PlanLayout, predict
from hpcml.plan.memory import memory
from hpcml.plan.predict import load_model


def test_torchtitan_splits_stages_counting_the_embedding_and_the_output_as_blocks():
    """torchtitan's ``generate_llm_fqn_per_model_part`` (``pipeline_parallel_first/last_stage_less_layers``
    1 each by default): ``n_layers + 2`` units over the stages, the remainder to the first ones, the
    first and last stages one block fewer. Other frameworks split the blocks alone."""
    from hpcml.plan.placement import stage_layer_lists, titan_split

    assert titan_split(126, 128) == [0] + [1] * 126 + [0]
    assert titan_split(32, 4) == [8, 9, 8, 7] and titan_split(8, 4) == [2, 3, 2, 1] and titan_split(5, 1) == [5]
    assert titan_split(126, 16) == [7] + [8] * 14 + [7]
    with pytest.raises(ConfigError, match="pipeline stages 130 > 128"):
        titan_split(126, 130)
    assert [len(s) for s in stage_layer_lists(8, 4)] == [2, 2, 2, 2]  # hpcml's trainer's split
    base = dict(model="llama3-405b", gpus=8192, gpu="h100-80gb", seq_len=8192, global_batch=2048, tp=8, pp=16,
                zero=2, sequence_parallel=True, schedule="interleaved1f1b")
    titan = predict(PlanLayout(**base, stages_per_rank=8, framework="torchtitan"))
    assert titan.step_s > 0 and "refuses" not in titan.why
    assert "pipeline stages 144 > 128" in predict(PlanLayout(**base, stages_per_rank=9, framework="torchtitan")).why
    assert "n_layers 126 < pipeline stages 128" in predict(PlanLayout(**base, stages_per_rank=8,
                                                                     framework="megatron")).why


def test_pipeline_split_is_a_key_and_a_flag_refused_where_the_framework_has_none(capsys):
    """``pipeline_split`` ends for Megatron (its --account-for-embedding/loss-in-pipeline-split), blocks
    for torchtitan (first/last_stage_less_layers 0); hpcml's trainer and DeepSpeed split the blocks
    alone and say so in one line. A blocks refusal that ends would take names the key."""
    import json

    from hpcml.cli import main as cli

    base = dict(model="llama3-405b", gpus=8192, gpu="h100-80gb", seq_len=8192, global_batch=2048, tp=8, pp=16,
                zero=2, sequence_parallel=True, schedule="interleaved1f1b", stages_per_rank=8, micro_batch=1)
    meg = predict(PlanLayout(**base, framework="megatron", pipeline_split="ends"))
    titan = predict(PlanLayout(**base, framework="torchtitan"))
    assert meg.step_s > 0 and meg.layout.split == "ends" and titan.layout.split == "ends"
    assert meg.memory_gib["activations"] < titan.memory_gib["activations"]  # Megatron's SP keeps sharded inputs
    why = predict(PlanLayout(**base, framework="megatron")).why
    assert why.endswith("megatron takes it with pipeline_split ends (the embedding and the output a stage's block)")
    heads = predict(PlanLayout(**{**base, "cp": 2, "gpus": 16384}, framework="megatron")).why  # another rule first
    assert "heads per rank is not divisible by cp 2" in heads and "pipeline_split" not in heads
    assert "refuses" in predict(PlanLayout(**base, framework="torchtitan", pipeline_split="blocks")).why
    for fw in ("hpcml", "deepspeed"):
        with pytest.raises(ConfigError, match=f"pipeline_split ends with framework {fw}: its pipeline splits"):
            PlanLayout(**{**base, "zero": 1}, framework=fw, pipeline_split="ends")
    with pytest.raises(ConfigError, match="pipeline_split='both': expected one of blocks, ends"):
        PlanLayout(**base, framework="megatron", pipeline_split="both")
    flags = ["plan", "--model", "llama3-405b", "--gpus", "8192", "--gpu", "h100-80gb", "--seq-len", "8192",
             "--global-batch", "2048", "--tp", "8", "--pp", "16", "--zero", "2", "--sequence-parallel",
             "--schedule", "interleaved1f1b", "--stages-per-rank", "8", "--micro-batch", "1", "--json"]
    assert cli(flags + ["--framework", "megatron", "--pipeline-split", "ends"]) == 1  # it does not fit: exit 1
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["pipeline_split"] == "ends" and out["layout"]["stages_per_rank"] == 8
    assert out["step_s"] == pytest.approx(meg.step_s, rel=1e-4)


def test_the_splits_edges_a_review_found():
    """torchtitan without the ends' weights gives the remainder to the first stages (not the middle
    ones); a search tries pp up to n_layers + 2 under ends and the stages a rank it is given; Megatron
    takes ends only where its account-for split divides whole layers, and is advised it only then."""
    from hpcml.plan.candidate import PlanLayout as L
    from hpcml.plan.placement import stage_layer_lists
    from hpcml.plan.search import candidates
    from hpcml.plan.predict import resolve_device

    assert [len(s) for s in stage_layer_lists(30, 4, "first")] == [8, 8, 7, 7]
    assert [len(s) for s in stage_layer_lists(30, 4, "blocks")] == [7, 8, 8, 7]
    base = dict(gpus=64, gpu="h100-80gb", seq_len=4096, global_batch=64, tp=8, pp=4, micro_batch=1)
    assert L(model="llama-30b", **base, framework="torchtitan", pipeline_split="blocks").split == "first"
    tiny = replace(load_model("llama3-8b"), n_layers=2)
    start = L(model=tiny, gpus=8, gpu="h100-80gb", seq_len=4096, global_batch=64, framework="torchtitan",
              degrees_checked=False)
    pps = {lay.pp for lay in candidates(start, tiny, resolve_device(start))}
    assert 4 in pps and 8 not in pps  # 2 blocks + 2 ends: at most 4 stages
    v4 = L(model="llama3-8b", gpus=64, gpu="h100-80gb", seq_len=4096, global_batch=64, framework="torchtitan",
           stages_per_rank=4, degrees_checked=False)
    assert {lay.v for lay in candidates(v4, load_model("llama3-8b"), resolve_device(v4))
            if lay.schedule == "interleaved1f1b"} == {4}
    meg = dict(model="llama3-8b", **{**base, "pp": 8, "gpus": 64, "tp": 8}, framework="megatron")
    uneven = predict(L(**meg, pipeline_split="ends")).why  # 32 + 2 = 34 over 8 stages
    assert "34 is not divisible by pp 8 x 1 stages per rank = 8" in uneven and "refuses" in uneven
    assert "34 is not divisible" not in predict(L(**{**meg, "pp": 2, "gpus": 16}, pipeline_split="ends")).why
    three = replace(load_model("llama3-8b"), n_layers=3)
    advice = predict(L(**{**meg, "model": three, "pp": 4, "gpus": 32})).why  # 3 + 2 = 5 over 4: Megatron refuses
    assert "n_layers 3 < pipeline stages 4" in advice and "pipeline_split ends" not in advice
    six = replace(load_model("llama3-8b"), n_layers=6)
    advice = predict(L(**{**meg, "model": six, "pp": 8, "gpus": 64})).why  # 6 + 2 = 8: Megatron takes it
    assert advice.endswith("megatron takes it with pipeline_split ends (the embedding and the output a stage's block)")


def test_moe_every_other_block_prices_the_fullest_rank():
    """Ranks alike in their stages' sizes differ when some blocks are MoE and some not: the fullest
    rank is found among all of them (a review found 44 of 1,504 such layouts under-reported)."""
    from hpcml.plan.memory import memory as mem

    cfg = TransformerConfig(vocab_size=32000, dim=1024, n_layers=10, n_heads=8, max_seq_len=4096, n_experts=8,
                            moe_hidden=8192, moe_every=2)
    for kw in ({"schedule": "interleaved1f1b", "pipeline_split": "ends"}, {}):
        lay = PlanLayout(model=cfg, gpus=16, gpu="h100-80gb", seq_len=4096, global_batch=64, pp=4,
                         framework="torchtitan", **kw)
        worst = max(mem(cfg, lay, pp_rank=r).total for r in range(lay.pp))
        assert mem(cfg, lay).total == pytest.approx(worst, rel=1e-12)


def test_torch_pipelining_keeps_each_stage_output_until_its_backward(monkeypatch):
    """``torch.distributed.pipelining`` holds a forward's output in ``fwd_cache`` until that
    micro-batch's backward (hpcml's trainer, torchtitan): a block's output on every stage but the
    last (tp-sharded under sequence parallelism), the logits on the last; Megatron frees them once
    sent. 1F1B on 2 ranks with 4 micro-batches: the first rank keeps 2, the last 1."""
    from hpcml.plan.memory import saved_how, stage_outputs

    cfg = replace(load_model("llama3-8b"), n_layers=4)
    lay = PlanLayout(model=cfg, gpus=4, gpu="h100-80gb", seq_len=2048, global_batch=4, pp=2, tp=2,
                     framework="torchtitan", micro_batch=1)
    how = saved_how(lay)
    assert lay.microbatches == 4
    assert stage_outputs(cfg, lay, 0, how, [0]) == 2 * 2048 * cfg.dim * 2
    assert stage_outputs(cfg, lay, 1, how, [1]) == 1 * 2048 * cfg.padded_vocab / 2 * 2
    sp = replace(lay, sequence_parallel=True)
    assert stage_outputs(cfg, sp, 0, saved_how(sp), [0]) == 2 * 2048 * cfg.dim * 2 / 2
    meg = replace(lay, framework="megatron")
    assert stage_outputs(cfg, meg, 0, saved_how(meg), [0]) == 0.0
    assert stage_outputs(cfg, replace(lay, pp=1, gpus=2), 0, how, [0]) == 0.0
    from hpcml.plan import memory as memory_module

    with_out = memory(cfg, lay, pp_rank=0).buffers
    monkeypatch.setattr(memory_module, "_stage_output_bytes", lambda cfg, lay, how, mine: (0.0,) * len(mine))
    assert with_out - memory(cfg, lay, pp_rank=0).buffers == 2 * 2048 * cfg.dim * 2  # counted in the rank's memory


def test_hpcml_under_fsdp_in_bf16_gathers_bf16_weights_and_caches_no_copies():
    """hpcml's trainer in bf16 under FSDP gathers bf16 weights (``ParallelConfig.param_dtype``), so
    the planner prices its gathers at 2 bytes a weight, a bf16 residual stream and no autocast copy
    of every weight; without FSDP autocast still casts fp32 weights (and keeps the copies)."""
    from hpcml.parallel import ParallelConfig
    from hpcml.plan.memory import saved_how, weight_bytes
    from hpcml.plan.placement import rank_state

    base = dict(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=4096, global_batch=8)
    fsdp, ddp = PlanLayout(**base, zero=3), PlanLayout(**base, zero=0)
    assert (weight_bytes(fsdp), saved_how(fsdp).stream_bytes) == (2, 2)
    assert (weight_bytes(ddp), saved_how(ddp).stream_bytes) == (4, 4)
    assert weight_bytes(replace(fsdp, precision="fp32")) == 4
    cfg = load_model("llama3-8b")
    copies = 2 * rank_state(cfg, ddp, 0).compute_params / 2 ** 30
    act = {lay.zero: predict(lay).memory_gib["activations"] for lay in (fsdp, ddp)}
    assert act[0] - act[3] > copies  # the copies, and a residual stream half as wide
    with pytest.raises(ConfigError, match="param_dtype 'bf16' without fsdp"):
        ParallelConfig(param_dtype="bf16")
    with pytest.raises(ConfigError, match="param_dtype 'fp16': expected one of fp32, bf16"):
        ParallelConfig(fsdp=True, param_dtype="fp16")
