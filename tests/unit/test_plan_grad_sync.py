"""When FSDP reduce-scatters gradients under accumulation (``grad_sync``), in the trainer's config
and the planner: each micro-batch (FSDP2's default, the trainer's since session 26) or once a step
(every rank holding its unsharded gradients until then). The bytes on the wire against the real
collectives are ``tests/mpi/test_hsdp.py``'s; here the memory, the time, the layout keys and
their refusals, and the flags that carry them to llm_pretrain.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpcml.cli import main as cli
from hpcml.errors import ConfigError
from hpcml.models.transformer.config import TransformerConfig
from hpcml.parallel import ParallelConfig
from hpcml.plan.calibrate import read_runs
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.memory import memory
from hpcml.plan.placement import rank_state
from hpcml.plan.predict import predict
from hpcml.plan.emit import emit as emit_args, member_entry
from hpcml.plan.traffic import dp_bytes


def _fsdp(**kw) -> PlanLayout:
    """Llama 3 8B, FSDP on 64 A100s, 16 sequences a rank: 16 micro-batches of 1 (or fewer, larger)."""
    base = dict(model=TransformerConfig.preset("llama3-8b"), gpus=64, gpu="a100-80gb", seq_len=4096,
                global_batch=1024, zero=3, micro_batch=1)
    return PlanLayout(**{**base, **kw})


def test_syncing_once_a_step_holds_every_unsharded_gradient():
    """4 bytes a parameter of the rank's model (fp32; 2 in a bf16 reduction) more, with more than one
    micro-batch; nothing more with one."""
    step, each = _fsdp(grad_sync="step"), _fsdp()
    cfg = each.model
    params = rank_state(cfg, each, 0).compute_params
    assert params > 7e9 and each.microbatches == 16 and not each.step_sync and step.step_sync
    assert memory(cfg, step).buffers - memory(cfg, each).buffers == pytest.approx(4 * params, rel=1e-12)
    bf16 = replace(step, reduce_dtype="bf16")
    assert memory(cfg, bf16).buffers - memory(cfg, replace(each, reduce_dtype="bf16")).buffers == \
        pytest.approx(2 * params, rel=1e-12)
    whole = dict(global_batch=64, micro_batch=1)  # one micro-batch a rank: the two are the same
    assert memory(cfg, _fsdp(**whole)).total == memory(cfg, _fsdp(**whole, grad_sync="step")).total


def test_each_micro_batch_sends_a_reduce_scatter_more():
    """The bytes a step: m gathers (ZeRO-2: once a micro-batch) and m reduce-scatters, or m gathers
    and one; what two step-synced micro-batch counts give for the gathers and the reduce-scatter
    predicts the default's bytes."""
    def sent(m: int, sync: str | None) -> float:
        lay = _fsdp(zero=2, grad_sync=sync, global_batch=64 * m)
        assert lay.microbatches == m
        return sum(dp_bytes(lay.model, lay, 8).values())

    gather = sent(2, "step") - sent(1, "step")  # a micro-batch's gathers
    reduce = sent(1, "step") - gather
    assert gather > 0 and reduce > 0
    for m in (2, 4, 16):
        assert sent(m, None) == pytest.approx(m * (gather + reduce), rel=1e-12)
        assert sent(m, "step") == pytest.approx(m * gather + reduce, rel=1e-12)


def test_the_default_is_priced_as_torchtitan_prices_fsdp():
    """The data-parallel time of the default equals torchtitan's (the same collectives), and is more
    than once a step's at 16 micro-batches (none of it hidden here, so the sends are what differ)."""
    from hpcml.plan.calibration import constants
    from hpcml.plan.predict import resolve_device

    c = replace(constants(resolve_device(_fsdp())), dp_overlap=0.0)
    each, step = predict(_fsdp(), c), predict(_fsdp(grad_sync="step"), c)
    titan = predict(_fsdp(framework="torchtitan"), c)
    assert each.parts_s['dp'] == pytest.approx(titan.parts_s['dp'], rel=1e-12)
    assert each.parts_s['dp'] > step.parts_s['dp'] and each.memory_gib["total"] < step.memory_gib["total"] - 20


@pytest.mark.parametrize("kw,match", [
    (dict(grad_sync="often"), "grad_sync='often': expected one of microbatch, step"),
    (dict(grad_sync="step", zero=0), "grad_sync step with zero 0: it is when FSDP \\(zero 2 or 3\\) reduce-scatters"),
    (dict(grad_sync="step", framework="torchtitan"), "grad_sync step with framework torchtitan: without a pipeline "
                                                     "only hpcml's trainer"),
    (dict(grad_sync="microbatch", pp=2, micro_batch=1), "grad_sync microbatch with pp 2: a pipeline reduces once"),
])
def test_bad_grad_sync_layouts_are_refused_naming_the_value(kw, match):
    with pytest.raises(ConfigError, match=match):
        _fsdp(**kw)


def test_json_reads_back_what_it_wrote():
    """``--json`` names the sync a layout was priced with; a pipeline's (once a step, every
    framework's) reads back as a layout."""
    from hpcml.plan.predict import predict

    for fw in ("torchtitan", "megatron", "hpcml"):
        lay = _fsdp(framework=fw, pp=2, model="llama3-8b")
        d = predict(lay).to_dict()["layout"]
        assert d["grad_sync"] == "step" and PlanLayout.from_dict(d).step_sync, fw


def test_a_search_takes_the_sync_asked_for(capsys):
    common = ["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "a100-80gb", "--seq-len", "4096",
              "--global-batch", "256", "--json"]
    assert cli([*common, "--grad-sync", "step"]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["best"]
    assert all(b["layout"].get("grad_sync", "step") == "step" or b["layout"]["zero"] < 2 for b in best)
    assert cli([*common, "--grad-sync", "step", "--framework", "torchtitan"]) == 2
    assert "grad_sync step with framework torchtitan: without a pipeline only hpcml" in capsys.readouterr().err


def test_the_trainers_config_refuses_what_it_cannot_do():
    assert ParallelConfig(fsdp=True, grad_sync="step").grad_sync == "step"
    with pytest.raises(ConfigError, match="grad_sync 'sometimes': expected one of microbatch, step"):
        ParallelConfig(fsdp=True, grad_sync="sometimes")
    with pytest.raises(ConfigError, match="grad_sync 'step' without fsdp: it is when FSDP reduce-scatters; DDP "
                                          "all-reduces once a step"):
        ParallelConfig(grad_sync="step")


def test_the_flags_carry_it_to_the_trainer(capsys):
    args = emit_args(_fsdp(grad_sync="step", model="llama3-8b"))
    assert args[args.index("--grad-sync") + 1] == "step"
    assert "--grad-sync" not in emit_args(_fsdp(model="llama3-8b"))
    assert member_entry(_fsdp(grad_sync="step"))["grad_sync"] == "step" and "grad_sync" not in member_entry(_fsdp())
    common = ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "a100-80gb", "--seq-len", "4096",
              "--global-batch", "1024", "--fsdp", "--micro-batch", "1", "--json"]
    got = {}
    for sync in ("microbatch", "step"):
        assert cli([*common, "--grad-sync", sync]) == 0
        got[sync] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["step"]["memory_gib"]["total"] - got["microbatch"]["memory_gib"]["total"] > 20
    assert (got["step"]["layout"]["grad_sync"], got["microbatch"]["layout"]["grad_sync"]) == ("step", "microbatch")


def test_a_run_directory_says_how_its_trainer_synced(tmp_path):
    """A run recorded before the key existed synced once a step (the trainer's rule then); one that
    records None ran the default."""
    def run(name: str, **par) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(
            {"train": {"steps": 4, "bf16": False, "global_batch": 16, "micro_batch": 2, "seq_len": 128},
             "layout": {"pp": 1, "dp": 2, "cp": 1, "tp": 1},
             "parallel": {"fsdp": True, "reshard_after_forward": True, **par}}))
        (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "step_s": 1.0}) + "\n"
                                                    for i in range(4)))
        return str(path)

    old, new, step = read_runs([run("old"), run("new", grad_sync=None), run("step", grad_sync="step")],
                               {"model": "mini"})
    assert (old.layout.grad_sync, new.layout.grad_sync, step.layout.grad_sync) == ("step", "microbatch", "step")
    assert old.layout.microbatches == 4 and old.layout.step_sync and not new.layout.step_sync


def test_a_search_tries_both_syncs_for_hpcml_and_prunes_as_brute_force_would():
    """hpcml's FSDP layouts with more than one micro-batch are tried both ways; the search skips a
    group's other recompute modes when full recompute does not fit (the least memory of them), and
    does not price a layout whose step floor is slower than its best so far (session 33): the same
    best five as pricing every candidate, the fitting ones it did not count all among those it did
    not price, and the floor under every step."""
    from hpcml.plan import calibration
    from hpcml.plan.floor import step_floor
    from hpcml.plan.predict import evaluate, load_model, resolve_device
    from hpcml.plan.search import _faster, _fits, candidates, search

    for fw, gb in (("hpcml", 1024), ("torchtitan", 256), ("megatron", 256)):
        base = PlanLayout(model="llama3-70b", gpus=64, gpu="h100-80gb", seq_len=8192, global_batch=gb,
                          framework=fw, degrees_checked=False)
        cfg, dev = load_model(base.model), resolve_device(base)
        c = calibration.constants(dev)
        every = [evaluate(cfg, dev, c, lay, time_if_oom=False) for lay in candidates(base, cfg, dev, refused=[0])]
        fit = sorted((p for p in every if _fits(p, dev, 0.0)), key=_faster)
        got = search(base)
        assert got.candidates - got.refused == len(every) and 5 < got.fitting <= len(fit), fw
        assert len(fit) - got.fitting <= got.unpriced, fw
        assert all(step_floor(cfg, dev, c, p.layout) <= p.step_s for p in fit), fw
        assert [p.layout for p in got.best] == [p.layout for p in fit[:5]], fw
        syncs = {p.layout.grad_sync for p in every if p.layout.zero >= 2 and p.layout.pp == 1
                 and p.layout.microbatches > 1}
        assert syncs == ({None, "step"} if fw == "hpcml" else {None}), fw


def test_the_recompute_prune_keeps_a_one_block_stage_whose_full_recompute_needs_more():
    """A rank holding one block keeps its input and a whole block for the recompute under full
    recompute, more than the block alone without it: such a group is priced mode by mode."""
    from hpcml.plan import calibration
    from hpcml.plan.predict import evaluate, resolve_device
    from hpcml.plan.search import search

    cfg = TransformerConfig(vocab_size=128000, dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                            max_seq_len=8192)
    base = PlanLayout(model=cfg, gpus=2, gpu="h100-80gb", seq_len=8192, global_batch=8, degrees_checked=False)
    dev = resolve_device(base)
    c = calibration.constants(dev)
    at = dict(model=cfg, gpus=2, gpu="h100-80gb", seq_len=8192, global_batch=8, pp=2, micro_batch=1)
    none, full = (evaluate(cfg, dev, c, PlanLayout(**at, recompute=rc), time_if_oom=False).memory_gib["total"]
                  for rc in ("none", "full"))
    assert none < full
    headroom = 1 - (none + full) / 2 / dev.memory_gib  # none fits, full does not
    got = [p.layout for p in search(base, top=1000, headroom=headroom).best]
    assert any(lay.pp == 2 and lay.zero == 0 and lay.micro_batch == 1 and lay.recompute == "none" for lay in got)


def test_with_degrees_checks_what_the_degrees_break():
    base = _fsdp()
    assert base.with_degrees(tp=8, micro_batch=2) == replace(base, tp=8, micro_batch=2)
    with pytest.raises(ConfigError, match="gpus 64 is not divisible by tp 3"):
        base.with_degrees(tp=3)
    with pytest.raises(ConfigError, match="with_degrees\\(zero\\): expected some of tp, pp"):
        base.with_degrees(zero=2)
    with pytest.raises(ConfigError, match="a pipeline reduces once a step"):
        _fsdp(grad_sync="microbatch").with_degrees(pp=2)
    for bad in (dict(tp=-1), dict(pp=0), dict(micro_batch=0), dict(tp=1 << 41)):
        with pytest.raises(ConfigError, match="expected an integer in \\[1, 2\\^40\\]"):
            base.with_degrees(**bad)
    with pytest.raises(ConfigError, match="ZeRO 0 or 1 only"):
        _fsdp(framework="deepspeed").with_degrees(pp=2)
