"""Reference models: a Llama-style decoder transformer and field surrogates. No rank logic here.
Names load on first use, so ``hpcml.models.transformer.config`` is read without torch."""

from __future__ import annotations

from hpcml.lazy import lazy_names

_WHERE = {"ConvSurrogate": "surrogate", "ConvSurrogateConfig": "surrogate", "MLPSurrogate": "surrogate",
          "MLPSurrogateConfig": "surrogate", "PRESETS": "transformer", "Transformer": "transformer",
          "TransformerConfig": "transformer", "cross_entropy": "transformer"}

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)
