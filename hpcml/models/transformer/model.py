"""A Llama-style decoder-only transformer, laid out for torch-native parallelism.

Module names follow torchtitan's Llama (``tok_embeddings``, ``layers.<i>.attention.wq``,
``feed_forward.w1/w2/w3``, ``norm``, ``output``) so tensor-parallel plans address them by
name, and ``layers`` is a ModuleDict so a pipeline stage that drops other stages' layers
keeps the fully qualified names of the unparallelised model (checkpoints rely on that).
Every stage-specific part (embedding, final norm, output) may be ``None``.

The model knows nothing of ranks. Its plan (:mod:`hpcml.models.transformer.parallelize`,
found through :meth:`Transformer.parallel_plan`) swaps ``Attention.core`` for Ulysses'
all-to-all wrapper and sets ``Transformer.seq_shard`` (which contiguous slice of the
sequence this module sees, for rotary positions).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcml.errors import ConfigError
from hpcml.models.transformer.rope import apply_rope, rope_tables


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
    """SwiGLU hidden width; None: 8/3 * dim rounded up to ``ffn_multiple``."""
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
    """Capacity factor: an expert takes at most factor * tokens * k / E assignments, the rest dropped; None: dropless."""
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
            raise ConfigError(f"head dim {self.head_dim} (dim {self.dim} / n_heads {self.n_heads}) must be even for rotary")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ConfigError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.n_experts:
            from hpcml.models.transformer.moe_config import check_moe

            check_moe(self)

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
        return self.ffn_hidden or _round_up(int(8 * self.dim / 3), self.ffn_multiple)

    @property
    def fused_widths(self) -> dict[str, list[int]]:
        """Sub-parameter widths of each fused weight, by name within a block (for checkpoints and tp)."""
        hd, out = self.head_dim, {}
        if self.fused_qkv:
            out["attention.wqkv.weight"] = [self.n_heads * hd, self.kv_heads * hd, self.kv_heads * hd]
            if self.qkv_bias:
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
        attn = (self.dim + self.qkv_bias) * hd * (self.n_heads + 2 * self.kv_heads) + self.dim * hd * self.n_heads
        mlp = 3 * self.dim * self.hidden
        total, used = moe_params(self) if self.n_experts else (0, 0)
        ffn = (self.n_layers - self.n_moe_layers) * mlp + self.n_moe_layers * (used if active else total)
        emb = self.padded_vocab * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + 2 * self.dim) + ffn + self.dim + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active matmul parameters + causal attention scores (PaLM's count)."""
        matmul = self.num_params(embeddings=False, active=True) - self.n_layers * 2 * self.dim - self.dim \
            - self.n_layers * self.qkv_bias * self.head_dim * (self.n_heads + 2 * self.kv_heads)  # norms, biases
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
                "norm": {"type": "rmsnorm", "eps": self.norm_eps}, "activation": "silu (SwiGLU: w2(silu(w1 x) * w3 x))",
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
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.n_heads, self.kv_heads = cfg.n_heads, cfg.kv_heads
        if cfg.fused_qkv:  # tensor-parallel rank r holds [wq_r; wk_r; wv_r] (its plan)
            self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.kv_heads) * hd, bias=cfg.qkv_bias)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
            self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=cfg.qkv_bias)
            self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.core: nn.Module = CausalAttention()
        """q, k, v [B, S, H, D] -> out; a context-parallel plan wraps it (no parameters: names stay)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads are inferred from the (possibly tensor-parallel, column-sharded) projections
        if hasattr(self, "wqkv"):  # this rank's [q; k; v] columns in the ratio n_heads : kv : kv
            qkv = self.wqkv(x)
            kv = qkv.shape[-1] * self.kv_heads // (self.n_heads + 2 * self.kv_heads)
            q, k, v = qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k, v = (t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))


class CausalAttention(nn.Module):
    """Scaled dot-product attention with a causal mask over [B, S, H, D] (grouped kv heads allowed)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or cfg.hidden
        if cfg.fused_mlp:  # tensor-parallel rank r holds [w1_r; w3_r] (its plan)
            self.w13 = nn.Linear(cfg.dim, 2 * hidden, bias=False)
            self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        else:  # (registration order w1, w2, w3 fixes the initialisation's random draws)
            self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
            self.w3 = nn.Linear(cfg.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w13"):
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if moe:
            from hpcml.models.transformer.moe import MoE

            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg)
        self.activation_checkpointing = False
        """Recompute this block's activations in backward (set by its plan); keeps parameter names."""

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    """Decoder: tokens [B, S] -> logits [B, S, padded_vocab] (or hidden states between pipeline stages)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.padded_vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, cfg.is_moe(i)) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_llama3)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.seq_shard = (0, 1)
        """(index, count): this module sees slice ``index`` of ``count`` equal slices of the
        sequence (Ulysses); set by its context-parallel plan."""
        self.sp_size = 1
        """Tensor-parallel ranks the hidden states are sequence-sharded over between regions (Megatron-SP)."""
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for matrices, output projections scaled by 1/sqrt(2 * n_layers) (GPT-2)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith(("expert_bias", ".bias")):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def parallel_plan(self):
        """How :func:`hpcml.parallel.parallelize` lays this model out (imported on use)."""
        from hpcml.models.transformer.parallelize import TransformerPlan

        return TransformerPlan(self.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        s = h.shape[1] * self.sp_size  # positions of this rank's (cp) slice; sequence-parallel holds 1/sp of them
        index, count = self.seq_shard
        start = index * s  # Ulysses: this rank holds positions [start, start + s)
        if start + s > self.rope_cos.shape[0]:
            raise ConfigError(f"sequence length {s * count} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[start:start + s], self.rope_sin[start:start + s]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; works on vocabulary-sharded DTensor logits inside ``loss_parallel()``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
