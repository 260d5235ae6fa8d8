"""Field surrogates: shapes, validation, residual identity, FLOP counts, and that they learn."""

from __future__ import annotations

import math

import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.models import ConvSurrogate, ConvSurrogateConfig, MLPSurrogate, MLPSurrogateConfig


@pytest.mark.parametrize("nx,ny", [(16, 16), (8, 24)])
def test_shapes(nx, ny):
    mlp = MLPSurrogate(MLPSurrogateConfig(n_params=3, nx=nx, ny=ny, hidden=32, depth=2))
    assert mlp(torch.randn(5, 3), torch.rand(5)).shape == (5, nx, ny)
    conv = ConvSurrogate(ConvSurrogateConfig(n_params=3, channels=4, depth=3))
    assert conv(torch.randn(5, nx, ny), torch.randn(5, 3)).shape == (5, nx, ny)


@pytest.mark.parametrize("factory,message", [
    (lambda: MLPSurrogateConfig(n_params=0, nx=4, ny=4), "n_params must be >= 1, got 0"),
    (lambda: MLPSurrogateConfig(n_params=2, nx=4, ny=4, activation="tanh"),
     "activation 'tanh' unknown: expected one of gelu, relu, silu"),
    (lambda: ConvSurrogateConfig(n_params=2, kernel_size=4), "kernel_size must be odd to keep the grid size, got 4"),
    (lambda: ConvSurrogateConfig(n_params=2, depth=1), "depth must be >= 2, got 1"),
    (lambda: MLPSurrogateConfig.preset("huge"), "unknown surrogate preset 'huge': expected one of tiny, small"),
])
def test_validation(factory, message):
    with pytest.raises(ConfigError) as info:
        factory()
    assert str(info.value) == message


def test_conv_residual_is_identity_when_last_layer_is_zero():
    conv = ConvSurrogate(ConvSurrogateConfig.preset("tiny"))
    last = conv.net[-1]
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)
    u = torch.randn(2, 12, 10)
    assert torch.equal(conv(u, torch.randn(2, 3)), u)


def test_flop_counts_by_hand():
    mlp = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=4, ny=4, hidden=8, depth=1))
    assert mlp.num_flops_per_sample() == 2 * (3 * 8 + 8 * 16)
    conv = ConvSurrogate(ConvSurrogateConfig(n_params=1, channels=4, depth=2, kernel_size=3))
    assert conv.num_flops_per_sample(5, 5) == 2 * 9 * 25 * (2 * 4 + 4 * 1)


def test_deterministic_under_seed():
    torch.manual_seed(3)
    a = MLPSurrogate(MLPSurrogateConfig.preset("tiny"))
    torch.manual_seed(3)
    b = MLPSurrogate(MLPSurrogateConfig.preset("tiny"))
    x, t = torch.randn(4, 3), torch.rand(4)
    assert torch.equal(a(x, t), b(x, t))


def test_mlp_learns_decaying_mode():
    # u(x, y, t) = exp(-k pi^2 t) sin(pi x) sin(pi y), the heat equation's first mode, k a parameter
    torch.manual_seed(0)
    cfg = MLPSurrogateConfig(n_params=1, nx=12, ny=12, hidden=64, depth=2)
    model = MLPSurrogate(cfg)
    xs = torch.linspace(0, 1, 12)
    mode = torch.outer(torch.sin(math.pi * xs), torch.sin(math.pi * xs))
    k, t = torch.rand(256, 1) * 0.2 + 0.05, torch.rand(256)
    target = torch.exp(-k[:, 0] * math.pi ** 2 * t)[:, None, None] * mode
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(600):
        loss = torch.nn.functional.mse_loss(model(k, t), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        k2, t2 = torch.rand(64, 1) * 0.2 + 0.05, torch.rand(64)
        truth = torch.exp(-k2[:, 0] * math.pi ** 2 * t2)[:, None, None] * mode
        rel_l2 = float((model(k2, t2) - truth).norm() / truth.norm())
    assert rel_l2 < 0.05
