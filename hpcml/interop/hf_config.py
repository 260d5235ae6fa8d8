"""Hugging Face ``config.json`` to and from :class:`~hpcml.models.transformer.TransformerConfig`
(Llama, and Qwen2: Llama with biases on q, k and v), and the config an hpcml checkpoint
carries. Out of :mod:`hpcml.interop.hf`, which maps the weights; ``config.json`` is
untrusted: bounded, every key checked, what hpcml cannot honour refused in one line."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

from hpcml.errors import CheckpointError, ConfigError
from hpcml.interop.hf_files import data_bytes, model_json
from hpcml.models.transformer.config import TransformerConfig
from hpcml.numeric import is_int, is_real

_REFUSED = {  # config.json keys hpcml cannot honour (when set): why
    "quantization_config": "quantized weights", "sliding_window": "sliding-window attention",
    "attention_bias": "attention biases on q, k, v and o: hpcml has Qwen2's, on q, k and v",
    "mlp_bias": "MLP biases",
}
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""The model types read: Llama, and Qwen2 (Llama with biases on q, k and v)."""

# -- configs --------------------------------------------------------------------------------
def hf_config(cfg: TransformerConfig, dtype: str = "float32") -> dict:
    """``config.json`` of the HF Llama model equal to ``cfg`` (Qwen2 with ``qkv_bias``)."""
    if cfg.activation != "swiglu" or cfg.norm != "rmsnorm" or cfg.bias or cfg.positions != "rope":
        raise ConfigError(f"a model of {cfg.activation}, {cfg.norm}, bias {cfg.bias}, {cfg.positions} positions has no "
                          f"Hugging Face Llama equivalent (export takes SwiGLU, RMSNorm, rotary, "
                          f"no biases beyond q/k/v)")
    kind = "qwen2" if cfg.qkv_bias else "llama"
    llama3 = {"rope_type": "llama3", **{k: getattr(cfg, name) for k, name in _LLAMA3_KEYS.items()}} \
        if cfg.rope_llama3 else None
    qwen = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers} \
        if cfg.qkv_bias else {"attention_bias": False, "mlp_bias": False}
    return {"architectures": [_ARCH[kind]], "model_type": kind, "vocab_size": cfg.vocab_size, **qwen,
            "hidden_size": cfg.dim, "intermediate_size": cfg.hidden, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {**(llama3 or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
            **({"rope_scaling": llama3} if llama3 else {}),  # transformers 4.x reads this one
            "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": dtype, "dtype": dtype, "hidden_act": "silu", "initializer_range": cfg.init_std}


MAX_POSITIONS = 1 << 21
"""Largest ``max_position_embeddings`` taken: the rotary tables are built that long (Qwen2.5-1M's
1,010,000 fits; 10**12 would be a 16 TB allocation before any weight is checked)."""


def _int(c: dict, key: str, default: int | None = None, most: int = 1 << 40) -> int:
    v = c.get(key, default)
    if not is_int(v) or not 1 <= v <= most:
        raise ConfigError(f"config.json {key}={str(v)[:40]}: expected an integer from 1 to {most}")
    return v


def _float(c: dict, key: str, default: float) -> float:
    v = c.get(key, default)
    if not is_real(v) or not 0 < v < math.inf:
        raise ConfigError(f"config.json {key}={v!r}: expected a positive finite number")
    return float(v)


_LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_original_max_seq"}


def _rope(c: dict) -> dict:
    """The rotary fields of a config.json: ``rope_parameters`` (transformers 5) or ``rope_theta``
    and ``rope_scaling`` (4.x); ``rope_scaling`` wins when set, as in transformers 5. A theta
    given in two places with two values is refused (transformers' versions disagree on which
    wins, and either way half the readers would build another function). ``rope_type`` default
    (no scaling) and llama3 are taken; any other scaling changes the function and is refused."""
    params, scaling = c.get("rope_parameters"), c.get("rope_scaling")
    for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"config.json {key} {str(v)[:80]}: expected an object")
    places = (("rope_theta", {"rope_theta": c.get("rope_theta")}), ("rope_parameters", params or {}),
              ("rope_scaling", scaling or {}))
    thetas = {where: d["rope_theta"] for where, d in places if d.get("rope_theta") is not None}
    if len({float(v) if is_real(v) else repr(v)
            for v in thetas.values()}) > 1:
        raise ConfigError(f"config.json gives rope_theta {', '.join(f'{v!r} ({k})' for k, v in thetas.items())}: "
                          f"expected one value")
    params = {**(scaling or params or {}), "rope_theta": next(iter(thetas.values()), 10000.0)}
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict = {"rope_theta": _float(params, "rope_theta", 10000.0)}
    if kind == "default":
        extra = set(params) - {"rope_type", "type", "rope_theta"}
        if extra:
            raise ConfigError(f"config.json rope parameters: rope_type 'default' with {sorted(extra)}: expected "
                              f"only rope_theta")
        return out
    if kind != "llama3":
        raise ConfigError(f"config.json rope_type {str(kind)[:40]!r}: unsupported by hpcml's Transformer (it has "
                          f"'default' and 'llama3')")
    extra = set(params) - {"rope_type", "type", "rope_theta", *_LLAMA3_KEYS}
    if extra:
        raise ConfigError(f"config.json llama3 rope parameters: unknown keys {sorted(extra)}")
    out["rope_scaling"] = "llama3"
    for key, name in _LLAMA3_KEYS.items():
        if key not in params:
            raise ConfigError(f"config.json llama3 rope parameters lack {key}")
        out[name] = _int(params, key) if name == "rope_original_max_seq" else _float(params, key, 0)
    return out


def config_from_hf(path: str | os.PathLike, **overrides) -> TransformerConfig:
    """The :class:`TransformerConfig` of the HF Llama directory ``path`` (its ``config.json``);
    ``overrides`` replace fields (``fused_qkv``, ``tie_embeddings=False`` to untie, ...).
    A feature hpcml does not have (rope scaling, biases, another activation) is refused.
    The vocabulary is padded only as far as its size allows (``vocab_multiple`` = gcd(vocab, 64):
    none for Llama's 32000 or 128256), so fine-tuning sees HF's softmax, not extra zero logits."""
    c = model_json(Path(path), "config.json", 1 << 20)
    kind = c.get("model_type")
    if kind not in _ARCH or not set(c.get("architectures") or [_ARCH[kind]]) <= {_ARCH[kind]}:
        raise ConfigError(f"{path}: model_type {str(kind)[:40]!r}, architectures {str(c.get('architectures'))[:80]}: "
                          f"expected a Llama model (model_type 'llama', LlamaForCausalLM) or Qwen2 ('qwen2', "
                          f"Qwen2ForCausalLM)")
    if kind == "qwen2":  # Qwen2 writes a window size it does not use unless use_sliding_window
        layers = c.get("layer_types") or []
        windowed = c.get("use_sliding_window") or (isinstance(layers, list) and "sliding_attention" in layers)
        c = {**c, "sliding_window": c.get("sliding_window") if windowed else None}
    refused = [f"{k}={c[k]!r} ({why})" for k, why in _REFUSED.items() if c.get(k) not in (None, False)]
    act = c.get("hidden_act", "silu")
    refused += [f"hidden_act={act!r} (only silu)"] if act != "silu" else []
    refused += [f"pretraining_tp={c['pretraining_tp']!r}"] if c.get("pretraining_tp") not in (None, 1) else []
    refused += [f"attention_dropout={c['attention_dropout']!r} (no dropout)"] \
        if c.get("attention_dropout") not in (None, 0, 0.0) else []
    if refused:
        raise ConfigError(f"{path}: unsupported by hpcml's Transformer: {', '.join(refused)}")
    dim, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    if dim % heads or c.get("head_dim", dim // heads) != dim // heads:
        raise ConfigError(f"config.json head_dim {c.get('head_dim')!r} with hidden_size {dim} and {heads} heads: "
                          f"expected hidden_size / num_attention_heads = {dim / heads:g}")
    tie = c.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"config.json tie_word_embeddings={tie!r}: expected true or false")
    cfg = TransformerConfig(vocab_size=_int(c, "vocab_size"), dim=dim, n_layers=_int(c, "num_hidden_layers"),
                            n_heads=heads, n_kv_heads=_int(c, "num_key_value_heads", heads),
                            ffn_hidden=_int(c, "intermediate_size"),
                            max_seq_len=_int(c, "max_position_embeddings", 2048, MAX_POSITIONS),
                            **_rope(c), norm_eps=_float(c, "rms_norm_eps", 1e-6), tie_embeddings=tie,
                            vocab_multiple=math.gcd(_int(c, "vocab_size"), 64), qkv_bias=kind == "qwen2")
    on_disk = data_bytes(Path(path))
    # before any model of this size is built: 2 bytes a parameter at least
    if on_disk is not None and 2 * cfg.num_params() > on_disk:
        raise CheckpointError(f"{Path(path) / 'config.json'} describes {cfg.num_params():,} parameters "
                              f"({cfg.n_layers} layers, dim {dim}), at least {2 * cfg.num_params():,} bytes; "
                              f"its safetensors hold {on_disk:,}: config and weights do not match")
    return replace(cfg, **overrides)


def config_from_checkpoint(path: str | os.PathLike) -> TransformerConfig:
    """The model config an hpcml checkpoint carries (``extra["model"]``, written by the LLM Trainer)."""
    from hpcml.ckpt.checked import Checkpoint

    with Checkpoint(path) as ck:
        model, stored = ck.extra.get("model"), sum(math.prod(t["shape"]) for n, t in ck.tensors.items()
                                                   if n.startswith("model/"))
    if not isinstance(model, dict) or model.get("type") != "transformer" or "config" not in model:
        raise CheckpointError(f"{ck.path} has no transformer config in extra['model'] (saved before hpcml recorded "
                              f"one, or not a Transformer): nothing to rebuild the model from")
    cfg = TransformerConfig.from_dict(model["config"])
    if cfg.num_params() > stored:  # before any tensor of that size is named or read
        raise CheckpointError(f"{ck.path}: extra['model'] describes {cfg.num_params():,} parameters ({cfg.n_layers} "
                              f"layers, dim {cfg.dim}); the checkpoint's model tensors hold {stored:,}")
    return cfg
