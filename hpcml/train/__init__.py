"""Training: one loop (:mod:`hpcml.train.loop`) under the LLM trainer and the field
surrogates' trainer, their checkpoints, online training from sample sources, and
deterministic data; a campaign's training job in one call (:func:`train_surrogate`);
tournaments of a population of trainers (:class:`Tournament`). Every name loads its module
on first use (:func:`hpcml.lazy.lazy_names`)."""

from hpcml.lazy import lazy_names

_LAZY = {"SyntheticTokens": "data", "FieldScales": "fields", "FieldTrainConfig": "fields", "FieldTrainer": "fields",
         "LoopConfig": "config", "Stateful": "loop", "TrainLoop": "loop", "OnlineConfig": "online",
         "OnlineResult": "online", "train_online": "online", "PopulationConfig": "population_online",
         "Tournament": "population",
         "TournamentConfig": "population", "train_surrogate": "surrogate_job", "TrainConfig": "config",
         "Trainer": "trainer"}

__all__ = sorted(_LAZY)

__getattr__ = lazy_names(__name__, _LAZY)
