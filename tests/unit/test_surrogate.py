"""Field surrogates: shapes, validation, residual identity, FLOP counts, determinism, and that they learn."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from dataclasses import asdict, replace

import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.models.surrogate import ConvSurrogate, ConvSurrogateConfig, MLPSurrogate, MLPSurrogateConfig


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # These models are tiny: on a loaded 2-core machine, intra-op threads cost far more than they save.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("nx,ny", [(16, 16), (8, 24), (1, 5)])
def test_mlp_shapes_and_time_layouts(nx: int, ny: int) -> None:
    mlp = MLPSurrogate(MLPSurrogateConfig(n_params=3, nx=nx, ny=ny, hidden=32, depth=2))
    params, t = torch.randn(5, 3), torch.rand(5)
    out = mlp(params, t)
    assert out.shape == (5, nx, ny)
    assert torch.equal(mlp(params, t[:, None]), out)  # t as [B, 1] is the same input as [B]


@pytest.mark.parametrize("shape", [(12,), (1,), (8, 6), (4, 5, 3), (2, 1, 7)])
def test_mlp_fields_of_one_two_and_three_dimensions(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    mlp = MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=shape, hidden=32, depth=2))
    assert mlp.config.shape == shape
    assert mlp.output_shape() == shape
    assert mlp.net[-1].out_features == math.prod(shape)
    params, t = torch.randn(6, 2), torch.rand(6)
    out = mlp(params, t)
    assert out.shape == (6, *shape)
    assert torch.equal(out.reshape(6, -1), mlp.net(torch.cat([params, t[:, None]], dim=1)))  # a plain reshape


@pytest.mark.parametrize("shape", [(24,), (6, 5), (4, 3, 5)])
def test_mlp_of_any_dimension_trains(shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    mlp = MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=shape, hidden=32, depth=2))
    params, t = torch.randn(8, 2), torch.rand(8)
    target = torch.randn(8, *shape)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(mlp(params, t), target)  # same shapes: no broadcasting
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mlp.parameters())
    assert losses[-1] < 0.5 * losses[0]


def test_legacy_nx_ny_spelling_is_the_same_config() -> None:
    legacy, new = MLPSurrogateConfig(n_params=3, nx=16, ny=16), MLPSurrogateConfig(n_params=3, shape=(16, 16))
    assert legacy == new and legacy.shape == (16, 16)
    assert (legacy.nx, legacy.ny, legacy.nz) == (16, 16, None)
    counts = [sum(p.numel() for p in MLPSurrogate(c).parameters()) for c in (legacy, new)]
    assert counts[0] == counts[1] == (4 + 1) * 256 + 3 * 257 * 256  # (3 params + t) -> 256 x 3 -> 16*16
    assert MLPSurrogate(legacy).num_flops_per_sample() == MLPSurrogate(new).num_flops_per_sample()
    one = MLPSurrogateConfig(n_params=3, nx=16)
    assert (one.shape, one.nx, one.ny) == ((16,), 16, None)
    three = MLPSurrogateConfig(n_params=3, nx=4, ny=5, nz=6)
    assert (three.shape, three.nx, three.ny, three.nz) == ((4, 5, 6), 4, 5, 6)
    assert MLPSurrogateConfig(n_params=3, shape=(4, 5), nx=4, ny=5) == MLPSurrogateConfig(n_params=3, shape=(4, 5))
    assert MLPSurrogateConfig(n_params=3, shape=[4, 5]).shape == (4, 5)  # a list (or torch.Size) becomes a tuple
    assert MLPSurrogateConfig(n_params=3, shape=torch.Size([7])).shape == (7,)
    # Changing the grid: replace(shape=...) leaves no stale nx/ny behind; preset overrides edit axis by axis.
    assert replace(new, shape=(8,)).shape == (8,) and replace(new, shape=(8,)).ny is None
    assert replace(new, hidden=8).shape == (16, 16)
    assert MLPSurrogateConfig.preset("tiny", nx=32).shape == (32, 16)
    assert MLPSurrogateConfig.preset("tiny", nz=4).shape == (16, 16, 4)
    assert MLPSurrogateConfig.preset("tiny", ny=None).shape == (16,)
    assert MLPSurrogateConfig.preset("small", shape=(8, 8, 8)).shape == (8, 8, 8)
    with pytest.raises(ConfigError, match=r"^nx=9 disagrees with shape=\(8,\)"):
        MLPSurrogateConfig.preset("tiny", shape=(8,), nx=9)
    with pytest.raises(ValueError, match="field nx is declared with init=False"):
        replace(new, nx=8)  # nx/ny/nz are derived: replace shape instead
    # Serialised forms (asdict for logs, pickle for checkpoints and spawn) rebuild the same config.
    assert MLPSurrogateConfig(**asdict(three)) == three and asdict(three)["shape"] == (4, 5, 6)
    again = pickle.loads(pickle.dumps(one))
    assert again == one and (again.nx, again.ny) == (16, None)


@pytest.mark.parametrize("kwargs,message", [
    (dict(shape=()), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got ()"),
    (dict(), "MLPSurrogateConfig needs the field's grid: shape=(nx,), (nx, ny) or (nx, ny, nz), "
             "or nx= (ny=, nz=), got neither"),
    (dict(shape=(4, 0)), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got (4, 0)"),
    (dict(shape=(2, 3, 4, 5)), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got (2, 3, 4, 5)"),
    (dict(shape=16), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got 16"),
    (dict(shape=(4.0, 4)), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got (4.0, 4)"),
    (dict(shape=(True,)), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got (True,)"),
    (dict(shape="16"), "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1, got '16'"),
    (dict(shape=(16, 16), ny=8),
     "ny=8 disagrees with shape=(16, 16): give one spelling of the grid, or make them agree"),
    (dict(shape=(16,), ny=16), "ny=16 disagrees with shape=(16,): give one spelling of the grid, or make them agree"),
    (dict(shape=(4, 5, 6), nx=5),
     "nx=5 disagrees with shape=(4, 5, 6): give one spelling of the grid, or make them agree"),
    (dict(ny=16), "nx, ny, nz must be given in that order, got nx=None, ny=16, nz=None"),
    (dict(nx=4, nz=3), "nx, ny, nz must be given in that order, got nx=4, ny=None, nz=3"),
    (dict(nx=4, ny=2.5), "ny must be an int >= 1, got 2.5"),
    (dict(nx=0), "nx must be >= 1, got 0"),
])
def test_bad_or_conflicting_shapes_name_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        MLPSurrogateConfig(n_params=2, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("nx,ny,kernel_size", [(16, 16, 3), (7, 13, 3), (9, 4, 5), (1, 1, 3)])
def test_conv_keeps_any_grid_size(nx: int, ny: int, kernel_size: int) -> None:
    conv = ConvSurrogate(ConvSurrogateConfig(n_params=2, channels=4, depth=3, kernel_size=kernel_size))
    field, params = torch.randn(3, nx, ny), torch.randn(3, 2)
    out = conv(field, params)
    assert out.shape == (3, nx, ny)
    assert torch.equal(conv(field[:, None], params), out)  # [B, 1, nx, ny] is the same input as [B, nx, ny]


@pytest.mark.parametrize("call,message", [
    (lambda: MLPSurrogate(MLPSurrogateConfig.preset("tiny"))(torch.randn(4, 2), torch.rand(4)),
     "params must have shape [B=4, n_params=3], got [4, 2]"),
    (lambda: MLPSurrogate(MLPSurrogateConfig.preset("tiny"))(torch.randn(4, 3), torch.rand(3)),
     "t must have shape [B=4] or [B=4, 1], got [3]"),
    (lambda: ConvSurrogate(ConvSurrogateConfig.preset("tiny"))(torch.randn(2, 3, 8, 8), torch.randn(2, 3)),
     "field must have shape [B, nx, ny] or [B, 1, nx, ny], got [2, 3, 8, 8]"),
    (lambda: ConvSurrogate(ConvSurrogateConfig.preset("tiny"))(torch.randn(2, 8, 8), torch.randn(5, 3)),
     "params must have shape [B=2, n_params=3], got [5, 3]"),
])
def test_wrong_input_shapes_name_the_shapes(call, message: str) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message


@pytest.mark.parametrize("factory,message", [
    (lambda: MLPSurrogateConfig(n_params=0, nx=4, ny=4), "n_params must be >= 1, got 0"),
    (lambda: MLPSurrogateConfig(n_params=2, nx=4, ny=0), "ny must be >= 1, got 0"),
    (lambda: MLPSurrogateConfig(n_params=2, nx=4, ny=4, hidden=-3), "hidden must be >= 1, got -3"),
    (lambda: MLPSurrogateConfig(n_params=2, nx=4, ny=4, activation="tanh"),
     "activation 'tanh' unknown: expected one of gelu, relu, silu"),
    (lambda: ConvSurrogateConfig(n_params=2, depth=0), "depth must be >= 1, got 0"),
    (lambda: ConvSurrogateConfig(n_params=2, channels=0), "channels must be >= 1, got 0"),
    (lambda: ConvSurrogateConfig(n_params=2, kernel_size=4), "kernel_size must be odd to keep the grid size, got 4"),
    (lambda: MLPSurrogateConfig.preset("huge"), "unknown MLP surrogate preset 'huge': expected one of tiny, small"),
    (lambda: ConvSurrogateConfig.preset("Tiny"), "unknown conv surrogate preset 'Tiny': expected one of tiny, small"),
    (lambda: MLPSurrogateConfig.preset("tiny", depth=0), "depth must be >= 1, got 0"),  # overrides are validated
])
def test_config_validation_messages(factory, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        factory()
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_presets_and_repr_round_trip() -> None:
    tiny = MLPSurrogateConfig.preset("tiny")
    assert (tiny.nx, tiny.ny) == (16, 16)
    assert MLPSurrogateConfig.preset("tiny", hidden=8).hidden == 8
    assert tiny.shape == (16, 16) and MLPSurrogateConfig.preset("small").shape == (64, 64)
    for cfg in (tiny, MLPSurrogateConfig.preset("small"), ConvSurrogateConfig.preset("tiny"),
                ConvSurrogateConfig.preset("small"), MLPSurrogateConfig(n_params=2, nx=9),
                MLPSurrogateConfig(n_params=2, shape=(4, 5, 6), activation="silu"),
                MLPSurrogateConfig(n_params=2, nx=3, ny=4, nz=5)):
        rebuilt = eval(repr(cfg), {type(cfg).__name__: type(cfg)})
        assert rebuilt == cfg and repr(rebuilt) == repr(cfg)
    assert repr(MLPSurrogateConfig(n_params=2, nx=9)) == \
        "MLPSurrogateConfig(n_params=2, shape=(9,), hidden=256, depth=3, activation='gelu')"
    small = MLPSurrogate(MLPSurrogateConfig.preset("small"))
    assert sum(p.numel() for p in small.parameters()) == 2_892_288  # (5+1)*512 + 3*513*512 + 513*4096


def test_conv_with_zero_last_layer_is_the_identity() -> None:
    torch.manual_seed(0)
    conv = ConvSurrogate(ConvSurrogateConfig.preset("tiny"))
    u, params = torch.randn(2, 12, 10), torch.randn(2, 3)
    assert not torch.equal(conv(u, params), u)
    torch.nn.init.zeros_(conv.net[-1].weight)
    torch.nn.init.zeros_(conv.net[-1].bias)
    assert torch.equal(conv(u, params), u)
    assert torch.equal(conv(u[:, None], params * 100), u)


def test_flop_counts_match_a_hand_count() -> None:
    mlp = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=4, ny=4, hidden=8, depth=2))
    # (n_params + t) -> 8 -> 8 -> 16 outputs: 2 * (3*8 + 8*8 + 8*16)
    assert mlp.num_flops_per_sample() == 432
    mlp3 = MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=(2, 3, 4), hidden=8, depth=2))
    # same, with 2*3*4 = 24 outputs: 2 * (3*8 + 8*8 + 8*24)
    assert mlp3.num_flops_per_sample() == 560
    conv = ConvSurrogate(ConvSurrogateConfig(n_params=1, channels=4, depth=3, kernel_size=3))
    # channels 2 -> 4 -> 4 -> 1, 3x3 kernels, on 5 x 6 = 30 pixels: 2 * 9 * 30 * (2*4 + 4*4 + 4*1)
    assert conv.num_flops_per_sample(5, 6) == 15120


def test_deterministic_under_seed() -> None:
    def build(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        mlp = MLPSurrogate(MLPSurrogateConfig.preset("tiny"))
        conv = ConvSurrogate(ConvSurrogateConfig.preset("tiny"))
        params, t, u = torch.randn(4, 3), torch.rand(4), torch.randn(4, 16, 16)
        return mlp(params, t), conv(u, params)

    first, again, other = build(3), build(3), build(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


def _decaying_mode(k: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
    # u(x, y, t) = exp(-k t) sin(pi x) sin(pi y): the heat equation's first mode, decay rate k a parameter
    xs = torch.linspace(0, 1, n)
    return torch.exp(-k[:, 0] * t)[:, None, None] * torch.outer(torch.sin(math.pi * xs), torch.sin(math.pi * xs))


def test_mlp_learns_the_decaying_mode() -> None:
    torch.manual_seed(0)
    model = MLPSurrogate(MLPSurrogateConfig.preset("tiny", n_params=1))  # 16 x 16 grid
    k, t = torch.rand(64, 1) * 2 + 0.5, torch.rand(64)
    k_test, t_test = torch.rand(64, 1) * 2 + 0.5, torch.rand(64)  # held out: the family, not the samples
    target, truth = _decaying_mode(k, t, 16), _decaying_mode(k_test, t_test, 16)

    def rel_l2() -> float:
        with torch.no_grad():
            return float((model(k_test, t_test) - truth).norm() / truth.norm())

    before = rel_l2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        loss = torch.nn.functional.mse_loss(model(k, t), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Seeds 0-5 reach 0.008-0.014 in ~0.4 s on one core; 0.03 leaves room for other BLAS builds.
    assert before > 0.5
    assert rel_l2() < 0.03
