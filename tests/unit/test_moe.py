"""The MoE layer's pieces on one process (issue 13): routing, permutation maps, the grouped
matmul against the per-expert loop, balancing, presets by parameter count, config errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.models.transformer import PRESETS, Transformer, TransformerConfig, cross_entropy
from hpcml.models.transformer.moe import Experts, LocalDispatch, MoE, permutation, route

TINY = TransformerConfig.preset("tiny-moe")


def test_permutation_maps_every_assignment_once_grouped_by_expert():
    idx = torch.tensor([[3, 0], [0, 2], [3, 2], [0, 3]])  # experts 1 and 4 get nothing
    order, counts = permutation(idx, 5)
    assert counts.tolist() == [3, 0, 2, 3, 0]
    # flat assignment a = token * 2 + slot, grouped by expert, tokens in order within an expert
    assert order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]
    assert (idx.reshape(-1)[order] == torch.repeat_interleave(torch.arange(5), counts)).all()
    # capacity 2: each expert keeps its first two assignments in token order
    order, counts = permutation(idx, 5, capacity=2)
    assert counts.tolist() == [2, 0, 2, 2, 0] and order.tolist() == [1, 2, 3, 5, 0, 4]


def test_route_bias_picks_but_never_weighs():
    scores = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
    idx, w = route(scores, 2)
    assert idx.tolist() == [[0, 1], [2, 1]]
    assert torch.allclose(w, torch.tensor([[0.625, 0.375], [0.7 / 0.9, 0.2 / 0.9]]))
    idx, w = route(scores, 1, bias=torch.tensor([0.0, 0.0, 0.4]), normalise=False)
    assert idx.tolist() == [[2], [2]] and w.tolist() == [[pytest.approx(0.2)], [pytest.approx(0.7)]]


def test_dispatch_then_combine_with_identity_experts_returns_the_input():
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(16)])
    order, counts = permutation(idx, 6)
    y = LocalDispatch()(x[order // 2], counts, lambda t, c: t * 1.0)
    out = torch.zeros_like(x).index_add(0, order // 2, y * 0.5)
    assert torch.equal(out, x)
    g = torch.randn_like(x)
    out.backward(g)
    assert torch.equal(x.grad, g)


def test_grouped_matmul_equals_the_per_expert_loop_with_gradients():
    torch.manual_seed(1)
    loop, grouped = Experts(4, 8, 12, grouped_mm=False), Experts(4, 8, 12, grouped_mm=True)
    for p in loop.parameters():
        torch.nn.init.normal_(p)
    grouped.load_state_dict(loop.state_dict())
    counts = [3, 0, 5, 2]  # an expert with no token
    x1 = torch.randn(10, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = loop(x1, counts), grouped(x2, counts)
    assert torch.allclose(y1, y2, atol=1e-5)
    y1.pow(2).sum().backward()
    y2.pow(2).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-4)
    for a, b in zip(loop.parameters(), grouped.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-4)
    assert loop(torch.zeros(0, 8), [0, 0, 0, 0]).shape == (0, 8)


def test_model_with_loop_and_grouped_experts_trains_the_same():
    torch.manual_seed(0)
    a = Transformer(TINY)
    torch.manual_seed(0)
    b = Transformer(replace(TINY, moe_grouped_mm=False))
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    la, lb = cross_entropy(a(x), y), cross_entropy(b(x), y)
    la.backward()
    lb.backward()
    assert la.item() == pytest.approx(lb.item(), rel=1e-6)
    ga = a.layers["1"].feed_forward.router.gate.weight.grad
    assert torch.allclose(ga, b.layers["1"].feed_forward.router.gate.weight.grad, atol=1e-6)
    assert ga.abs().sum() > 0  # the router learns through the weights and the balancing losses


def test_switch_aux_loss_is_one_when_perfectly_balanced():
    cfg = replace(TINY, moe_z_coef=0.0)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # uniform scores: P_e = 1/E; ties route to experts...
    x = torch.randn(1, 64, cfg.dim)
    torch.manual_seed(0)
    logits = torch.zeros(64, cfg.n_experts)
    scores = logits.softmax(-1)
    idx = torch.arange(64 * 2).reshape(64, 2) % cfg.n_experts  # ...round robin: f_e = 1/E
    moe._balancing(logits, scores, idx, 1)
    assert moe.last["aux"] == pytest.approx(1.0)
    assert moe(x).shape == x.shape


def test_aux_loss_free_bias_moves_against_the_load():
    moe = MoE(replace(TINY, moe_balance="bias", moe_bias_rate=0.01))
    moe.load_local = torch.tensor([10.0, 0, 2, 2, 2, 2, 2, 4], dtype=torch.float64)
    moe.update_bias()
    bias = moe.router.expert_bias.detach().tolist()  # mean load 3: above it down, below it up
    assert bias == pytest.approx([-0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, -0.01], rel=1e-6)
    assert moe.load.tolist()[0] == 10.0 and moe.load_local.sum() == 0


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("grin-moe", 41.9e9, 6.6e9)])
def test_published_moe_presets_by_parameter_count(name, total, active):
    cfg = PRESETS[name]
    assert cfg.num_params() == pytest.approx(total, rel=0.005)
    assert cfg.num_params(active=True) == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize("cfg", [TINY, replace(TINY, moe_every=2, moe_shared_hidden=32, moe_balance="bias")])
def test_parameter_count_formula_matches_the_module(cfg):
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    moe_blocks = [i for i, b in model.layers.items() if isinstance(b.feed_forward, MoE)]
    assert moe_blocks == [str(i) for i in range(cfg.n_layers) if cfg.is_moe(i)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(moe_top_k=9), "moe_top_k must be in [1, n_experts 8], got 9"),
    (dict(moe_score="relu"), "moe_score 'relu': expected one of softmax, sigmoid"),
    (dict(moe_balance="loss"), "moe_balance 'loss': expected one of aux, bias, none"),
    (dict(moe_capacity=0.0), "moe_capacity (capacity factor) must be > 0 or None (dropless), got 0.0"),
    (dict(moe_every=5), "moe_every must be in [1, n_layers 4], got 5"),
])
def test_bad_moe_configs_say_the_value(kwargs, message):
    with pytest.raises(ConfigError) as info:
        replace(TINY, **kwargs)
    assert str(info.value) == message


def test_config_round_trips_through_a_checkpoints_json():
    cfg = replace(TINY, moe_capacity=1.25, moe_score="sigmoid")
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="moe_score=3"):
        TransformerConfig.from_dict({**cfg.to_dict(), "moe_score": 3})
    assert TINY.describe()["moe"]["layers"] == [0, 1, 2, 3]


@pytest.mark.parametrize("degrees,pkw,model,message", [
    ({"ep": 3}, {}, replace(TINY, n_experts=8), "n_experts 8 is not divisible by ep 3"),
    ({"ep": 2, "tp": 2, "etp": 1}, {}, TINY, "etp 1 != tp 2: the transformer's experts are tensor-parallel over tp "
                                            "itself (leave etp unset)"),
    ({"tp": 2}, {"sequence_parallel": True}, TINY, "sequence_parallel with a MoE model is not supported: tokens stay "
                                                   "replicated over tp"),
    ({"ep": 2}, {}, TransformerConfig.preset("tiny"), "ep 2 (etp 1) needs a MoE model: n_experts is 0"),
    ({"tp": 4}, {}, replace(TINY, moe_hidden=66), "expert hidden 66 is not divisible by tp 4"),
])
def test_bad_moe_plans_fail_before_any_collective(degrees, pkw, model, message):
    from hpcml.grid import Layout
    from hpcml.models.transformer.parallelize import check_plan
    from hpcml.parallel import ParallelConfig

    with pytest.raises(ConfigError) as info:
        check_plan(model, Layout.from_degrees(12 if degrees.get("ep") == 3 else 8, degrees), ParallelConfig(**pkw))
    assert str(info.value) == message


def test_capacity_factor_drops_assignments_past_capacity():
    torch.manual_seed(0)
    dropless, capped = MoE(TINY), MoE(replace(TINY, moe_capacity=0.5))
    for p in dropless.parameters():
        torch.nn.init.normal_(p, std=0.1)
    capped.load_state_dict(dropless.state_dict())
    x = torch.randn(2, 16, TINY.dim)
    assert capped.capacity(32) == 4  # 0.5 * 32 tokens * 2 / 8 experts
    a, b = dropless(x), capped(x)
    assert not torch.allclose(a, b)  # some assignments were dropped: those tokens got less
    # an expert over capacity keeps its first assignments in token order: the first token is served in full
    assert torch.allclose(a[0, 0], b[0, 0], atol=1e-6)
