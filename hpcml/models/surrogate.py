"""Field surrogates of simulations: what the ensembles' streamed samples train.

Two shapes of the same question, "what is the field for these parameters?":
``MLPSurrogate`` maps (parameters, time) straight to the whole field, on a 1-D, 2-D or 3-D
grid; ``ConvSurrogate`` advances a 2-D field by one output interval, with the parameters as
constant input channels.
Neither knows about ranks: parallelism is applied from outside (``hpcml.parallel``).

``num_flops_per_sample`` counts forward FLOPs as 2 x multiply-adds of the linear and
convolution layers (activations, biases and the residual add are ignored); a training
step costs about 3x that, which is what MFU divides by.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import nn

from hpcml.errors import ConfigError
from hpcml.numeric import is_int

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


_AXES = ("nx", "ny", "nz")


def _grid(shape: Sequence[int] | None, nx: int | None = None, ny: int | None = None,
          nz: int | None = None) -> tuple[int, ...]:
    """The field's grid from ``shape`` and/or the older per-axis spelling, validated."""
    given = dict(zip(_AXES, (nx, ny, nz)))
    for name, value in given.items():
        if value is not None and (not is_int(value)):
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if shape is None:
        legacy = tuple(v for v in (nx, ny, nz) if v is not None)
        if not legacy:
            raise ConfigError("MLPSurrogateConfig needs the field's grid: shape=(nx,), (nx, ny) or (nx, ny, nz), "
                              "or nx= (ny=, nz=), got neither")
        if None in (nx, ny, nz)[:len(legacy)]:
            raise ConfigError(f"nx, ny, nz must be given in that order, got nx={nx}, ny={ny}, nz={nz}")
        return legacy
    expected = "shape must be (nx,), (nx, ny) or (nx, ny, nz) with ints >= 1"
    if not isinstance(shape, (tuple, list)) or not 1 <= len(shape) <= 3:
        raise ConfigError(f"{expected}, got {shape!r}")
    try:
        dims = tuple(operator.index(n) for n in shape if not isinstance(n, bool))
    except TypeError:
        dims = ()
    if len(dims) != len(shape) or min(dims) < 1:
        raise ConfigError(f"{expected}, got {shape!r}")
    for i, (name, value) in enumerate(given.items()):
        if value is not None and (i >= len(dims) or dims[i] != value):
            raise ConfigError(f"{name}={value} disagrees with shape={dims}: give one spelling of the grid, "
                              "or make them agree")
    return dims


@dataclass(frozen=True, kw_only=True, init=False)
class MLPSurrogateConfig:
    """Shape of the (parameters, t) -> field MLP. ``repr()`` rebuilds it.

    The field's grid is ``shape=(nx,)``, ``(nx, ny)`` or ``(nx, ny, nz)``. The older spelling
    ``nx=..., ny=...`` (and ``nz=...``) builds the same config; ``cfg.nx``, ``cfg.ny`` and
    ``cfg.nz`` read the axes of ``shape`` back (None past its end). ``replace(cfg, shape=...)``
    changes the grid; ``replace`` does not take nx/ny/nz.
    """

    n_params: int
    """Scalar simulation parameters per sample (e.g. diffusivity, boundary temperatures)."""
    shape: tuple[int, ...]
    """The field's grid, (nx,), (nx, ny) or (nx, ny, nz): one sample's output has this shape."""
    hidden: int = 256
    """Width of every hidden layer."""
    depth: int = 3
    """Hidden layers (each Linear + activation); the output layer comes on top."""
    activation: str = "gelu"
    """Nonlinearity after each hidden layer: "gelu", "relu" or "silu"."""
    nx: int = field(init=False, repr=False, compare=False)
    """shape[0] (read-only)."""
    ny: int | None = field(init=False, repr=False, compare=False)
    """shape[1], or None for a 1-D field (read-only)."""
    nz: int | None = field(init=False, repr=False, compare=False)
    """shape[2], or None for a 1-D or 2-D field (read-only)."""

    def __init__(self, *, n_params: int, shape: Sequence[int] | None = None, nx: int | None = None,
                 ny: int | None = None, nz: int | None = None, hidden: int = 256, depth: int = 3,
                 activation: str = "gelu") -> None:
        # Written out rather than generated: nx/ny/nz are constructor aliases of shape, but init=False
        # fields, so that replace(cfg, shape=...) does not carry the old grid's nx/ny along into a conflict.
        for name, value in (("n_params", n_params), ("hidden", hidden), ("depth", depth), ("activation", activation)):
            object.__setattr__(self, name, value)
        _at_least(self, 1, "n_params", "hidden", "depth")
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} unknown: expected one of {', '.join(_ACTIVATIONS)}")
        grid = _grid(shape, nx, ny, nz)
        object.__setattr__(self, "shape", grid)
        for i, name in enumerate(_AXES):
            object.__setattr__(self, name, grid[i] if i < len(grid) else None)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MLPSurrogateConfig:
        """A named size: ``tiny`` (tests, 16 x 16 grid) or ``small`` (64 x 64 grid, ~2.9M parameters).

        ``shape=`` replaces the grid; ``nx``/``ny``/``nz`` edit it axis by axis
        (``preset("tiny", nz=4)`` is 16 x 16 x 4, ``ny=None`` makes it 1-D).
        """
        presets = {"tiny": cls(n_params=3, shape=(16, 16), hidden=64, depth=2),
                   "small": cls(n_params=4, shape=(64, 64), hidden=512, depth=4)}
        axes = {axis: overrides.pop(axis) for axis in _AXES if axis in overrides}
        if axes and name in presets:
            edited = {**dict(zip(_AXES, presets[name].shape)), **axes}
            overrides["shape"] = _grid(overrides["shape"], **axes) if "shape" in overrides else _grid(None, **edited)
        return _pick("MLP surrogate", presets, name, overrides)


class MLPSurrogate(nn.Module):
    """(params [B, n_params], t [B] or [B, 1]) -> field [B, *cfg.shape]: [B, nx], [B, nx, ny] or [B, nx, ny, nz].

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
        layers.append(nn.Linear(dims[-1], math.prod(cfg.shape)))
        self.net = nn.Sequential(*layers)

    def forward(self, params: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        batch = params.shape[0]
        _check_params(params, self.config.n_params, batch)
        if t.shape not in ((batch,), (batch, 1)):
            raise ValueError(f"t must have shape [B={batch}] or [B={batch}, 1], got {list(t.shape)}")
        x = torch.cat([params, t.reshape(batch, 1).to(params.dtype)], dim=1)
        out = self.net(x).view(batch, *self.config.shape)
        # Under FSDP2 the root's output carries the pre-backward hook that gathers the weights
        # again, and an in-place op on a view (a user's ``out += bias``) would drop it: a copy there.
        return out.clone() if hasattr(self, "set_requires_gradient_sync") else out

    def output_shape(self) -> tuple[int, ...]:
        """One sample's field shape, without the batch axis: ``cfg.shape``, to check against the data."""
        return self.config.shape

    def num_flops_per_sample(self) -> int:
        """Forward FLOPs per sample: 2 x multiply-adds of the Linear layers."""
        return sum(2 * m.in_features * m.out_features for m in self.net if isinstance(m, nn.Linear))


@dataclass(frozen=True, kw_only=True)
class ConvSurrogateConfig:
    """Shape of the field(t) -> field(t + dt) convolutional stepper. ``repr()`` rebuilds it.

    The grid size is not part of it: convolutions apply to any nx x ny. 2-D fields only
    (``Conv2d``); for 1-D or 3-D fields use ``MLPSurrogate``.
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

    2-D fields only (the layers are ``Conv2d``); ``MLPSurrogate`` takes 1-D and 3-D fields.

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
