"""``hpcml plan --pop K`` (issue 45): a member planned on its share of the devices, and the
exchanges between members priced from the member's own state and the device's links."""

from __future__ import annotations

import json

import pytest

from hpcml.cli import main
from hpcml.errors import ConfigError
from hpcml.plan.devices import DEVICES, GIB
from hpcml.plan.population import member_gpus, price

BASE = ["plan", "--model", "llama-7b", "--gpu", "h100-80gb", "--seq-len", "4096", "--global-batch", "64"]


def test_a_member_is_planned_on_its_share_and_its_exchange_priced_from_its_state(capsys):
    assert main([*BASE, "--gpus", "64", "--tp", "8", "--fsdp", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*BASE, "--gpus", "256", "--pop", "4", "--tp", "8", "--fsdp", "--exchange-every", "200", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["layout"] == alone["layout"] and got["step_s"] == alone["step_s"]  # a member is the 64-GPU run
    pop = got["population"]
    state = alone["memory_gib"]["params"] + alone["memory_gib"]["optimizer"]
    dev = DEVICES["h100-80gb"]
    assert pop["members"] == 4 and pop["gpus_per_member"] == 64
    assert pop["exchange_gib_per_rank"] == pytest.approx(state, abs=2e-3)
    assert pop["exchange_s"] == pytest.approx(state * GIB / (dev.inter_gbps * 1e9), rel=1e-3)
    assert pop["evaluate_s"] == pytest.approx(2 * alone["step_s"] / 3, rel=1e-3)
    assert pop["overhead"] == pytest.approx((pop["exchange_s"] + pop["evaluate_s"]) / (200 * alone["step_s"]), rel=1e-3)


def test_the_text_says_what_an_exchange_costs(capsys):
    assert main([*BASE, "--gpus", "64", "--pop", "4", "--tp", "8", "--fsdp", "--exchange-every", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("population: 4 members of 16 devices; an exchange moves ")
    assert "every 100 steps that adds" in lines[1]


def test_price_is_exact():
    dev = DEVICES["h100-80gb"]
    p = price({"params": 1.0, "optimizer": 3.0, "activations": 9.0}, 2.0, dev, members=2, gpus_per_member=8,
              every=10, val_batches=3)
    assert p.exchange_gib_per_rank == 4.0 and p.exchange_s == 4.0 * GIB / (dev.inter_gbps * 1e9)
    assert p.evaluate_s == 2 * 3 * 2.0 / 3 and p.overhead == (p.exchange_s + p.evaluate_s) / 20.0


@pytest.mark.parametrize("args,message", [
    (["--gpus", "64", "--pop", "3"], "--pop 3 does not divide --gpus 64: every member needs as many devices"),
    (["--gpus", "64", "--pop", "0"], "--pop 0: expected a positive whole number of population members"),
    (["--gpus", "64", "--exchange-every", "10"], "--exchange-every prices a population's exchanges: give --pop too"),
    (["--gpus", "64", "--pop", "2", "--tp", "8", "--exchange-every", "0"],
     "--exchange-every 0: expected a whole number of steps >= 1"),
    (["--gpus", "64", "--pop", "2", "--layouts", "x"], "--pop 2 plans one member's layout and prices the exchanges: "
     "not with --layouts (plan the member on --gpus / POP devices)"),
])
def test_population_mistakes_are_one_line(capsys, args, message):
    assert main([*BASE, *args]) == 2
    assert capsys.readouterr().err.strip() == f"hpcml: error: {message}"


def test_member_gpus():
    assert member_gpus(64, 4) == 16
    with pytest.raises(ConfigError):
        member_gpus(64, True)


def test_a_population_is_emitted_as_one_job_of_every_members_ranks(capsys, monkeypatch):
    """``--pop K --emit``: the member's layout as llm_pretrain.py arguments with ``--pop K`` and
    the tournaments; ``--emit job``: one job of K x the member's devices, resumed member by member."""
    import shlex
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.delenv("HPCML_ACCOUNT", raising=False)
    base = ["plan", "--model", "llama3-8b", "--gpus", "32", "--site", "polaris", "--seq-len", "4096",
            "--global-batch", "64", "--pop", "2", "--exchange-every", "200"]
    assert main([*base, "--emit", "args"]) == 0
    run = shlex.split(capsys.readouterr().out.strip())
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--site", "polaris", "--seq-len", "4096",
                 "--global-batch", "64", "--emit", "args"]) == 0
    alone = shlex.split(capsys.readouterr().out.strip())
    assert run == [*alone, "--pop", "2", "--tournament-every", "200"]  # a member is the 16-GPU run
    assert main([*base, "--emit", "job", "--steps", "1000", "--account", "P"]) == 0
    line = shlex.split(capsys.readouterr().out.strip())
    cut = line.index("--")
    job = line[:cut]
    assert (job[job.index("--ranks") + 1], job[job.index("--nodes") + 1]) == ("32", "8")  # 4 GPUs a Polaris node
    sys.path.insert(0, str(root / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    args = llm_pretrain.parse_args(line[cut + 3:])
    assert (args.pop, args.tournament_every, args.auto_resume, args.steps) == (2, 200, True, 1000)


def test_members_of_different_layouts_step_at_the_slowest_and_swap_through_checkpoints(capsys):
    """``--member`` once a member: each predicted as the run of its share alone; the population
    steps at the slowest member's pace; a swap writes and reads each member's whole fp32 state
    at ``--scratch-gbps`` (without it, not priced: no rate is invented)."""
    import math

    from hpcml.models.transformer import footprint as fp
    from hpcml.plan.predict import load_model

    alone = []
    for tp in (8, 4):
        assert main([*BASE, "--gpus", "32", "--tp", str(tp), "--fsdp", "--json"]) == 0
        alone.append(json.loads(capsys.readouterr().out))
    assert main([*BASE, "--gpus", "64", "--fsdp", "--pop", "2", "--member", '{"tp": 8}', "--member", '{"tp": 4}',
                 "--exchange-every", "200", "--scratch-gbps", "100", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [m["step_s"] for m in got["members"]] == [a["step_s"] for a in alone]
    assert [m["layout"] for m in got["members"]] == [a["layout"] for a in alone]
    pop = got["population"]
    slowest = max(range(2), key=lambda i: alone[i]["step_s"])
    assert pop["slowest"] == slowest and pop["step_s"] == pytest.approx(alone[slowest]["step_s"], rel=1e-4)
    shapes = fp.param_shapes(load_model("llama-7b"))
    state = sum(math.prod(s) * (4 + 8 * fp.trainable(n)) for n, s in shapes.items()) / GIB
    assert pop["checkpoint_gib"] == pytest.approx(state, rel=1e-6)
    assert pop["exchange_s"] == pytest.approx(2 * 2 * state * GIB / 100e9, rel=1e-6)
    assert pop["overhead"] == pytest.approx((pop["exchange_s"] + pop["evaluate_s"]) / (200 * pop["step_s"]), rel=1e-4)
    assert main([*BASE, "--gpus", "64", "--fsdp", "--pop", "2", "--member", '{"tp": 8}', "--member", '{"tp": 4}']) == 0
    assert "not priced: give --scratch-gbps, the job's file-system rate" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--pop", "2", "--member", '{"tp": 8}'], "--member given 1 times for --pop 2: one layout a member"),
    (["--member", '{"tp": 8}'], "--member prices a population: give --pop too"),
    (["--pop", "2", "--member", '{"tp": 8}', "--member", '{"gpus": 8}'],
     "--member 1 sets ['gpus']: a member's layout keys only (the model, the devices and their nodes are the "
     "population's: --model, --gpus / --pop)"),
    (["--pop", "2", "--member", '{"tp": 8}', "--member", "tp=4"],
     "--member 'tp=4': not JSON (Expecting value: line 1 column 1 (char 0)); expected an object such as "
     "'{\"tp\": 4}'"),
    (["--pop", "2", "--member", '{"tp": 8}', "--member", '{"tp": 4}', "--scratch-gbps", "0"],
     "--scratch-gbps 0.0: expected the file system's rate in GB/s, > 0"),
    (["--pop", "2", "--member", '{"tp": 8}', "--member", '{"tp": 4, "precision": "fp32"}', "--emit", "args"],
     "members [1] differ from member 0 in more than their layout"),
    (["--pop", "2", "--member", '{"tp": 8}', "--member", '{"tp": 1, "zero": 0}', "--emit", "args"],
     "not emitting a population whose members do not all run: member 1:"),
])
def test_member_mistakes_are_one_line(capsys, args, message):
    assert main([*BASE, "--gpus", "64", "--fsdp", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hpcml: error: {message}") and "\n" not in err


def test_members_of_different_layouts_are_emitted_as_llm_pretrain_members(capsys, monkeypatch):
    """``--pop 2 --member A --member B --emit args|job``: the shared arguments once, then each
    member's layout as the ``--member`` object llm_pretrain.py reads -- the same settings its
    flags would give for that layout alone -- in one job of both members' ranks."""
    import shlex
    import sys
    from pathlib import Path

    from hpcml.plan.emit import MEMBER_FLAGS

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    monkeypatch.delenv("HPCML_ACCOUNT", raising=False)
    pop = [*BASE, "--gpus", "64", "--pop", "2", "--member", '{"tp": 8, "zero": 3}', "--member",
           '{"tp": 2, "pp": 2, "zero": 0, "micro_batch": 2, "recompute": "full"}', "--exchange-every", "50"]
    assert main([*pop, "--emit", "args"]) == 0
    run = llm_pretrain.parse_args(shlex.split(capsys.readouterr().out.strip()))
    members = [json.loads(m) for m in run.member]
    assert run.tournament_every == 50 and len(members) == 2
    for i, member in enumerate(members):  # each member's object is what its layout's own flags would set
        one = [*BASE, "--gpus", "32", *(["--tp", "8", "--fsdp"] if i == 0 else
                                         ["--tp", "2", "--pp", "2", "--micro-batch", "2", "--recompute", "full"])]
        assert main([*one, "--emit", "args"]) == 0
        alone = shlex.split(capsys.readouterr().out.strip())
        flags = llm_pretrain.parse_args(alone)
        assert {k: getattr(flags, k) for k in ("tp", "pp", "cp", "micro_batch", "fsdp", "activation_checkpointing")} \
            == {"tp": member["tp"], "pp": member["pp"], "cp": member["cp"], "micro_batch": member["micro_batch"],
                "fsdp": member.get("fsdp", False), "activation_checkpointing": member.get("activation_checkpointing",
                                                                                          False)}
        assert flags.zero2 == (member.get("reshard_after_forward") is False)
        assert flags.schedule == member.get("pp_schedule", flags.schedule)
        shared = [a for j, a in enumerate(alone) if a not in MEMBER_FLAGS and alone[j - 1] not in MEMBER_FLAGS]
        assert all(x in shlex.split(shlex.join(shared)) for x in ("--model", "llama-7b", "--global-batch", "64"))
    assert main([*pop, "--emit", "job", "--site", "polaris", "--steps", "100", "--account", "P"]) == 0
    line = shlex.split(capsys.readouterr().out.strip())
    cut = line.index("--")
    assert line[line.index("--ranks") + 1] == "64"
    again = llm_pretrain.parse_args(line[cut + 3:])
    assert [json.loads(m) for m in again.member] == members and again.auto_resume and again.steps == 100


@pytest.mark.parametrize("argv,message", [
    (["--member", '{"tp": 2}'], "--member gives one member's layout of a population: give it once a member"),
    (["--member", '{"tp": 2}', "--member", '{"dp": 2}', "--pop", "3"], "--member given 2 times for --pop 3"),
    (["--member", '{"tp": 2}', "--member", '{"dp": 2}', "--tp", "2"], "--member sets each member's layout: not "
                                                                      "with --tp"),
    (["--member", '{"tp": 2}', "--member", "tp=2"], "--member 'tp=2': not JSON"),
    (["--member", '{"tp": 2}', "--member", "[2]"], "--member 1 '[2]': expected a JSON object"),
    (["--pop-scratch", "x"], "--pop-scratch is where a population's members exchange models"),
])
def test_llm_pretrain_member_mistakes_are_one_line(argv, message):
    """``llm_pretrain.py --member``'s own mistakes, refused before any rank builds anything."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    args = llm_pretrain.parse_args(argv)
    degrees = {"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep}
    with pytest.raises(ConfigError) as e:
        llm_pretrain.population_members(args, degrees)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_member_configs_check_every_members_plan_before_any_collective():
    """``member_configs``: each entry's degrees, ParallelConfig fields and micro-batch; a member
    that cannot run is named, whichever rank reads it."""
    from hpcml.models.transformer import TransformerConfig
    from hpcml.parallel import ParallelConfig
    from hpcml.train import TrainConfig
    from hpcml.train.recipe import member_configs

    model = TransformerConfig.preset("tiny")
    train = TrainConfig(steps=2, global_batch=4, micro_batch=1, seq_len=32, progress=False)
    got = member_configs([{"tp": 2}, {"dp": 2, "fsdp": True, "micro_batch": 2}], model, train, ParallelConfig(), 4)
    assert [c.layout.degrees for c in got] == [{"pp": 1, "dp": 1, "cp": 1, "tp": 2}, {"pp": 1, "dp": 2, "cp": 1,
                                                                                      "tp": 1}]
    assert [c.parallel.fsdp for c in got] == [False, True] and [c.train.micro_batch for c in got] == [1, 2]
    for members, message in (
            ([{"tp": 2}, {"tp": 3}], r"^member 1 \({'tp': 3}\): "),
            ([{"tp": 2}, {"dp": 2, "micro_batch": 3}], r"^member 1 .*global batch 4 is not divisible by dp 2 x "
                                                         r"micro-batch 3"),
            ([{"tp": 2}, {"tp": 2, "zero": 3}], r"^member 1 .*unknown keys \['zero'\]: expected degrees"),
            ([{"tp": 2}, {"dp": 2}, {"dp": 1}], r"^3 members do not split 4 ranks evenly"),
            ([{"tp": 2}, "dp=2"], r"^member 1: 'dp=2' is not a mapping")):
        with pytest.raises(ConfigError, match=message):
            member_configs(members, model, train, ParallelConfig(), 4)
