"""Hugging Face Llama models built with ``transformers`` itself (no download), the reference
hpcml's export and import are compared against."""

from __future__ import annotations

from pathlib import Path

import torch


def randomise(params, std: float = 0.1, seed: int = 0) -> None:
    """Weights far from an initialisation's near-zero logits, so a wrong permutation shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))


def make_llama(path: str | Path, *, vocab: int = 250, dim: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, hidden: int = 96, tied: bool = False, theta: float = 500.0,
               max_pos: int = 64, seed: int = 0, rope: dict | None = None, **extra) -> Path:
    """A random LlamaForCausalLM saved with ``save_pretrained`` (fp32 safetensors) under ``path``;
    ``rope``: its rope_parameters beyond rope_theta (e.g. Llama 3's scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    qwen = extra.pop("qwen2", False)  # Qwen2: Llama with biases on q, k and v
    config, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen else (LlamaConfig, LlamaForCausalLM)
    cfg = config(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=hidden, tie_word_embeddings=tied,
                      rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": theta},
                      max_position_embeddings=max_pos,
                      rms_norm_eps=1e-6, **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    randomise(model.parameters(), seed=seed)
    model.save_pretrained(path)
    return Path(path)


def hf_logits(path: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the HF directory ``path`` on ``tokens`` (fp32), checking it loaded every weight."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        return model.eval()(tokens).logits
