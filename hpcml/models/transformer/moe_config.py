"""Checks and counts of a transformer's MoE fields: pure arithmetic (no torch), so a config
is validated in ``__post_init__`` on every rank before anything is built."""

from __future__ import annotations

from hpcml.errors import ConfigError

SCORES = ("softmax", "sigmoid")
BALANCE = ("aux", "bias", "none")


def check_moe(cfg) -> None:
    """Raise :class:`ConfigError` naming the value unless the MoE fields of ``cfg`` make sense."""
    if cfg.n_experts < 0:
        raise ConfigError(f"n_experts must be >= 0 (0: dense), got {cfg.n_experts}")
    if not 1 <= cfg.moe_top_k <= cfg.n_experts:
        raise ConfigError(f"moe_top_k must be in [1, n_experts {cfg.n_experts}], got {cfg.moe_top_k}")
    if cfg.moe_every < 1 or cfg.moe_every > cfg.n_layers:
        raise ConfigError(f"moe_every must be in [1, n_layers {cfg.n_layers}], got {cfg.moe_every}")
    if cfg.moe_hidden is not None and cfg.moe_hidden < 1 or cfg.moe_shared_hidden < 0:
        raise ConfigError(f"moe_hidden must be >= 1 or None and moe_shared_hidden >= 0, got {cfg.moe_hidden}, "
                          f"{cfg.moe_shared_hidden}")
    if cfg.moe_score not in SCORES:
        raise ConfigError(f"moe_score {cfg.moe_score!r}: expected one of {', '.join(SCORES)}")
    if cfg.moe_balance not in BALANCE:
        raise ConfigError(f"moe_balance {cfg.moe_balance!r}: expected one of {', '.join(BALANCE)}")
    if not (cfg.moe_aux_coef >= 0 and cfg.moe_z_coef >= 0 and cfg.moe_bias_rate >= 0):
        raise ConfigError(f"moe_aux_coef, moe_z_coef and moe_bias_rate must be >= 0, got {cfg.moe_aux_coef}, "
                          f"{cfg.moe_z_coef}, {cfg.moe_bias_rate}")
    if cfg.moe_capacity is not None and not cfg.moe_capacity > 0:
        raise ConfigError(f"moe_capacity (capacity factor) must be > 0 or None (dropless), got {cfg.moe_capacity}")


def moe_params(cfg) -> tuple[int, int]:
    """(parameters, active parameters per token) of one MoE feed-forward: router, experts
    (top-k of them active), shared expert."""
    expert = 3 * cfg.dim * cfg.expert_hidden
    fixed = (cfg.dim + (cfg.moe_balance == "bias")) * cfg.n_experts + 3 * cfg.dim * cfg.moe_shared_hidden
    return cfg.n_experts * expert + fixed, cfg.moe_top_k * expert + fixed
