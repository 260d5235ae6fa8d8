"""What the transformer holds on one rank, without building it: its parameters by name and
shape, how its plan shards each one, and what a layer saves for backward.

This is the torch-free half of the model's plan, read by the planner (:mod:`hpcml.plan`).
Tests hold it to the real thing: :func:`param_shapes` equals ``Transformer(cfg)``'s
``named_parameters()`` for every preset, :func:`shard_dims` equals the placements
:mod:`~hpcml.models.transformer.parallelize` gives, and :func:`layer_saved` equals what
autograd saves (counted with ``saved_tensors_hooks``) on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hpcml.models.transformer.config import TransformerConfig


def param_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Transformer(cfg)`` by fully qualified name (a tied output weight is
    the embedding's, listed once, as ``named_parameters()`` does)."""
    hd, dim, kv = cfg.head_dim, cfg.dim, cfg.kv_heads
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (cfg.padded_vocab, dim)}
    if cfg.positions == "learned":
        out["pos_embeddings.weight"] = (cfg.max_seq_len, dim)
    qkv_bias = cfg.qkv_bias or cfg.bias
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        out.update(_norm(cfg, p + "attention_norm."))
        if cfg.fused_qkv:
            out[p + "attention.wqkv.weight"] = ((cfg.n_heads + 2 * kv) * hd, dim)
            if qkv_bias:
                out[p + "attention.wqkv.bias"] = ((cfg.n_heads + 2 * kv) * hd,)
        else:
            for name, heads in (("wq", cfg.n_heads), ("wk", kv), ("wv", kv)):
                out[p + f"attention.{name}.weight"] = (heads * hd, dim)
                if qkv_bias:
                    out[p + f"attention.{name}.bias"] = (heads * hd,)
        out[p + "attention.wo.weight"] = (dim, cfg.n_heads * hd)
        if cfg.bias:
            out[p + "attention.wo.bias"] = (dim,)
        out.update(_norm(cfg, p + "ffn_norm."))
        if cfg.is_moe(i):
            if cfg.moe_balance == "bias":
                out[p + "feed_forward.router.expert_bias"] = (cfg.n_experts,)
            out[p + "feed_forward.router.gate.weight"] = (cfg.n_experts, dim)
            e, h = cfg.n_experts, cfg.expert_hidden
            out.update({p + "feed_forward.experts.w1": (e, h, dim), p + "feed_forward.experts.w2": (e, dim, h),
                        p + "feed_forward.experts.w3": (e, h, dim)})
            if cfg.moe_shared_hidden:
                out.update(_mlp(cfg, p + "feed_forward.shared_expert.", cfg.moe_shared_hidden))
        else:
            out.update(_mlp(cfg, p + "feed_forward.", cfg.hidden))
    out.update(_norm(cfg, "norm."))
    if not cfg.tie_embeddings:
        out["output.weight"] = (cfg.padded_vocab, dim)
    return out


def _norm(cfg: TransformerConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    out = {prefix + "weight": (cfg.dim,)}
    if cfg.norm == "layernorm" and cfg.bias:
        out[prefix + "bias"] = (cfg.dim,)
    return out


def _mlp(cfg: TransformerConfig, prefix: str, hidden: int) -> dict[str, tuple[int, ...]]:
    if cfg.fused_mlp:
        return {prefix + "w13.weight": (2 * hidden, cfg.dim), prefix + "w2.weight": (cfg.dim, hidden)}
    out = {prefix + "w1.weight": (hidden, cfg.dim)}
    if cfg.bias:
        out[prefix + "w1.bias"] = (hidden,)
    out[prefix + "w2.weight"] = (cfg.dim, hidden)
    if cfg.bias:
        out[prefix + "w2.bias"] = (cfg.dim,)
    if cfg.activation == "swiglu":
        out[prefix + "w3.weight"] = (hidden, cfg.dim)
        if cfg.bias:
            out[prefix + "w3.bias"] = (hidden,)
    return out


_COLWISE = ("attention.wq.", "attention.wk.", "attention.wv.", "attention.wqkv.", ".w1.", ".w3.", ".w13.")
_ROWWISE = ("attention.wo.", ".w2.")


def shard_dims(name: str) -> tuple[int | None, int | None]:
    """(tp dim, ep dim) the plan shards parameter ``name`` along; None: replicated over that axis.
    Megatron's split: q/k/v, w1/w3 (and the output) column-wise, wo/w2 row-wise, the embedding
    by vocabulary rows; experts by expert over ep and by hidden width over tp."""
    if name.endswith(("experts.w1", "experts.w3")):
        return 1, 0
    if name.endswith("experts.w2"):
        return 2, 0
    if name in ("tok_embeddings.weight", "output.weight"):
        return 0, None
    if ".router." in name or name.endswith(("norm.weight", "norm.bias")) or name == "pos_embeddings.weight":
        return None, None
    if any(k in name for k in _ROWWISE):
        return (None if name.endswith(".bias") else 1), None  # a row-wise projection's bias is whole on every rank
    if any(k in name for k in _COLWISE):
        return 0, None
    raise ValueError(f"no shard rule for parameter {name!r}")


def trainable(name: str) -> bool:
    """Whether the optimizer keeps state for ``name`` (the aux-loss-free bias is updated by rule)."""
    return not name.endswith("expert_bias")


def stage_of(name: str, stages: list[list[int]]) -> list[int]:
    """The pipeline stages (indices into ``stages``, the layer lists) that hold ``name``."""
    if name.startswith("layers."):
        layer = int(name.split(".", 2)[1])
        return [s for s, layers in enumerate(stages) if layer in layers]
    if name in ("tok_embeddings.weight", "pos_embeddings.weight"):
        return [0]
    return [len(stages) - 1]  # norm, output


@dataclass(frozen=True, kw_only=True)
class Saved:
    """How a layout runs a layer, as far as what autograd keeps is concerned."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    sp_saves_gathered: bool = True
    """Under sequence parallelism the projections keep their all-gathered input (torch's
    DTensor plans); False: the shard, gathered again in backward (Megatron)."""
    recompute: str = "none"
    """none; selective (Korthikanti et al.: the attention core recomputed); selective-op
    (torchtitan's op-level policy: every other matmul output and the attention output kept,
    the rest recomputed); selective-layer (every other block recomputed whole, torchtitan's
    ``ac_freq`` 2); full (a block keeps its input)."""
    attention: str = "flash"
    """flash (SDPA's fused kernels: the output and a log-sum-exp per row); eager (the scores too)."""
    act_bytes: int = 4
    """Bytes of a saved matmul input or output: 4 in fp32 training, 2 under bf16 autocast."""
    fpdt: bool = False
    """FPDT (``ParallelConfig.fpdt_chunk``): the MLP of a dense block keeps only its input, the
    rotary angles are gathered per position; with ``chunked_loss`` (no pp) the loss keeps
    d loss / d h and the output layer's gradient instead of the log-softmax."""
    chunked_loss: bool = False
    stream_bytes: int = 4
    """Bytes of the residual stream and the norms' tensors: 4 while parameters are fp32 (this
    model under autocast too), 2 where the parameters themselves are bf16 (Megatron, FSDP mixed precision)."""
    cp_kind: str = "ulysses"
    """ulysses, or allgather: the keys and values of the whole sequence kept (no heads split; hpcml's
    one causal mask of the rank's slice, [S/cp, S] bytes shared by the layers, is not counted)."""
    fused_blocks: bool = False
    """Megatron-core's fused kernels (its bias-SwiGLU, Transformer Engine's norms): the MLP keeps
    its gate and up projections and their product (three tensors of its width; the SiLU is
    recomputed in backward), an RMSNorm its input and 1/rms (no normalised copy)."""
    norm_upcast: bool = False
    """The RMSNorm computes in fp32 from a narrower input and keeps that fp32 copy (hpcml's): its
    input's bytes are 4 whatever the stream's, beside the normalised output in the stream's."""
    loss: str = "eager"
    """eager: the log-softmax of every logit kept (fp32), its gradient made whole in backward;
    fused: the logits kept in ``act_bytes``, the gradient written over them (flash-attn's
    cross-entropy, Liger's, Megatron's in-place kernel); chunked: see ``chunked_loss``."""


def _rms_bytes(how: Saved) -> int:
    """Bytes an RMSNorm keeps per element of its input: the input and the normalised tensor in the
    stream's width (its input alone under fused kernels); an fp32 copy for the input where it upcasts."""
    if how.fused_blocks:
        return how.stream_bytes
    return (4 if how.norm_upcast else how.stream_bytes) + how.stream_bytes


def layer_saved(cfg: TransformerConfig, layer: int, seq_len: int, how: Saved) -> float:
    """Bytes one micro-batch's token keeps in block ``layer`` after forward, on one rank.

    The count is this model's (RMSNorm in fp32, SwiGLU, no dropout), in the style of
    Korthikanti et al. 2022, sec. 4: per token, each sub-block keeps its input, the norm's
    1/rms and normalised output, the projections' shared input; attention keeps q and k after
    rotation, v, the output and a log-sum-exp per head; the MLP its gate, up, silu(gate) and
    product. Column-parallel tensors divide by tp; the norms' tensors divide by tp only under
    sequence parallelism (the projections' input is then the gathered, whole one); everything
    divides by cp (each rank holds S / cp tokens; Ulysses trades positions for heads, and its
    all-to-all back leaves the attention output twice, once per layout).
    """
    tp, cp, a, r = how.tp, how.cp, how.act_bytes, how.stream_bytes
    sp = tp if how.sequence_parallel else 1
    mode = block_recompute(how.recompute, layer)
    if mode == "full":
        return r * cfg.dim / (sp * cp)  # the block's input only
    hd, kvd = cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if mode == "selective-op":  # the input, half the matmul outputs, attention's output and log-sum-exp
        mm = 3 * cfg.dim + 2 * kvd + 2 * _ffn_width(cfg, layer)
        return (r * cfg.dim / sp + a * (mm / 2 + cfg.dim) / tp + 4 * cfg.n_heads / tp) / cp
    # two sub-blocks: RMSNorm keeps its input, the normalised fp32 tensor and 1/rms; LayerNorm its input,
    # mean and 1/std (its output is the projections' input, counted there)
    if cfg.norm == "rmsnorm":
        norm_side = 2 * (_rms_bytes(how) * cfg.dim + 4)
    else:
        norm_side = 2 * (r * cfg.dim + 8)
    shared_in = 2 * cfg.dim  # the projections' input of each sub-block
    if how.stream_bytes > a and not cfg.is_moe(layer) and not how.fpdt:  # autocast over an fp32 stream: each
        # linear keeps its own cast of the input -- q, k and v (fused: one); the MLP's gate and up (GeLU: up)
        two = cfg.activation == "swiglu" and not cfg.fused_mlp
        shared_in = ((1 if cfg.fused_qkv else 3) + (2 if two else 1)) * cfg.dim
    if how.sequence_parallel:
        norm_side /= tp
        if not how.sp_saves_gathered:
            shared_in /= tp
    attn = (cfg.n_heads * hd + kvd + kvd + cfg.n_heads * hd) / tp  # q, k (rotated), v, output
    if cp > 1 and how.cp_kind == "allgather":  # the gathered keys and values of every slice, and the mask
        attn += 2 * kvd * (cp - 1) / tp
    elif cp > 1:  # Ulysses: the output comes back to the sequence layout in a tensor of its own (wo's input)
        attn += cfg.n_heads * hd / tp
    lse = 4 * cfg.n_heads / tp / a  # fp32 log-sum-exp, in units of act_bytes
    if how.attention == "eager":
        lse = 2 * cfg.n_heads * seq_len / tp  # scores and probabilities of every key (causal, stored whole)
    if mode == "selective":
        attn, lse = (kvd + kvd + 2 * cfg.n_heads * hd) / tp, 0.0  # q, k, v and output kept; the core recomputed
    if how.fpdt and not cfg.is_moe(layer):  # the MLP sub-block chunked and recomputed: its input h alone
        return (norm_side / 2 + a * (shared_in / 2 + attn + lse) + r * cfg.dim) / cp
    # SwiGLU keeps gate, up, silu(gate) and their product; GeLU the up projection and its GeLU
    # (three under fused_blocks: the SiLU recomputed from the gate in backward)
    ffn = (2.0 if cfg.activation != "swiglu" else 3.0 if how.fused_blocks else 4.0) * _ffn_width(cfg, layer) / tp
    if cfg.is_moe(layer):  # the router's fp32 scores, each assignment's permuted input and expert output
        ffn += 4 * cfg.n_experts / a + 2 * cfg.moe_top_k * cfg.dim
    return (norm_side + a * (shared_in + attn + lse + ffn)) / cp


def bias_saved(cfg: TransformerConfig, seq_len: int, how: Saved) -> float:
    """Bytes of ALiBi's mask in one micro-batch's forward of a stage: ``[heads, rows, S]`` in the
    attention's dtype, one tensor shared by the stage's layers and saved by SDPA for backward
    (a rank holds heads / tp, and under cp either heads / cp -- Ulysses -- or rows S / cp)."""
    if cfg.positions != "alibi":
        return 0.0
    return how.act_bytes * cfg.n_heads * seq_len * seq_len / (how.tp * how.cp)


def head_constant(cfg: TransformerConfig, how: Saved, *, last: bool) -> float:
    """Bytes outside the blocks that do not grow with the tokens: a chunked loss (FPDT's,
    ``loss_chunk``) keeps the final norm's and the output layer's gradients from forward to
    backward, summed in fp32 (bf16 weights too: a rounding per chunk otherwise)."""
    return 4.0 * (cfg.padded_vocab * cfg.dim / how.tp + cfg.dim) if last and how.chunked_loss else 0.0


def block_recompute(recompute: str, layer: int) -> str:
    """What block ``layer`` does under ``recompute``: selective-layer recomputes the even
    blocks whole (torchtitan's ``ac_freq`` 2) and keeps the odd ones; other modes are per block."""
    if recompute == "selective-layer":
        return "full" if layer % 2 == 0 else "none"
    return recompute


@lru_cache(maxsize=4096)
def layer_kinds(cfg: TransformerConfig, layers: tuple[int, ...]) -> dict[int, int]:
    """``{representative block: how many}`` over ``layers``: blocks alike in everything a
    per-layer count can depend on (MoE or dense, and parity, which selective-layer recompute
    alternates on) count once, so a plan over 126 blocks costs two evaluations."""
    out: dict[int, int] = {}
    first: dict[tuple[bool, int], int] = {}
    for i in layers:
        rep = first.setdefault((cfg.is_moe(i), i % 2), i)
        out[rep] = out.get(rep, 0) + 1
    return out


def _ffn_width(cfg: TransformerConfig, layer: int) -> float:
    """Hidden width a token meets in the feed-forward of ``layer``: top-k experts' and the shared one."""
    if not cfg.is_moe(layer):
        return cfg.hidden
    return cfg.moe_top_k * cfg.expert_hidden + cfg.moe_shared_hidden


def head_saved(cfg: TransformerConfig, how: Saved, *, first: bool, last: bool) -> float:
    """Bytes per token outside the blocks: the token ids on the first stage; on the last, the
    final norm (fp32), the output projection's input and the log-softmax of every logit (fp32;
    vocabulary-sharded over tp, as ``loss_parallel`` keeps it), or under FPDT's chunked loss
    d loss / d h; under FPDT the rotary angles, gathered per position."""
    out = 8.0 if first else 0.0
    if how.fpdt and cfg.positions == "rope":
        out += 2 * 4 * cfg.head_dim / 2  # cos and sin of each position (fp32), shared by the stage's blocks
    if last and how.chunked_loss:
        out += how.stream_bytes * cfg.dim
    elif last:
        logit = how.act_bytes if how.loss == "fused" else 4  # the logits kept, or their fp32 log-softmax
        norm = (_rms_bytes(how) * cfg.dim + 4 if cfg.norm == "rmsnorm" else how.stream_bytes * cfg.dim + 8)
        out += norm / (how.tp if how.sequence_parallel else 1) \
            + how.act_bytes * cfg.dim + logit * cfg.padded_vocab / how.tp
    return out / how.cp
