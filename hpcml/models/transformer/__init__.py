"""A Llama-style decoder transformer (``model``) and its parallel plan (``parallelize``):
how tp, cp, pp, activation checkpointing and FSDP apply to it, kept next to the model as
torchtitan keeps ``models/<name>/infra/parallelize.py``."""

from hpcml.models.transformer.model import Transformer, TransformerConfig, cross_entropy
from hpcml.models.transformer.rope import apply_rope, rope_tables
from hpcml.models.transformer.presets import PRESETS

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "apply_rope", "cross_entropy", "rope_tables"]
