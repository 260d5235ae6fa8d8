"""Named transformer sizes: tests' tiny ones, Megatron-LM's Table 1, Llama, and MoE models
(Mixtral-8x7B, GRIN-MoE) by their published shapes, checked by parameter count."""

from __future__ import annotations

from hpcml.models.transformer.config import TransformerConfig


def _megatron(h: int, heads: int, layers: int) -> TransformerConfig:
    # Megatron-LM (Narayanan et al. 2021) Table 1: vocab 51200, seq 2048, GELU 4h; a SwiGLU of 8h/3 has the same 12lh^2.
    return TransformerConfig(vocab_size=51200, dim=h, n_heads=heads, n_layers=layers, max_seq_len=2048,
                             ffn_multiple=128, vocab_multiple=128)


def _llama3(dim: int, layers: int, heads: int, hidden: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=128256, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8,
                             ffn_hidden=hidden, max_seq_len=8192, rope_theta=500000.0, rope_scaling="llama3",
                             rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                             rope_original_max_seq=8192)


PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(vocab_size=256, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128,
                              max_seq_len=64),
    "small": TransformerConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=1024,
                               tie_embeddings=True, ffn_multiple=256),
    # a model a 2-core CPU trains in about a second a step: the planner's validation runs (benchmarks/plan_validate.py)
    "mini": TransformerConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                              max_seq_len=512),
    "megatron-1.7b": _megatron(2304, 24, 24),
    "megatron-3.6b": _megatron(3072, 32, 30),
    "megatron-7.5b": _megatron(4096, 32, 36),
    "megatron-18b": _megatron(6144, 48, 40),
    "megatron-39b": _megatron(8192, 64, 48),
    "megatron-76b": _megatron(10240, 80, 60),
    "megatron-145b": _megatron(12288, 96, 80),
    "megatron-310b": _megatron(16384, 128, 96),
    "megatron-530b": _megatron(20480, 128, 105),
    "megatron-1t": _megatron(25600, 160, 128),
    # Korthikanti et al. 2022, Table 3 (with 530B = megatron-530b and 1T = megatron-1t above)
    "megatron-22b": _megatron(6144, 64, 48),
    "gpt3-175b": _megatron(12288, 96, 96),
    # Llama 1 (Touvron et al. 2023a), Llama 2 70B (2023b), Llama 3.1 (Dubey et al. 2024; its rope
    # scaling, which torchtitan's Llama 3 configs use too): shapes from the papers and model cards
    "llama-7b": TransformerConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008,
                                  max_seq_len=2048, norm_eps=1e-6),
    "llama2-7b": TransformerConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008,
                                   max_seq_len=4096),
    "llama2-13b": TransformerConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824,
                                    max_seq_len=4096),
    "llama2-70b": TransformerConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                    ffn_hidden=28672, max_seq_len=4096),
    "llama3-8b": _llama3(4096, 32, 32, 14336),
    "llama3-70b": _llama3(8192, 80, 64, 28672),
    "llama3-405b": _llama3(16384, 126, 128, 53248),
    "llama-13b": TransformerConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824,
                                   max_seq_len=2048),
    "llama-30b": TransformerConfig(vocab_size=32000, dim=6656, n_layers=60, n_heads=52, ffn_hidden=17920,
                                   max_seq_len=2048),
    "llama-65b": TransformerConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, ffn_hidden=22016,
                                   max_seq_len=2048),
    # -- mixture of experts --------------------------------------------------------------------
    "tiny-moe": TransformerConfig(vocab_size=256, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128,
                                  max_seq_len=64, n_experts=8, moe_top_k=2, moe_hidden=64),
    # Mixtral-8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active; 8 experts top-2 in every block
    "mixtral-8x7b": TransformerConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                      ffn_hidden=14336, max_seq_len=4096, rope_theta=1e6, n_experts=8, moe_top_k=2),
    # GRIN-MoE (Liu et al. 2024; Phi-3.5-MoE's shape): 16 x 3.8B, top-2, 41.9B parameters, 6.6B active
    "grin-moe": TransformerConfig(vocab_size=32064, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                  ffn_hidden=6400, max_seq_len=4096, n_experts=16, moe_top_k=2),
}


