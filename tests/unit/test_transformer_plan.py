"""Transformer configs and presets, the layer-split rule, plan checks, schedule and data (no MPI)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.grid import Layout
from hpcml.models.transformer import PRESETS, Transformer, TransformerConfig, apply_rope, rope_tables
from hpcml.models.transformer.parallelize import check_plan, stage_layers
from hpcml.parallel import ParallelConfig, split_layers
from hpcml.parallel.ulysses import bytes_per_layer
from hpcml.train import SyntheticTokens, TrainConfig
from hpcml.train.schedule import WarmupCosine


def test_param_counts_match_the_module():
    for cfg in (TransformerConfig.preset("tiny"), TransformerConfig.preset("tiny", tie_embeddings=True)):
        model = Transformer(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_preset_sizes():
    small = TransformerConfig.preset("small").num_params()
    assert 100e6 < small < 135e6
    # Megatron-LM Table 1 sizes are 12*l*h^2 plus embeddings; our SwiGLU of 8h/3 keeps the 12*l*h^2
    for name in [n for n in PRESETS if n.startswith("megatron-")]:
        cfg = PRESETS[name]
        assert cfg.num_params(embeddings=False) == pytest.approx(12 * cfg.n_layers * cfg.dim ** 2, rel=0.01), name
    assert PRESETS["megatron-1t"].num_params() / 1e12 == pytest.approx(1.008, rel=0.01)
    assert PRESETS["gpt3-175b"].num_params() / 1e9 == pytest.approx(174.6, rel=0.01)  # Narayanan et al. Table 2
    assert PRESETS["llama-65b"].num_params() / 1e9 == pytest.approx(65.3, rel=0.02)
    # the published counts: Llama 1 7B 6.74B, Llama 2 70B 68.98B, Llama 3.1 8B 8.03B / 70B 70.55B / 405B 405.85B
    for name, billions in (("llama-7b", 6.738), ("llama2-7b", 6.738), ("llama2-13b", 13.016), ("llama2-70b", 68.977),
                           ("llama3-8b", 8.030), ("llama3-70b", 70.554), ("llama3-405b", 405.853)):
        assert PRESETS[name].num_params() / 1e9 == pytest.approx(billions, abs=1e-3), name
    l3 = PRESETS["llama3-8b"]
    assert l3.rope_llama3 == (8.0, 1.0, 4.0, 8192) and l3.describe()["rope"]["scaling"] == "llama3"
    assert TransformerConfig.from_dict(l3.to_dict()) == l3  # a checkpoint (or DCP import) can tell
    with pytest.raises(ConfigError, match="unknown transformer preset 'huge': expected one of tiny, small"):
        TransformerConfig.preset("huge")


def test_flops_per_token_is_6n_plus_attention():
    cfg = TransformerConfig.preset("tiny")
    n_matmul = cfg.num_params() - cfg.padded_vocab * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    assert cfg.flops_per_token(32) == 6 * n_matmul + 6 * cfg.n_layers * cfg.dim * 32


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=64, n_heads=5), "dim 64 is not divisible by n_heads 5"),
    (dict(n_heads=8, n_kv_heads=3), "n_heads 8 is not divisible by n_kv_heads 3"),
    (dict(dim=24, n_heads=8, n_kv_heads=None), "head dim 3 (dim 24 / n_heads 8) must be even for rotary"),
    (dict(n_layers=0), "n_layers must be >= 1, got 0"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ConfigError) as info:
        TransformerConfig.preset("tiny", **kwargs)
    assert str(info.value) == message


def test_forward_shapes_and_rope_is_a_rotation():
    cfg = TransformerConfig.preset("tiny")
    torch.manual_seed(0)
    logits = Transformer(cfg)(torch.randint(0, cfg.vocab_size, (2, 16)))
    assert logits.shape == (2, 16, cfg.padded_vocab)
    cos, sin = rope_tables(8, 16, 10000.0)
    x = torch.randn(1, 16, 2, 8)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep norms
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated


def test_split_layers_rule():
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert split_layers(10, 4) == [2, 3, 3, 2]  # remainder to the middle stages
    assert split_layers(11, 4) == [3, 3, 3, 2]  # middle full: then the first stage
    assert split_layers(5, 2) == [3, 2]
    assert split_layers(7, 5) == [1, 2, 2, 1, 1]
    for layers, stages in [(30, 7), (105, 16), (4, 4)]:
        counts = split_layers(layers, stages)
        assert sum(counts) == layers and max(counts) - min(counts) <= 1
    with pytest.raises(ConfigError, match="n_layers 3 < pipeline stages 4"):
        split_layers(3, 4)
    cfg = TransformerConfig.preset("tiny", n_layers=5)
    assert stage_layers(cfg, 4, ParallelConfig(pp_schedule="interleaved1f1b")) == [[0], [1, 2], [3], [4]]


@pytest.mark.parametrize("degrees,model,pcfg,message", [
    ({"tp": 3}, {"n_heads": 6, "dim": 48, "n_kv_heads": None, "ffn_hidden": 96}, {},
     "padded vocab 256 is not divisible by tp 3"),
    ({"tp": 8}, {}, {}, "n_kv_heads 4 is not divisible by tp 8"),
    ({"cp": 8}, {}, {}, "n_heads 8 / tp 1 = 8 heads per rank is not divisible by cp 8 "
                        "(Ulysses splits heads over cp; cp_kind allgather does not)"
     .replace("n_heads 8 / tp 1 = 8 heads per rank is not divisible by cp 8",
              "n_kv_heads 4 / tp 1 = 4 heads per rank is not divisible by cp 8")),
    ({"pp": 4}, {"n_layers": 6}, {"pp_schedule": "interleaved1f1b"},
     "n_layers 6 < pipeline stages 8 (pp 4 x 2 stages per rank)"),
    ({"tp": 2}, {"tie_embeddings": True}, {}, "tie_embeddings needs tp 1 and pp 1, got tp 2, pp 1"),
    ({"cp": 2, "tp": 2}, {}, {"sequence_parallel": True},
     "sequence_parallel (Megatron-SP over tp) with cp 2 > 1 is not supported: use cp alone"),
    ({"pp": 2}, {}, {"layers_per_stage": (3, 2)}, "layers_per_stage [3, 2] must give each of 2 stages >= 1 layer "
     "and sum to n_layers 4"),
])
def test_check_plan_messages(degrees, model, pcfg, message):
    lay = Layout.from_degrees(48, degrees)
    with pytest.raises(ConfigError) as info:
        check_plan(TransformerConfig.preset("tiny", **model), lay, ParallelConfig(**pcfg))
    assert str(info.value) == message


def test_parallel_config_validation():
    with pytest.raises(ConfigError, match="pp_schedule 'zb' unknown: expected one of gpipe, 1f1b, interleaved1f1b"):
        ParallelConfig(pp_schedule="zb")
    with pytest.raises(ConfigError, match="interleaved1f1b needs stages_per_rank >= 2, got 1"):
        ParallelConfig(pp_schedule="interleaved1f1b", stages_per_rank=1)
    assert ParallelConfig(pp_schedule="interleaved1f1b").n_stages_per_rank == 2


@pytest.mark.parametrize("kw,message", [
    ({"fsdp": True, "dp_replicate": 0}, "dp_replicate 0: expected a whole number >= 1 of replicas, or 'node'"),
    ({"fsdp": True, "dp_replicate": "nodes"}, "dp_replicate 'nodes': expected a whole number >= 1"),
    ({"fsdp": True, "dp_replicate": True}, "dp_replicate True: expected a whole number >= 1"),
    ({"dp_replicate": 2}, "dp_replicate 2, hpz False: hybrid sharding and hpZ shard parameters; set fsdp=True"),
    ({"hpz": True}, "dp_replicate 1, hpz True: hybrid sharding and hpZ shard parameters; set fsdp=True"),
    ({"fsdp": True, "hpz": True, "reshard_after_forward": False}, "hpz with reshard_after_forward=False"),
    ({"fsdp": True, "hpz": True, "dp_replicate": "node"}, "hpz with dp_replicate 'node': hybrid sharding already"),
    ({"qwz": True}, "qwz True, qgz False: quantized all-gathers and reduce-scatters are FSDP's; set fsdp=True"),
    ({"fsdp": True, "qgz": True, "dp_replicate": 2}, "qgz with dp_replicate 2: hybrid sharding reduce-scatters"),
    ({"fsdp": True, "qwz": True, "quant_block": 0}, "quant_block 0: expected a whole number >= 1 of values a scale"),
])
def test_hybrid_sharding_config_refusals(kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ParallelConfig(**kw)
    assert ParallelConfig(fsdp=True, dp_replicate="node").dp_replicate == "node"


def test_train_config_layout_checks():
    cfg = TrainConfig(global_batch=8, micro_batch=2, seq_len=32)
    cfg.check_layout(Layout(world_size=4, dp=2, cp=2), 64)
    assert cfg.micro_batches(Layout(world_size=4, dp=2, cp=2)) == 2
    with pytest.raises(ConfigError, match="global batch 8 is not divisible by dp 8 x micro-batch 2 = 16"):
        cfg.check_layout(Layout(world_size=8), 64)
    with pytest.raises(ConfigError, match="seq_len 32 exceeds the model's max_seq_len 16"):
        cfg.check_layout(Layout(world_size=1), 16)
    with pytest.raises(ConfigError, match="2 micro-batches per step < pp 4"):
        TrainConfig(global_batch=8, micro_batch=4).check_layout(Layout(world_size=4, pp=4), 64)
    cfg.check_layout(Layout(world_size=4, dp=2, cp=2), 64, fpdt_chunk=8)
    with pytest.raises(ConfigError, match=r"^seq_len 32 is not divisible by cp 2 x fpdt_chunk 6 = 12 \(each rank holds "
                                          r"whole chunks\)$"):
        cfg.check_layout(Layout(world_size=4, dp=2, cp=2), 64, fpdt_chunk=6)


def test_lr_schedule_warmup_then_cosine():
    sched = WarmupCosine(warmup=2, steps=12, min_ratio=0.1)
    factors = [sched(s) for s in range(13)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))


def test_synthetic_tokens_deterministic_and_learnable():
    data = SyntheticTokens(vocab_size=64, seq_len=16, seed=3)
    a, b = data.global_batch(5, 4), data.global_batch(5, 4)
    assert torch.equal(a, b) and a.shape == (4, 17) and int(a.max()) < 64
    assert not torch.equal(a, data.global_batch(6, 4))
    # each token has at most `branching` successors: the chain is learnable
    batch = data.global_batch(0, 64)
    successors = {}
    for row in batch.tolist():
        for x, y in zip(row, row[1:]):
            successors.setdefault(x, set()).add(y)
    assert max(len(s) for s in successors.values()) <= 4


def test_ulysses_volume_formula():
    # 4 * B*S*H*D/P elements per rank per layer, of which (P-1)/P leave the rank
    assert bytes_per_layer(batch=2, seq=64, heads=8, kv_heads=8, head_dim=8, p=4) == 4 * 2 * 16 * 8 * 8 * 3 // 4 * 4
    assert bytes_per_layer(batch=1, seq=64, heads=8, kv_heads=2, head_dim=8, p=2) \
        == 1 * 32 * 8 * (8 + 2 * 2 + 8) // 2 * 4


def test_a_warmup_set_during_the_run_is_saved_and_kept_on_resume():
    """PBT explores the warmup: set mid-run, it is in the schedule's state and a resume keeps it
    over the config's; one never set is not saved, so a resume takes the config's."""
    run = WarmupCosine(warmup=2, steps=20, min_ratio=0.1)
    assert "warmup" not in run.state()
    run.set_warmup(6)
    assert run.state()["warmup"] == 6 and run(3) == pytest.approx(4 / 6)  # back on the longer ramp
    again = WarmupCosine(warmup=2, steps=20, min_ratio=0.1)
    again.resume(4, run.state())
    assert again.warmup == 6 and [again(s) for s in range(21)] == [run(s) for s in range(21)]
    plain = WarmupCosine(warmup=3, steps=20, min_ratio=0.1)
    plain.resume(4, WarmupCosine(warmup=2, steps=20, min_ratio=0.1).state())
    assert plain.warmup == 3 and "warmup" not in plain.state()


def test_lr_schedule_stretched_from_the_saved_step_when_steps_change():
    old = WarmupCosine(warmup=2, steps=12, min_ratio=0.1)
    at8 = old(8)
    longer = WarmupCosine(warmup=2, steps=20, min_ratio=0.1)
    longer.resume(8, old.state())
    assert longer.anchor == (8, at8) and longer(8) == at8  # no jump at the resumed step
    assert longer(20) == pytest.approx(0.1) and longer(14) == pytest.approx(0.1 + (at8 - 0.1) * 0.5)
    assert all(a >= b for a, b in zip([longer(s) for s in range(8, 21)], [longer(s) for s in range(9, 21)]))
    same = WarmupCosine(warmup=2, steps=12, min_ratio=0.1)
    same.resume(8, old.state())
    assert [same(s) for s in range(13)] == [old(s) for s in range(13)]  # same steps: the same schedule
    twice = WarmupCosine(warmup=2, steps=30, min_ratio=0.1)
    twice.resume(15, longer.state())  # extended again: from where the stretched one was
    assert twice(15) == longer(15) and twice(30) == pytest.approx(0.1)
    early = WarmupCosine(warmup=4, steps=20, min_ratio=0.1)
    early.resume(1, WarmupCosine(warmup=4, steps=10, min_ratio=0.1).state())
    assert early.anchor is None and early(3) == 1.0  # still warming up: the new horizon from the start


def test_parallel_imports_no_model_and_the_transformer_plan_lives_with_it():
    import ast
    from pathlib import Path

    import hpcml.parallel
    from hpcml.models.transformer.parallelize import TransformerPlan

    for path in Path(hpcml.parallel.__file__).parent.glob("*.py"):
        modules = [n.module or "" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in modules if m.startswith("hpcml.models")], path
    model = Transformer(TransformerConfig.preset("tiny"))
    assert isinstance(model.parallel_plan(), TransformerPlan)
    assert not hasattr(model, "cp_rank") and not hasattr(model.layers["0"].attention, "cp_group")
