"""The transformer's shape, as pure data (no torch): a config every rank validates alike,
that the planner (:mod:`hpcml.plan`) and checkpoint tools read without building the model."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from hpcml.errors import ConfigError
from hpcml.numeric import is_int, is_real


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Shape of the decoder. ``repr()`` rebuilds it."""

    vocab_size: int = 256
    """Tokens the model predicts; the embedding is padded to ``vocab_multiple``."""
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None: as many as ``n_heads``."""
    ffn_hidden: int | None = None
    """The MLP's hidden width; None: 8/3 * dim (SwiGLU) or 4 * dim (GeLU) rounded up to ``ffn_multiple``."""
    activation: str = "swiglu"
    """The MLP: swiglu (Llama's: ``w2(silu(w1 x) * w3 x)``) or gelu (GPT's and MPT's: ``w2(gelu(w1 x))``,
    tanh-free)."""
    norm: str = "rmsnorm"
    """rmsnorm (Llama's, computed in fp32) or layernorm (GPT's and MPT's)."""
    bias: bool = False
    """Biases on every projection of the blocks and on their norms (GPT-2's, MPT's ``no_bias: false``)."""
    positions: str = "rope"
    """rope (rotary, Llama's), learned (a ``max_seq_len x dim`` table added to the token embedding:
    GPT-2's, MPT's default) or alibi (linear biases of the scores: planned only, the model refuses it)."""
    ffn_multiple: int = 64
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    """Rotary frequency scaling: none, or llama3 (Llama 3.1+'s, :mod:`hpcml.models.transformer.rope`)."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq: int = 8192
    """llama3 scaling's ``original_max_position_embeddings``."""
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    """Biases on the q, k and v projections, none on o (Qwen2's attention)."""
    vocab_multiple: int = 64
    """Pad the vocabulary to a multiple of this (layout-independent, so every layout trains the same model)."""
    init_std: float = 0.02
    fused_qkv: bool = False
    """One ``attention.wqkv`` projection, ``cat([wq, wk, wv])``, instead of three (same function and parameters)."""
    fused_mlp: bool = False
    """One ``feed_forward.w13`` projection, ``cat([w1, w3])`` (gate, up), instead of two."""
    # -- mixture of experts (hpcml.models.transformer.moe); n_experts 0: every block dense --
    n_experts: int = 0
    """Experts of each MoE feed-forward (0: a dense model)."""
    moe_top_k: int = 2
    moe_every: int = 1
    """Block i is MoE when (i + 1) % moe_every == 0 (1: all; 2: every other, as GShard)."""
    moe_hidden: int | None = None
    """Each expert's SwiGLU width; None: as ``hidden``."""
    moe_shared_hidden: int = 0
    """Width of a shared expert every token goes through (0: none)."""
    moe_score: str = "softmax"
    """Router scores: softmax or sigmoid (computed in fp32)."""
    moe_norm_topk: bool = True
    """Renormalise the top-k weights to sum to 1 (always for sigmoid)."""
    moe_balance: str = "aux"
    """aux: Switch auxiliary loss; bias: aux-loss-free per-expert bias (DeepSeek-V3); none."""
    moe_aux_coef: float = 0.01
    moe_z_coef: float = 0.001
    """Router z-loss coefficient (0: none)."""
    moe_bias_rate: float = 0.001
    """Bias update per step of aux-loss-free balancing."""
    moe_capacity: float | None = None
    """Capacity factor: an expert takes at most factor * tokens * k / E assignments, the rest
    dropped; None: dropless."""
    moe_grouped_mm: bool = True
    """Experts as one grouped matmul per projection; False: a loop over experts (the reference)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "ffn_multiple", "vocab_multiple"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ConfigError(f"ffn_hidden must be >= 1 or None, got {self.ffn_hidden}")
        if not (self.rope_theta > 0 and self.norm_eps > 0 and self.init_std >= 0):
            raise ConfigError(f"rope_theta and norm_eps must be > 0, init_std >= 0; got {self.rope_theta}, "
                              f"{self.norm_eps}, {self.init_std}")
        if self.rope_scaling not in ("none", "llama3"):
            raise ConfigError(f"rope_scaling {self.rope_scaling!r}: expected 'none' or 'llama3'")
        if self.rope_scaling == "llama3" and not (self.rope_factor >= 1 and self.rope_original_max_seq >= 1
                                                  and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ConfigError(f"llama3 rope scaling: factor {self.rope_factor}, low_freq_factor "
                              f"{self.rope_low_freq_factor}, high_freq_factor {self.rope_high_freq_factor}, original "
                              f"max seq {self.rope_original_max_seq}: expected factor >= 1, 0 < low < high, "
                              f"original >= 1")
        if self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} (dim {self.dim} / n_heads {self.n_heads}) must be even "
                              f"for rotary")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ConfigError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.positions not in ("rope", "learned", "alibi"):
            raise ConfigError(f"positions {self.positions!r}: expected rope, learned or alibi")
        if self.activation not in ("swiglu", "gelu") or self.norm not in ("rmsnorm", "layernorm"):
            raise ConfigError(f"activation {self.activation!r}, norm {self.norm!r}: expected activation swiglu or "
                              f"gelu, norm rmsnorm or layernorm")
        if (self.activation == "gelu" or self.bias) and (self.fused_mlp or self.n_experts):
            raise ConfigError(f"activation {self.activation}, bias {self.bias} with fused_mlp or experts: the fused "
                              f"MLP and the experts are bias-free SwiGLU")
        if self.n_experts:
            from hpcml.models.transformer.moe_config import check_moe

            check_moe(self)

    def __hash__(self) -> int:
        """The fields' hash, computed once: the planner's caches key on a config tens of thousands
        of times a search (the generated hash rebuilt a 30-field tuple each time)."""
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
            return h

    def __getstate__(self) -> dict:
        """The fields alone: a string's hash differs from process to process, so the cached one stays here."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def with_blocks(self, activation: str | None = None, norm: str | None = None,
                    bias: bool | None = None, positions: str | None = None) -> TransformerConfig:
        """This shape with other blocks (None: keep), the MLP's width kept: a GPT block of a
        Llama preset's size, or the reverse (``llm_pretrain.py --activation``, ``hpcml plan``)."""
        return replace(self, ffn_hidden=self.hidden, activation=activation or self.activation, norm=norm or self.norm,
                       bias=self.bias if bias is None else bias, positions=positions or self.positions)

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has a MoE feed-forward."""
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or self.hidden

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    @property
    def rope_llama3(self) -> tuple[float, float, float, int] | None:
        """llama3 scaling's (factor, low, high, original max seq); None without scaling."""
        if self.rope_scaling != "llama3":
            return None
        return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or _round_up(4 * self.dim if self.activation == "gelu" else int(8 * self.dim / 3),
                                            self.ffn_multiple)

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of a dense MLP: 3 for SwiGLU (gate, up, down), 2 for GeLU."""
        return 3 if self.activation == "swiglu" else 2

    @property
    def fused_widths(self) -> dict[str, list[int]]:
        """Sub-parameter widths of each fused weight, by name within a block (for checkpoints and tp)."""
        hd, out = self.head_dim, {}
        if self.fused_qkv:
            out["attention.wqkv.weight"] = [self.n_heads * hd, self.kv_heads * hd, self.kv_heads * hd]
            if self.qkv_bias or self.bias:
                out["attention.wqkv.bias"] = out["attention.wqkv.weight"]
        if self.fused_mlp:
            out["feed_forward.w13.weight"] = [self.hidden, self.hidden]
        return out

    @property
    def padded_vocab(self) -> int:
        return _round_up(self.vocab_size, self.vocab_multiple)

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """Parameter count (embedding and output included unless ``embeddings=False``);
        ``active``: those one token uses (top-k of each MoE layer's experts)."""
        from hpcml.models.transformer.moe_config import moe_params

        hd = self.head_dim
        attn = (self.dim + (self.qkv_bias or self.bias)) * hd * (self.n_heads + 2 * self.kv_heads) \
            + self.dim * hd * self.n_heads + self.bias * self.dim  # q, k, v (and biases), o (and its bias)
        mlp = self.mlp_matrices * self.dim * self.hidden \
            + self.bias * ((self.mlp_matrices - 1) * self.hidden + self.dim)
        total, used = moe_params(self) if self.n_experts else (0, 0)
        ffn = (self.n_layers - self.n_moe_layers) * mlp + self.n_moe_layers * (used if active else total)
        emb = self.padded_vocab * self.dim * (1 if self.tie_embeddings else 2) \
            + (self.max_seq_len * self.dim if self.positions == "learned" else 0)
        norms = (2 if self.norm == "layernorm" and self.bias else 1) * self.dim  # weight (and bias) of each norm
        return self.n_layers * (attn + 2 * norms) + ffn + norms + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active matmul parameters + causal attention scores (PaLM's count)."""
        norms = (2 if self.norm == "layernorm" and self.bias else 1) * self.dim
        biases = (self.qkv_bias or self.bias) * self.head_dim * (self.n_heads + 2 * self.kv_heads) \
            + self.bias * (2 * self.dim + (self.mlp_matrices - 1) * self.hidden)  # o's, the MLP's
        matmul = self.num_params(embeddings=False, active=True) - self.n_layers * (2 * norms + biases) - norms
        matmul += self.padded_vocab * self.dim  # the output projection is a matmul, the embedding lookup is not
        return 6 * matmul + 6 * self.n_layers * self.dim * seq_len  # 12*l*h*s/2 for a causal mask

    def to_dict(self) -> dict:
        """Every field, JSON-able: what a checkpoint stores to rebuild the model."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerConfig:
        """The config :meth:`to_dict` wrote. Unknown keys and values of the wrong type are
        refused (a checkpoint is read by other versions and tools); absent fields take their
        defaults (a config written before the field existed)."""
        if not isinstance(d, dict):
            raise ConfigError(f"transformer config must be a JSON object, got {type(d).__name__}")
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(d) - set(types))
        if unknown:
            raise ConfigError(f"transformer config: unknown keys {unknown}; expected some of {sorted(types)}")
        bad = [f"{k}={v!r} (expected {types[k]})" for k, v in d.items() if not _fits(v, types[k])]
        if bad:
            raise ConfigError(f"transformer config: bad values {', '.join(bad)}")
        return cls(**d)

    def describe(self) -> dict:
        """``extra["model"]`` of a checkpoint: the fields plus what an outside reader would
        otherwise derive by reading this module (widths, padding, the rotary convention)."""
        return {"type": "transformer", "config": self.to_dict(), "head_dim": self.head_dim,
                "kv_heads": self.kv_heads, "hidden": self.hidden, "padded_vocab": self.padded_vocab,
                "rope": {"pairs": "interleaved", "theta": self.rope_theta, "scaling": self.rope_scaling,
                         **({"factor": self.rope_factor, "low_freq_factor": self.rope_low_freq_factor,
                             "high_freq_factor": self.rope_high_freq_factor,
                             "original_max_seq": self.rope_original_max_seq} if self.rope_llama3 else {}),
                         "about": "rotates (x[2i], x[2i+1]) by pos * theta^(-2i/head_dim); HF Llama rotates "
                                  "(x[i], x[i + head_dim/2])"},
                "norm": {"type": self.norm, "eps": self.norm_eps, "bias": self.norm == "layernorm" and self.bias},
                "positions": self.positions,
                "activation": "silu (SwiGLU: w2(silu(w1 x) * w3 x))" if self.activation == "swiglu"
                else "gelu (w2(gelu(w1 x)), erf form)", "bias": self.bias,
                "tie_embeddings": self.tie_embeddings, "qkv_bias": self.qkv_bias, "fused_widths": self.fused_widths,
                **({"moe": {"layers": [i for i in range(self.n_layers) if self.is_moe(i)],
                            "experts": self.n_experts, "top_k": self.moe_top_k, "expert_hidden": self.expert_hidden,
                            "layout": "feed_forward.experts.w1/w3 [expert, hidden, dim], w2 [expert, dim, hidden]: "
                                      "row e is global expert e"}} if self.n_experts else {})}

    @classmethod
    def preset(cls, name: str, **overrides) -> TransformerConfig:
        """A named size: ``tiny`` (tests), ``small`` (~125M), Megatron-LM Table 1, Llama 13B/30B/65B."""
        from hpcml.models.transformer.presets import PRESETS

        if name not in PRESETS:
            raise ConfigError(f"unknown transformer preset {name!r}: expected one of {', '.join(PRESETS)}")
        return replace(PRESETS[name], **overrides)


def _fits(value, kind: str) -> bool:
    """Whether a JSON value fits a field annotated ``kind`` (int, float, bool, 'int | None')."""
    if value is None:
        return kind.endswith("| None")
    kind = kind.removesuffix(" | None")
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return is_int(value)
    if kind == "float":
        return is_real(value) and math.isfinite(value)
    return False
