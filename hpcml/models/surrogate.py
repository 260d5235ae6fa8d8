"""Field surrogates of simulations: what the ensembles' streamed samples train.

Two shapes of the same question, "what is the field for these parameters?":
``MLPSurrogate`` maps (parameters, time) straight to the whole field; ``ConvSurrogate``
advances a field by one output interval, with the parameters as constant input channels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from hpcml.errors import ConfigError

_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


def _pick(presets: dict, name: str, overrides: dict):
    if name not in presets:
        raise ConfigError(f"unknown surrogate preset {name!r}: expected one of {', '.join(presets)}")
    return replace(presets[name], **overrides)


def _positive(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(cfg, name)}")


@dataclass(frozen=True, kw_only=True)
class MLPSurrogateConfig:
    n_params: int
    """Scalar simulation parameters per sample (e.g. diffusivity, boundary temperatures)."""
    nx: int
    ny: int
    hidden: int = 256
    depth: int = 3
    """Hidden layers."""
    activation: str = "gelu"

    def __post_init__(self) -> None:
        _positive(self, "n_params", "nx", "ny", "hidden", "depth")
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} unknown: expected one of {', '.join(_ACTIVATIONS)}")

    @classmethod
    def preset(cls, name: str, **overrides) -> MLPSurrogateConfig:
        return _pick({"tiny": cls(n_params=3, nx=16, ny=16, hidden=64, depth=2),
                      "small": cls(n_params=4, nx=64, ny=64, hidden=512, depth=4)}, name, overrides)


class MLPSurrogate(nn.Module):
    """(params [B, n_params], t [B]) -> field [B, nx, ny]."""

    def __init__(self, cfg: MLPSurrogateConfig) -> None:
        super().__init__()
        self.config = cfg
        act = _ACTIVATIONS[cfg.activation]
        dims = [cfg.n_params + 1] + [cfg.hidden] * cfg.depth
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), act()]
        layers.append(nn.Linear(dims[-1], cfg.nx * cfg.ny))
        self.net = nn.Sequential(*layers)

    def forward(self, params: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = torch.cat([params, t.reshape(-1, 1).to(params.dtype)], dim=1)
        return self.net(x).view(-1, self.config.nx, self.config.ny)

    def num_flops_per_sample(self) -> int:
        """Forward FLOPs (2 x multiply-adds of the linear layers)."""
        return sum(2 * m.in_features * m.out_features for m in self.net if isinstance(m, nn.Linear))


@dataclass(frozen=True, kw_only=True)
class ConvSurrogateConfig:
    n_params: int
    channels: int = 32
    depth: int = 4
    """Convolutions, the last one mapping back to one channel."""
    kernel_size: int = 3

    def __post_init__(self) -> None:
        _positive(self, "n_params", "channels", "kernel_size")
        if self.depth < 2:
            raise ConfigError(f"depth must be >= 2, got {self.depth}")
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be odd to keep the grid size, got {self.kernel_size}")

    @classmethod
    def preset(cls, name: str, **overrides) -> ConvSurrogateConfig:
        return _pick({"tiny": cls(n_params=3, channels=8, depth=3), "small": cls(n_params=4, channels=64, depth=6)},
                     name, overrides)


class ConvSurrogate(nn.Module):
    """(field at t [B, nx, ny], params [B, n_params]) -> field at t + dt; predicts the increment."""

    def __init__(self, cfg: ConvSurrogateConfig) -> None:
        super().__init__()
        self.config = cfg
        pad = cfg.kernel_size // 2
        chans = [1 + cfg.n_params] + [cfg.channels] * (cfg.depth - 1) + [1]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(chans, chans[1:])):
            layers.append(nn.Conv2d(a, b, cfg.kernel_size, padding=pad))
            if i < len(chans) - 2:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    def forward(self, field: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        u = field if field.dim() == 4 else field.unsqueeze(1)
        p = params[:, :, None, None].to(u.dtype).expand(-1, -1, u.shape[2], u.shape[3])
        return (u + self.net(torch.cat([u, p], dim=1))).squeeze(1)

    def num_flops_per_sample(self, nx: int, ny: int) -> int:
        """Forward FLOPs on an nx x ny grid (2 x multiply-adds of the convolutions)."""
        k2 = self.config.kernel_size ** 2
        return sum(2 * m.in_channels * m.out_channels * k2 * nx * ny for m in self.net if isinstance(m, nn.Conv2d))
