"""Training: one loop (:mod:`hpcml.train.loop`) under the LLM trainer and the field
surrogates' trainer, their checkpoints, online training from sample sources, and
deterministic data; a campaign's training job in one call (:func:`train_surrogate`);
tournaments of a population of trainers (:class:`Tournament`)."""

from hpcml.train.data import SyntheticTokens
from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer
from hpcml.train.loop import LoopConfig, Stateful, TrainLoop
from hpcml.train.online import OnlineConfig, OnlineResult, train_online
from hpcml.train.population import Tournament, TournamentConfig
from hpcml.train.surrogate_job import train_surrogate
from hpcml.train.trainer import TrainConfig, Trainer

__all__ = ["FieldScales", "FieldTrainConfig", "FieldTrainer", "LoopConfig", "OnlineConfig", "OnlineResult", "Stateful",
           "SyntheticTokens", "Tournament", "TournamentConfig", "TrainConfig", "TrainLoop", "Trainer", "train_online",
           "train_surrogate"]
