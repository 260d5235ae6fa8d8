"""A Llama-style decoder transformer (``model``) and its parallel plan (``parallelize``):
how tp, cp, pp, activation checkpointing and FSDP apply to it, kept next to the model as
torchtitan keeps ``models/<name>/infra/parallelize.py``."""

from hpcml.models.transformer.model import (
    PRESETS,
    Transformer,
    TransformerConfig,
    apply_rope,
    cross_entropy,
    rope_tables,
)

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "apply_rope", "cross_entropy", "rope_tables"]
