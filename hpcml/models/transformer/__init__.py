"""A Llama-style decoder transformer (``model``) and its parallel plan (``parallelize``):
how tp, cp, pp, activation checkpointing and FSDP apply to it, kept next to the model as
torchtitan keeps ``models/<name>/infra/parallelize.py``.

Its shape (``config``, ``presets``, ``footprint``, ``rules``) imports no torch, so the planner and the
command line read it without paying for torch; the modules load on first use."""

from __future__ import annotations

from hpcml.lazy import lazy_names

_WHERE = {"PRESETS": "presets", "TransformerConfig": "config", "Transformer": "model", "cross_entropy": "model",
          "apply_rope": "rope", "rope_tables": "rope"}

__all__ = ["PRESETS", "Transformer", "TransformerConfig", "apply_rope", "cross_entropy", "rope_tables"]

__getattr__ = lazy_names(__name__, _WHERE)
