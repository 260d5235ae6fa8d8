"""Field surrogates of simulations: what the ensembles' streamed samples train.

Two shapes of the same question, "what is the field for these parameters?":
``MLPSurrogate`` maps (parameters, time) straight to the whole field; ``ConvSurrogate``
advances a field by one output interval, with the parameters as constant input channels.
Neither knows about ranks: parallelism is applied from outside (``hpcml.parallel``).

``num_flops_per_sample`` counts forward FLOPs as 2 x multiply-adds of the linear and
convolution layers (activations, biases and the residual add are ignored); a training
step costs about 3x that, which is what MFU divides by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn

from hpcml.errors import ConfigError

_ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}

_C = TypeVar("_C")


def _pick(kind: str, presets: dict[str, _C], name: str, overrides: dict[str, Any]) -> _C:
    # replace() re-runs __post_init__, so an override is validated like any other value.
    if name not in presets:
        raise ConfigError(f"unknown {kind} preset {name!r}: expected one of {', '.join(presets)}")
    return replace(presets[name], **overrides)


def _at_least(cfg: object, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < minimum:
            raise ConfigError(f"{name} must be >= {minimum}, got {value}")


def _check_params(params: torch.Tensor, n_params: int, batch: int) -> None:
    # Caught here, a wrong layout names the shapes instead of failing deep inside cat/Linear.
    if params.shape != (batch, n_params):
        raise ValueError(f"params must have shape [B={batch}, n_params={n_params}], got {list(params.shape)}")


@dataclass(frozen=True, kw_only=True)
class MLPSurrogateConfig:
    """Shape of the (parameters, t) -> field MLP. ``repr()`` rebuilds it."""

    n_params: int
    """Scalar simulation parameters per sample (e.g. diffusivity, boundary temperatures)."""
    nx: int
    """Grid points along x: the output field is [nx, ny]."""
    ny: int
    """Grid points along y."""
    hidden: int = 256
    """Width of every hidden layer."""
    depth: int = 3
    """Hidden layers (each Linear + activation); the output layer comes on top."""
    activation: str = "gelu"
    """Nonlinearity after each hidden layer: "gelu", "relu" or "silu"."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "n_params", "nx", "ny", "hidden", "depth")
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} unknown: expected one of {', '.join(_ACTIVATIONS)}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MLPSurrogateConfig:
        """A named size: ``tiny`` (tests, 16 x 16 grid) or ``small`` (64 x 64 grid, ~2.9M parameters)."""
        presets = {"tiny": cls(n_params=3, nx=16, ny=16, hidden=64, depth=2),
                   "small": cls(n_params=4, nx=64, ny=64, hidden=512, depth=4)}
        return _pick("MLP surrogate", presets, name, overrides)


class MLPSurrogate(nn.Module):
    """(params [B, n_params], t [B] or [B, 1]) -> field [B, nx, ny].

    Time is one more input feature, so one model answers for any t without stepping;
    the whole field comes out of the last Linear, flattened, and is reshaped to the grid.
    """

    def __init__(self, cfg: MLPSurrogateConfig) -> None:
        super().__init__()
        self.config = cfg
        dims = [cfg.n_params + 1] + [cfg.hidden] * cfg.depth
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), _ACTIVATIONS[cfg.activation]()]
        layers.append(nn.Linear(dims[-1], cfg.nx * cfg.ny))
        self.net = nn.Sequential(*layers)

    def forward(self, params: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        batch = params.shape[0]
        _check_params(params, self.config.n_params, batch)
        if t.shape not in ((batch,), (batch, 1)):
            raise ValueError(f"t must have shape [B={batch}] or [B={batch}, 1], got {list(t.shape)}")
        x = torch.cat([params, t.reshape(batch, 1).to(params.dtype)], dim=1)
        return self.net(x).view(batch, self.config.nx, self.config.ny)

    def num_flops_per_sample(self) -> int:
        """Forward FLOPs per sample: 2 x multiply-adds of the Linear layers."""
        return sum(2 * m.in_features * m.out_features for m in self.net if isinstance(m, nn.Linear))


@dataclass(frozen=True, kw_only=True)
class ConvSurrogateConfig:
    """Shape of the field(t) -> field(t + dt) convolutional stepper. ``repr()`` rebuilds it.

    The grid size is not part of it: convolutions apply to any nx x ny.
    """

    n_params: int
    """Scalar simulation parameters per sample, fed as constant input channels."""
    channels: int = 32
    """Width of every hidden convolution."""
    depth: int = 4
    """Convolutions in all, the last mapping back to one channel; depth 1 is a learned linear stencil."""
    kernel_size: int = 3
    """Square kernel side; odd, so that padding of kernel_size // 2 keeps the grid size."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "n_params", "channels", "depth", "kernel_size")
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be odd to keep the grid size, got {self.kernel_size}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ConvSurrogateConfig:
        """A named size: ``tiny`` (tests; 3 convolutions of 8 channels) or ``small`` (6 of 64)."""
        presets = {"tiny": cls(n_params=3, channels=8, depth=3),
                   "small": cls(n_params=4, channels=64, depth=6)}
        return _pick("conv surrogate", presets, name, overrides)


class ConvSurrogate(nn.Module):
    """(field at t [B, nx, ny] or [B, 1, nx, ny], params [B, n_params]) -> field at t + dt [B, nx, ny].

    Residual: the network predicts the increment, so a zero network is the identity and
    small time steps start from a good guess. Parameters are broadcast to constant
    channels because a convolution has no other way to see a per-sample scalar.
    """

    def __init__(self, cfg: ConvSurrogateConfig) -> None:
        super().__init__()
        self.config = cfg
        chans = [1 + cfg.n_params] + [cfg.channels] * (cfg.depth - 1) + [1]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(chans, chans[1:])):
            layers.append(nn.Conv2d(a, b, cfg.kernel_size, padding=cfg.kernel_size // 2))
            if i < cfg.depth - 1:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, field: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        if field.dim() == 3:
            field = field.unsqueeze(1)
        if field.dim() != 4 or field.shape[1] != 1:
            raise ValueError(f"field must have shape [B, nx, ny] or [B, 1, nx, ny], got {list(field.shape)}")
        batch, _, nx, ny = field.shape
        _check_params(params, self.config.n_params, batch)
        p = params.to(field.dtype)[:, :, None, None].expand(-1, -1, nx, ny)
        return (field + self.net(torch.cat([field, p], dim=1))).squeeze(1)

    def num_flops_per_sample(self, nx: int, ny: int) -> int:
        """Forward FLOPs per sample on an nx x ny grid: 2 x multiply-adds of the convolutions.

        The grid is an argument because the same model runs on any grid; border pixels are
        counted in full (zero padding is computed, as the kernels do).
        """
        k2 = self.config.kernel_size ** 2
        return sum(2 * m.in_channels * m.out_channels * k2 * nx * ny for m in self.net if isinstance(m, nn.Conv2d))
