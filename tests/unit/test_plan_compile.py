"""torch.compile in the planner (``compile``: torchtitan's blocks compiled, their elementwise passes
fused) and the held-out table it opens: torchtitan's December 2024 Float8 runs, 8B to 405B on 8-512
H100s in 1-D to 4-D parallelism, each with its peak memory (issue 42)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpcml.errors import ConfigError
from hpcml.plan import calibration
from hpcml.plan.candidate import PlanLayout
from hpcml.plan.floor import step_floor
from hpcml.plan.predict import evaluate, load_model, predict, resolve_device
from hpcml.plan.published import (CALIBRATION, DEVICE_CALIBRATION, MEMORY_CALIBRATION, STAGED_CALIBRATION,
                                  TABLES)
from hpcml.plan.scoring import score_table

ONE = PlanLayout(model="llama3-8b", gpus=1, gpu="h100-80gb", seq_len=4096, global_batch=1, recompute="full",
                 framework="torchtitan")


def test_compile_takes_the_fitted_share_of_the_elementwise_passes_and_nothing_else():
    """One GPU, nothing to overlap: the step is linear in the passes, so compiling saves exactly
    ``1 - compiled_passes`` of the eager step's elementwise seconds; memory does not move."""
    cfg, dev = load_model(ONE.model), resolve_device(ONE)
    c = calibration.constants(dev)
    assert c.compiled_passes == 0.3 and c.elementwise_passes == 80.0  # nvidia-h100's fitted constants
    eager = evaluate(cfg, dev, c, ONE).step_s
    none = evaluate(cfg, dev, replace(c, elementwise_passes=0.0), ONE).step_s
    compiled = evaluate(cfg, dev, c, replace(ONE, compile=True))
    assert eager - none > 0.05 * eager  # the passes are a real share of the step
    assert eager - compiled.step_s == pytest.approx(0.7 * (eager - none), rel=1e-9)
    assert compiled.memory_gib == predict(ONE).memory_gib
    # the A100 family has no compiled table: the default estimate, half the passes
    a100 = calibration.constants(resolve_device(replace(ONE, gpu="a100-80gb")))
    assert a100.compiled_passes == 0.5


def test_compile_is_torchtitans_and_a_boolean():
    for framework in ("hpcml", "megatron", "deepspeed"):
        with pytest.raises(ConfigError, match=f"compile with framework {framework}: .*drop compile"):
            replace(ONE, framework=framework, compile=True)
    with pytest.raises(ConfigError, match="compile='yes': expected true or false"):
        replace(ONE, compile="yes")


def test_compile_on_the_command_line_in_a_line_and_in_a_search(capsys):
    from hpcml.cli import main as cli

    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "8192",
            "--global-batch", "16", "--framework", "torchtitan", "--fsdp", "--recompute", "full"]
    assert cli([*base, "--compile", "--json"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["layout"]["compile"] is True
    assert cli([*base, "--json"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert eager["layout"]["compile"] is False and compiled["step_s"] < eager["step_s"]
    assert cli([*base, "--compile"]) == 0
    assert " compile true" in capsys.readouterr().out  # a line says it was priced compiled
    assert cli(base[:-5] + base[-3:] + ["--compile"]) == 2  # the default framework, hpcml's: refused in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compile with framework hpcml" in err[0]
    # a search keeps the layout's compile: every answer priced compiled
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100-80gb", "--seq-len", "8192",
                "--global-batch", "64", "--framework", "torchtitan", "--compile", "--json", "--top", "3"]) == 0
    found = json.loads(capsys.readouterr().out)
    best = found["best"] if isinstance(found, dict) else found
    assert len(best) == 3 and all(b["layout"]["compile"] is True for b in best)


@pytest.mark.parametrize("degrees", [dict(tp=8, pp=8, zero=2, micro_batch=4, recompute="full"),
                                     dict(tp=8, pp=8, zero=2, micro_batch=2, recompute="none",
                                          schedule="interleaved1f1b", stages_per_rank=2),
                                     dict(tp=4, cp=2, zero=3, micro_batch=1, recompute="selective-op",
                                          sequence_parallel=True, cp_kind="allgather")])
def test_the_search_floor_stays_under_a_compiled_step(degrees):
    lay = PlanLayout(model="llama3-405b" if degrees.get("pp") else "llama3-70b", gpus=512, gpu="h100-80gb",
                     seq_len=8192, global_batch=256, framework="torchtitan", compile=True, **degrees)
    cfg, dev = load_model(lay.model), resolve_device(lay)
    c = calibration.constants(dev)
    step = evaluate(cfg, dev, c, lay).step_s
    assert 0 < step_floor(cfg, dev, c, lay) <= step_floor(cfg, dev, c, lay, comm=True) <= step
    # and the floor falls with compile as the step does
    eager = replace(lay, compile=False)
    assert step_floor(cfg, dev, c, lay) < step_floor(cfg, dev, c, eager)


def test_the_compiled_pair_fits_compiled_passes_and_the_float8_table_is_held_out():
    assert STAGED_CALIBRATION["nvidia-h100"][-1] == "torchtitan-h100-compile"
    pair = score_table(TABLES["torchtitan-h100-compile"]())
    assert pair.fit_agrees == 1.0 and all(abs(e) <= 0.02 for e in pair.errors), pair.errors
    fitted = {t for ts in (*CALIBRATION.values(), *STAGED_CALIBRATION.values(), *DEVICE_CALIBRATION.values(),
                           *MEMORY_CALIBRATION.values()) for t in ts}
    assert "torchtitan-h100-4d" not in fitted


def test_torchtitan_4d_table_read_as_published_and_meets_the_bars():
    """Held out: 14 runs, every one predicted to fit; tokens/s median <= 10%, p90 <= 25%, Spearman
    of MFU >= 0.6; memory within 10% of the published peak on 13 rows. The interleaved 405B row is
    +11% (+26% while its last rank's micro-batches in flight were counted at the rank's average over
    its two stages, where torch's schedule holds one of the last, with the logits: ``held``): held to
    what it is, so that a change shows."""
    cases = TABLES["torchtitan-h100-4d"]()
    assert len(cases) == 14 and {c.layout.gpu for c in cases} == {"h100-96gb-500w"}
    assert all(c.layout.compile and c.layout.precision == "fp8" for c in cases)
    by = {c.label.split(" ", 2)[2]: c.layout for c in cases}
    inter = by["405B FSDP 8, TP 8, PP8 Interleaved 1F1B (+AsyncTP)"]
    assert (inter.pp, inter.v, inter.microbatches, inter.micro_batch, inter.zero, inter.split, inter.overlap,
            inter.global_batch) == (8, 2, 8, 4, 2, "first", True, 256)
    cp8 = by["405B FSDP 1, CP 8, TP 8, PP8 FSDP 1, CP 8 (+AsyncTP, 1F1B)"]
    assert (cp8.cp, cp8.cp_kind, cp8.seq_len, cp8.global_batch, cp8.micro_batch, cp8.recompute) == (
        8, "allgather", 262144, 8, 1, "full")
    tp = by["70B FSDP 32, TP 8 2D"]
    assert (tp.tp, tp.sequence_parallel, tp.zero, tp.micro_batch, tp.overlap) == (8, True, 3, 16, False)
    sc = score_table(cases)
    assert sc.fit_agrees == 1.0 and sc.median <= 0.10 and sc.p90 <= 0.25 and sc.spearman_mfu >= 0.6, sc.errors
    mem = {c.label: predict(c.layout).memory_gib["total"] / c.memory_gib - 1 for c in cases}
    off = {k: v for k, v in mem.items() if abs(v) > 0.10}
    assert list(off) == [next(c.label for c in cases if c.layout is inter)] and 0.10 < off[list(off)[0]] < 0.12, mem


@pytest.mark.parametrize("m,pp,v", [(8, 8, 2), (16, 4, 3), (32, 16, 8), (16, 16, 8), (12, 4, 2), (4, 4, 2), (48, 8, 4)])
def test_interleaved_holdings_are_torchs_own_schedule(m, pp, v):
    """``memory.held`` against the actions torch's ``ScheduleInterleaved1F1B`` orders on each rank:
    for any bytes a stage's micro-batch keeps, the peak over torch's schedule is the peak over the
    counts ``held`` keeps (the last rank holds one micro-batch of its last stage, not half its total)."""
    import random

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from hpcml.plan.memory import held

    sched = object.__new__(ScheduleInterleaved1F1B)  # its op order only: no stages, no process group
    sched.n_local_stages, sched.pp_group_size, sched._n_microbatches = v, pp, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    rng = random.Random(m * 1000 + pp * 10 + v)
    for rank in range(pp):
        counts, seen = [0] * v, []
        for a in sched._calculate_single_rank_operations(rank):
            if a is None:
                continue
            j = a.stage_index // pp
            if a.computation_type == _ComputationType.FORWARD:
                counts[j] += 1
                seen.append(tuple(counts))
            else:
                counts[j] -= 1
        assert min(min(c) for c in seen) >= 0
        peaks = held(m, pp, v, rank, "interleaved1f1b")
        assert set(peaks) <= set(seen)  # every count it keeps happens
        for _ in range(20):
            w = [rng.choice((0.0, 1.0, rng.random(), 10 * rng.random())) for _ in range(v)]
            assert max(sum(n * x for n, x in zip(p, w)) for p in peaks) == pytest.approx(
                max(sum(n * x for n, x in zip(p, w)) for p in seen))
    assert held(8, 8, 2, 7, "interleaved1f1b") == ((8, 1),)  # torchtitan's 405B row's last rank


def test_a_device_no_measured_run_fits_is_said_to_be_estimated(capsys):
    """MI250X (Frontier's GCD) has no published table fitted: its times are the planner's default
    constants, and the command says so in one line on stderr (the answer stays on stdout)."""
    from hpcml.cli import main as cli
    from hpcml.plan.devices import device

    assert calibration.unfitted(device("h100-80gb")) is None and calibration.unfitted(device("a100-40gb")) is None
    note = calibration.unfitted(device("mi250x-gcd"))
    assert "amd-mi250x" in note and "unverified" in note and "hpcml plan calibrate" in note
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--fsdp",
            "--recompute", "full", "--json"]
    assert cli([*args, "--gpu", "mi250x-gcd"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["fits"] and err.strip() == f"hpcml plan: note: {note}"
    assert cli([*args, "--gpu", "h100-80gb"]) == 0
    assert capsys.readouterr().err == ""


def test_torchtitan_async_tp_table_held_out_and_what_it_shows():
    """torchtitan's June 2025 async-TP pairs (held out; the rowwise Float8 rows left out, as its
    source calls their baseline a defect): read as published, every run predicted to fit, ranked
    right (Spearman of MFU >= 0.6), but not within the error bars -- held to what it is, so that a
    change shows: vanilla TP predicted 5-21% fast, and async TP's gain over it larger than measured
    on every pair (the Megatron-fitted ``tp_overlap`` hides 0.8 of the traffic; torch's async TP
    gains 9-16%, about half that)."""
    fitted = {t for ts in (*CALIBRATION.values(), *STAGED_CALIBRATION.values(), *DEVICE_CALIBRATION.values(),
                           *MEMORY_CALIBRATION.values()) for t in ts}
    assert "torchtitan-h100-async-tp" not in fitted
    cases = TABLES["torchtitan-h100-async-tp"]()
    assert [c.tokens_per_gpu for c in cases] == [597.3, 652.4, 809.8, 942.4, 4378, 4809.4, 5078.1, 5570.1]
    assert [c.layout.overlap for c in cases] == [False, True] * 4
    assert {(c.layout.tp, c.layout.dp, c.layout.compile, c.layout.sequence_parallel) for c in cases} == {
        (8, 32, True, True), (8, 8, True, True)}
    sc = score_table(cases)
    assert sc.fit_agrees == 1.0 and sc.spearman_mfu >= 0.6, sc.errors
    vanilla, asynchronous = sc.errors[::2], sc.errors[1::2]
    assert all(0.05 < e < 0.21 for e in vanilla), vanilla
    for v, a, (x, y) in zip(vanilla, asynchronous, zip(cases[::2], cases[1::2])):
        measured = y.tokens_per_gpu / x.tokens_per_gpu
        assert (1 + a) / (1 + v) * measured > measured + 0.05  # predicted gain above the measured one


def test_a_refused_layout_has_no_rate_in_json(capsys):
    """A layout the model's plan refuses is not timed: its JSON gives null for the step, the rate and
    the MFU (0.0 read as a measured-looking figure), and the command exits 1."""
    from hpcml.cli import main as cli

    assert cli(["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu", "h100-80gb", "--seq-len", "8192",
                "--global-batch", "64", "--pp", "64", "--micro-batch", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and "refuses" in out["why"]
    assert (out["step_s"], out["tokens_per_s"], out["mfu"], out["hfu"], out["memory_gib"]) == (None, None, None,
                                                                                                 None, {})
