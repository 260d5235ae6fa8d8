"""A step whose loss or gradients are NaN or infinite is not applied (as Megatron skips an
overflowed step): before, one such step made every weight NaN, training went on for as long
as the job ran, and its saves of NaN weights rotated the good checkpoints out."""

from __future__ import annotations

import math

import pytest
import torch

from hpcml.errors import DivergenceError
from hpcml.models.transformer import TransformerConfig
from hpcml.train import loop
from hpcml.train.recipe import build_llm_trainer
from hpcml.train.trainer import TrainConfig

TRAIN = TrainConfig(steps=30, global_batch=4, seq_len=16, warmup_steps=2, progress=False)


def _trainer():
    from mpi4py import MPI

    return build_llm_trainer(TransformerConfig.preset("tiny"), TRAIN, comm=MPI.COMM_SELF)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.parts[0].state_dict().items()}


def test_a_non_finite_step_is_skipped_and_training_goes_on(monkeypatch):
    trainer = _trainer()
    trainer.fit(steps=2)
    before, lr_before = _weights(trainer), trainer.scheduler.last_epoch
    norm = trainer.model.local_sq_grad_norm
    monkeypatch.setattr(trainer.model, "local_sq_grad_norm", lambda: torch.tensor(math.nan))  # a bad batch
    m = trainer.train_step()
    assert m["skipped"] is True and m["step"] == 3 and math.isnan(m["grad_norm"])
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing applied
    assert trainer.scheduler.last_epoch == lr_before + 1 and trainer.skipped_steps == 1  # the schedule goes on
    monkeypatch.setattr(trainer.model, "local_sq_grad_norm", norm)
    m = trainer.train_step()
    assert "skipped" not in m and math.isfinite(m["loss"]) and trainer.nonfinite_in_row == 0
    assert any(not torch.equal(before[k], v) for k, v in _weights(trainer).items())  # trains on


def test_a_run_that_stays_non_finite_stops_on_the_last_finite_weights(monkeypatch):
    trainer = _trainer()
    trainer.fit(steps=2)
    before = _weights(trainer)
    monkeypatch.setattr(trainer.model, "local_sq_grad_norm", lambda: torch.tensor(math.inf))
    with pytest.raises(DivergenceError) as e:
        trainer.fit()
    assert str(e.value).startswith(f"training diverged: the loss or the gradient norm was NaN or infinite at "
                                   f"{loop.MAX_NONFINITE_IN_ROW} steps in a row (steps 3-12: loss ")
    assert "none was applied, so the weights are those of step 2 -- lower the learning rate" in str(e.value)
    assert isinstance(e.value, FloatingPointError) and trainer.step == 11  # the 10th skipped step raised
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
