"""The training loop, its metrics and run directory, and deterministic data."""

from hpcml.train.data import SyntheticTokens
from hpcml.train.trainer import TrainConfig, Trainer, lr_factor, make_optimizer

__all__ = ["SyntheticTokens", "TrainConfig", "Trainer", "lr_factor", "make_optimizer"]
