"""Issue 27, part 4: the plan protocol is a base class. ``parallelize`` calls only the members
of :class:`ParallelPlan`, each with a default, so a user's model overrides what it supports:
the default ``check`` refuses, in one line and before any collective, every axis whose member
it did not override; the hooks default to nothing; a plan that is no ParallelPlan is refused."""

from __future__ import annotations

import pytest
from torch import nn

from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.models.transformer import TransformerConfig
from hpcml.models.transformer.parallelize import TransformerPlan
from hpcml.parallel import ParallelConfig, ParallelPlan
from hpcml.parallel.model_plan import AXIS_MEMBERS, DataParallelPlan, checked_plan, plan_of


class Surrogate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)

    def parallel_plan(self):
        return SurrogatePlan()


class SurrogatePlan(ParallelPlan):
    """A user's plan: FSDP units and activation checkpointing, nothing else."""

    def fsdp_units(self, part):
        return [part.body]

    def apply_activation_checkpointing(self, part):
        part.checkpointed = True


class Piped(SurrogatePlan):
    def stage(self, model, stage, n_stages, config):
        return model


@pytest.mark.parametrize("layout, config, error", [
    (Layout(world_size=4, dp=2, tp=2), ParallelConfig(),
     "SurrogatePlan does not implement apply_tp: it cannot run {'tp': 2} (override them)"),
    (Layout(world_size=8, dp=2, cp=2, pp=2), ParallelConfig(),
     "SurrogatePlan does not implement apply_cp, stage: it cannot run {'cp': 2, 'pp': 2} (override them)"),
    (Layout(world_size=4, dp=4, ep=2), ParallelConfig(),
     "SurrogatePlan does not implement apply_moe: it cannot run {'ep': 2} (override them)"),
    (Layout(world_size=2, dp=2), ParallelConfig(sequence_parallel=True),
     "SurrogatePlan does not implement apply_tp: sequence_parallel is part of it"),
    (Layout(world_size=2, dp=2), ParallelConfig(fpdt_chunk=64),
     "SurrogatePlan does not implement apply_fpdt: it cannot run fpdt_chunk 64"),
])
def test_the_default_check_refuses_every_axis_the_plan_does_not_implement(layout, config, error):
    with pytest.raises(ConfigError) as e:
        SurrogatePlan().check(layout, config)
    assert str(e.value) == error


def test_a_plan_runs_what_it_overrides_and_the_rest_defaults_to_nothing():
    plan = plan_of(Surrogate())
    plan.check(Layout(world_size=4, dp=4), ParallelConfig(activation_checkpointing=True, fsdp=True))
    model = Surrogate()
    assert plan.fsdp_units(model) == [model.body] and plan.supports("apply_activation_checkpointing")
    assert not plan.supports("apply_tp") and plan.loss_fn is None and plan.stat_names == ()
    assert (plan.apply_moe(model, None, None), plan.expert_modules(model), plan.step_stats(model, None)) == ([], [], {})
    assert plan.fsdp_grad_syncs([model], Layout(world_size=4, dp=4)) == [] and plan.tensor_attrs() == {}
    assert plan.set_grad_scale(model, 0.5) is None and plan.after_step(model) is None
    assert plan.computes_loss(ParallelConfig(fpdt_chunk=8)) is False
    with pytest.raises(ConfigError, match=r"^Piped has no loss_fn: a pipeline computes the loss on its last stage$"):
        Piped().check(Layout(world_size=4, dp=2, pp=2), ParallelConfig())
    with pytest.raises(ConfigError, match=r"^ParallelPlan does not implement apply_activation_checkpointing$"):
        ParallelPlan().check(Layout(world_size=1), ParallelConfig(activation_checkpointing=True))


def test_the_models_own_plans_are_parallel_plans_and_a_duck_typed_one_is_refused():
    transformer = TransformerPlan(TransformerConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64))
    assert all(transformer.supports(m) for m in (*AXIS_MEMBERS.values(), "apply_activation_checkpointing",
                                                 "apply_fpdt", "computes_loss"))
    assert isinstance(plan_of(nn.Linear(2, 2)), DataParallelPlan)
    with pytest.raises(ConfigError, match=r"^Linear has no parallel plan for \{'tp': 2\}"):
        plan_of(nn.Linear(2, 2)).check(Layout(world_size=2, dp=1, tp=2), ParallelConfig())

    class Duck:  # the old protocol, structurally
        loss_fn = None

        def check(self, layout, config):
            pass

    with pytest.raises(ConfigError, match=r"^parallel plan Duck: expected a subclass of hpcml.parallel.ParallelPlan"):
        checked_plan(Duck())


def test_a_plan_with_ulysses_but_no_fpdt_is_refused_fpdt():
    """An older plan that implements apply_cp only: FPDT's strided tokens would reach its
    contiguous Ulysses (silently wrong attention), so fpdt_chunk is refused before anything runs."""

    class UlyssesOnly(SurrogatePlan):
        def apply_cp(self, part, group, index, count):
            pass

    UlyssesOnly().check(Layout(world_size=2, cp=2), ParallelConfig())
    with pytest.raises(ConfigError, match=r"^UlyssesOnly does not implement apply_fpdt: it cannot run fpdt_chunk 8$"):
        UlyssesOnly().check(Layout(world_size=2, cp=2), ParallelConfig(fpdt_chunk=8))


def test_a_run_without_a_pipeline_never_imports_torchs_pipelining():
    """``torch.distributed.pipelining`` brings in torch's compiler stack (~0.5 CPU-s a rank at
    every launch, measured on the reference run): imported only where a schedule is built, each
    schedule name the config accepts naming a class torch has."""
    import subprocess
    import sys

    from torch.distributed import pipelining

    from hpcml.parallel import pp
    from hpcml.parallel.config import PP_SCHEDULES

    assert sorted(pp._CLASSES) == sorted(PP_SCHEDULES)
    assert all(isinstance(getattr(pipelining, name), type) for name in pp._CLASSES.values())
    code = "import sys, hpcml.parallel.api; print('torch.distributed.pipelining' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
