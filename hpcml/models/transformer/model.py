"""A Llama-style decoder-only transformer, laid out for torch-native parallelism.

Module names follow torchtitan's Llama (``tok_embeddings``, ``layers.<i>.attention.wq``,
``feed_forward.w1/w2/w3``, ``norm``, ``output``) so tensor-parallel plans address them by
name, and ``layers`` is a ModuleDict so a pipeline stage that drops other stages' layers
keeps the fully qualified names of the unparallelised model (checkpoints rely on that).
Every stage-specific part (embedding, final norm, output) may be ``None``.

The model knows nothing of ranks. Its plan (:mod:`hpcml.models.transformer.parallelize`,
found through :meth:`Transformer.parallel_plan`) swaps ``Attention.core`` for Ulysses'
all-to-all wrapper (or FPDT's) and sets ``Transformer.seq_shard`` and ``fpdt_chunk`` (which
positions of the sequence this module sees, for rotary positions: a contiguous slice, or
FPDT's strided chunks). Under FPDT each block's MLP, and the logits + loss when the forward
is given ``targets``, run chunk by chunk, recomputed in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcml.errors import ConfigError
from hpcml.models.transformer.alibi import alibi_slopes
from hpcml.models.transformer.config import TransformerConfig
from hpcml.models.transformer.rope import apply_rope, rope_tables
from hpcml.parallel.docmask import AttentionMask
from hpcml.parallel.fpdt import chunked, chunked_loss, local_positions


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least fp32 (the norm's statistics and the loss; fp64 stays fp64)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _wide(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """The block's norm: RMSNorm (Llama's), or LayerNorm (GPT's; with its bias when ``cfg.bias``)."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)
    return RMSNorm(cfg.dim, cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.n_heads, self.kv_heads = cfg.n_heads, cfg.kv_heads
        qkv_bias = cfg.qkv_bias or cfg.bias
        if cfg.fused_qkv:  # tensor-parallel rank r holds [wq_r; wk_r; wv_r] (its plan)
            self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.kv_heads) * hd, bias=qkv_bias)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=qkv_bias)
            self.wk = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=qkv_bias)
            self.wv = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.bias)
        self.core: nn.Module = CausalAttention()
        """q, k, v [B, S, H, D] -> out; a context-parallel plan wraps it (no parameters: names stay)."""
        self.head_part = (0, 1)
        """(index, count): this module holds part ``index`` of ``count`` of the query heads (set by
        its tensor-parallel plan; ALiBi's biases are per head)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: AttentionMask | None = None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        # heads are inferred from the (possibly tensor-parallel, column-sharded) projections
        if hasattr(self, "wqkv"):  # this rank's [q; k; v] columns in the ratio n_heads : kv : kv
            qkv = self.wqkv(x)
            kv = qkv.shape[-1] * self.kv_heads // (self.n_heads + 2 * self.kv_heads)
            q, k, v = qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k, v = (t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))
        if cos is not None:  # rotary positions (learned ones were added to the embedding)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if docs is not None:
            docs = docs.heads(*self.head_part)
        return self.wo(self.core(q, k, v, docs).reshape(b, s, -1))


class CausalAttention(nn.Module):
    """Scaled dot-product attention with a causal mask over [B, S, H, D] (grouped kv heads
    allowed), or ``docs``' (the whole sequence's rows: within documents, ALiBi's biases)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: AttentionMask | None = None
                ) -> torch.Tensor:
        mask = None if docs is None else docs.rows(0, q.shape[1], q.dtype)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or cfg.hidden
        self.gelu = cfg.activation == "gelu"
        if cfg.fused_mlp:  # tensor-parallel rank r holds [w1_r; w3_r] (its plan)
            self.w13 = nn.Linear(cfg.dim, 2 * hidden, bias=False)
            self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        else:  # (registration order w1, w2, w3 fixes the initialisation's random draws)
            self.w1 = nn.Linear(cfg.dim, hidden, bias=cfg.bias)
            self.w2 = nn.Linear(hidden, cfg.dim, bias=cfg.bias)
            if not self.gelu:
                self.w3 = nn.Linear(cfg.dim, hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            return self.w2(F.gelu(self.w1(x)))
        if hasattr(self, "w13"):
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        if moe:
            from hpcml.models.transformer.moe import MoE

            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg)
        self.activation_checkpointing = False
        """Recompute this block's activations in backward (set by its plan); keeps parameter names."""
        self.mlp_chunk = 0
        """FPDT: run the norm and MLP this many positions at a time, saving only their input (0: whole)."""

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_norm(h))

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: AttentionMask | None = None
                 ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, docs)
        return h + (chunked(self._mlp, h, self.mlp_chunk) if self.mlp_chunk else self._mlp(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: AttentionMask | None = None
                ) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, docs, use_reentrant=False)
        return self._forward(x, cos, sin, docs)


class Transformer(nn.Module):
    """Decoder: tokens [B, S] -> logits [B, S, padded_vocab] (or hidden states between pipeline stages)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.padded_vocab, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = \
            nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        """Learned positions (GPT-2's, MPT's), added to the token embedding on the first stage."""
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, cfg.is_moe(i)) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_llama3)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.alibi_slopes = alibi_slopes(cfg.n_heads) if cfg.positions == "alibi" else None
        """ALiBi: every query head's slope, float64 on the host (no buffer: neither saved, nor cast by ``to``)."""
        self.seq_shard = (0, 1)
        """(index, count): this module is rank ``index`` of ``count`` on cp; set by its context-parallel plan."""
        self.fpdt_chunk = 0
        """FPDT: positions per local chunk (its strided placement, :func:`local_positions`; 0: a contiguous slice)."""
        self.loss_chunk = 0
        """Positions a chunk of the output layer and loss takes, when ``forward`` is given targets (0: all)."""
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

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits (or hidden states off the last pipeline stage); with ``targets`` [B, S] on the
        last stage, the mean next-token loss, computed chunk by chunk under FPDT or ``loss_chunk``. ``doc_ids``
        [B, S] (the document of every position of the whole sequence, on every pipeline stage
        and cp rank: :func:`~hpcml.parallel.docmask.document_ids`): attention stays within documents."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        s = h.shape[1] * self.sp_size  # positions of this rank's (cp) slice; sequence-parallel holds 1/sp of them
        index, count = self.seq_shard
        if s * count > self.rope_cos.shape[0]:
            raise ConfigError(f"sequence length {s * count} exceeds max_seq_len {self.config.max_seq_len}")
        docs = None  # the mask of this forward, shared by the layers (FPDT's attention refuses one)
        if doc_ids is not None and tuple(doc_ids.shape) != (h.shape[0], s * count):
            raise ConfigError(f"doc_ids of shape {tuple(doc_ids.shape)}: expected [{h.shape[0]}, {s * count}] "
                              f"(every position of the sequence)")
        if doc_ids is not None or self.alibi_slopes is not None:
            docs = AttentionMask(doc_ids, seq_len=s * count, slopes=self.alibi_slopes, device=h.device)
        if self.fpdt_chunk:  # FPDT's strided chunks: the angles gathered per position
            pos = local_positions(s * count, index, count, self.fpdt_chunk).to(self.rope_cos.device)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        else:  # Ulysses: this rank holds positions [index * s, (index + 1) * s), a view of the tables
            pos = torch.arange(index * s, (index + 1) * s, device=self.rope_cos.device)
            cos, sin = self.rope_cos[index * s:(index + 1) * s], self.rope_sin[index * s:(index + 1) * s]
        if self.config.positions != "rope":  # learned (added to the embedding) or ALiBi (biases of the scores)
            if self.pos_embeddings is not None:  # the first stage (under sequence parallelism: refused by the plan)
                h = h + self.pos_embeddings(pos)
            cos = sin = None
        for layer in self.layers.values():
            h = layer(h, cos, sin, docs)
        if targets is not None:
            if self.output is None:
                raise ConfigError("forward(targets=...) needs the output layer: only the last pipeline stage has it")
            return self._loss(h, targets)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _chunk_loss(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy_sum(self.output(self.norm(h)), targets)

    def _loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean of the equal chunks' mean losses, their gradients taken in forward: the logits are never whole."""
        params = [p for p in (*self.norm.parameters(), *self.output.parameters()) if p.requires_grad]
        return chunked_loss(self._chunk_loss, h, targets, self.fpdt_chunk or self.loss_chunk or h.shape[1], params)


IGNORE = -100
"""A target that counts in no loss (``F.cross_entropy``'s ``ignore_index``: padding, prompts)."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the targets that count; works on vocabulary-sharded DTensor
    logits inside ``loss_parallel()``."""
    return F.cross_entropy(_wide(logits.flatten(0, 1)), targets.flatten(0, 1), ignore_index=IGNORE)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token loss, number of targets that count): a chunk's share of the mean."""
    loss = F.cross_entropy(_wide(logits.flatten(0, 1)), targets.flatten(0, 1), ignore_index=IGNORE, reduction="sum")
    return loss, (targets != IGNORE).sum()
