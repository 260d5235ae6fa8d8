"""Reference models: a Llama-style decoder transformer and field surrogates. No rank logic here."""

from hpcml.models.surrogate import ConvSurrogate, ConvSurrogateConfig, MLPSurrogate, MLPSurrogateConfig
from hpcml.models.transformer import PRESETS, Transformer, TransformerConfig, cross_entropy

__all__ = ["PRESETS", "ConvSurrogate", "ConvSurrogateConfig", "MLPSurrogate", "MLPSurrogateConfig", "Transformer",
           "TransformerConfig", "cross_entropy"]
