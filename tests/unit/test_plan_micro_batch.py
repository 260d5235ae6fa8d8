"""``hpcml plan`` with some degrees given and no ``--micro-batch``: the micro-batch a search
would take for them (the fastest that fits), not micro-batch 1 -- which predicted, and
``--emit`` ran, a tiny model on tp 2 at 8 micro-steps a step (7x the predicted step time)."""

from __future__ import annotations

import json
import shlex

import pytest

from hpcml.cli import main as cli
from hpcml.plan import PlanLayout, predict
from hpcml.plan.search import fastest_micro_batch, search

TINY = ["--model", "tiny", "--gpus", "2", "--gpu", "a100-80gb", "--gpus-per-node", "1", "--seq-len", "32",
        "--global-batch", "8", "--precision", "fp32"]


def _plan(capsys, *args: str) -> tuple[int, str]:
    rc = cli(["plan", *args])
    return rc, capsys.readouterr().out.strip()


def test_a_layout_without_a_micro_batch_takes_the_fastest_that_fits(capsys):
    rc, out = _plan(capsys, *TINY, "--tp", "2", "--json")
    got = json.loads(out)
    assert rc == 0 and got["micro_batch_chosen"] is True and got["layout"]["micro_batch"] == 8
    at = {mb: predict(PlanLayout(model="tiny", gpus=2, gpu="a100-80gb", gpus_per_node=1, seq_len=32, global_batch=8,
                                 precision="fp32", tp=2, micro_batch=mb)) for mb in (1, 2, 4, 8)}
    assert at[8].tokens_per_s == max(p.tokens_per_s for p in at.values())
    assert got["tokens_per_s"] == pytest.approx(at[8].tokens_per_s, rel=1e-5)  # the JSON rounds
    assert at[1].step_s > 5 * at[8].step_s  # what the default of 1 predicted, and ran
    # the search's best tp 2 layout (tp inside a node: a node of 8) is the same micro-batch
    best = search(PlanLayout(model="tiny", gpus=2, gpu="a100-80gb", seq_len=32, global_batch=8,
                             precision="fp32", degrees_checked=False), top=50).best
    assert next(p for p in best if p.layout.tp == 2 and p.layout.zero == 0
                and p.layout.recompute == "none" and not p.layout.sequence_parallel).layout.micro_batch == 8
    rc, text = _plan(capsys, *TINY, "--tp", "2")
    assert rc == 0 and " mb 8 " in text \
        and text.endswith("(micro-batch 8: the fastest that fits; --micro-batch sets it)")
    rc, args = _plan(capsys, *TINY, "--tp", "2", "--emit", "args")
    line = shlex.split(args)
    assert rc == 0 and line[line.index("--micro-batch") + 1] == "8"


def test_a_given_micro_batch_is_kept_and_a_pipeline_keeps_its_micro_steps(capsys):
    rc, out = _plan(capsys, *TINY, "--tp", "2", "--micro-batch", "1", "--json")
    got = json.loads(out)
    assert rc == 0 and got["micro_batch_chosen"] is False and got["layout"]["micro_batch"] == 1
    piped = fastest_micro_batch(PlanLayout(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=4096, global_batch=16,
                                           pp=4, tp=2))
    assert piped.global_batch // (piped.dp * piped.micro_batch) >= piped.pp  # >= pp micro-batches in flight
    assert predict(piped).fits


def test_when_no_micro_batch_fits_the_answer_is_at_1_and_says_so(capsys):
    rc, text = _plan(capsys, "--model", "llama3-70b", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", "8192",
                     "--global-batch", "8", "--tp", "8")
    assert rc == 1 and " mb 1 " in text and "OOM" in text and text.endswith("(no micro-batch fits: shown at 1)")


def test_a_search_lists_a_layout_once_whatever_zero_stage_prices_it_the_same():
    """Under a pipeline ZeRO-2 and ZeRO-3 gather once a step alike: the same layout at either is
    priced the same, and a search lists it once (a newcomer saw two of five rows repeat)."""
    from dataclasses import replace as _replace

    from hpcml.plan.candidate import PlanLayout
    from hpcml.plan.predict import predict
    from hpcml.plan.search import search

    base = PlanLayout(model="llama3-70b", gpus=256, gpu="h100-80gb", seq_len=8192, global_batch=1024)
    best = search(base, headroom=0.1, top=10).best  # (its 8th: tp 2 cp 4 pp 16 at ZeRO-2)
    keys = [(p.layout.tp, p.layout.cp, p.layout.pp, p.layout.micro_batch, p.layout.recompute,
             p.layout.sequence_parallel, p.step_s) for p in best]
    assert len(best) == 10 and len(set(keys)) == 10
    piped = [p for p in best if p.layout.pp > 1 and p.layout.zero == 2]
    assert piped  # the twin exists and is priced alike: without the rule it would be listed too
    twin = predict(_replace(piped[0].layout, zero=3))
    assert twin.fits and twin.step_s == piped[0].step_s and twin.memory_gib == piped[0].memory_gib


def test_a_layouts_line_is_priced_as_written_and_its_answer_names_it(tmp_path, capsys):
    """Without ``micro_batch`` a line is priced at 1 (the command line would pick the fastest that
    fits); each answer names its line and its layout, blank lines counted, a measured step compared."""
    from hpcml.cli import main as cli

    f = tmp_path / "sweep.jsonl"
    f.write_text('{"tp": 2}\n\n{"tp": 2, "micro_batch": 4, "step_s": 0.5}\n{"tp": 3}\n')
    rc = cli(["plan", "--model", "mini", "--gpus", "4", "--gpu", "a100-80gb", "--seq-len", "128", "--global-batch",
              "16", "--layouts", str(f)])
    out = capsys.readouterr().out.splitlines()
    assert rc == 1 and len(out) == 3  # line 4 is not a layout: exit 1, the others still answered
    assert out[0].startswith("line 1: tp 2 cp 1 pp 1 dp 2 zero 0 mb 1 recompute none: fits ")
    assert out[1].startswith("line 3: tp 2 cp 1 pp 1 dp 2 zero 0 mb 4 recompute none: fits ")
    assert "(measured 0.5 s: " in out[1]
    assert out[2] == "line 4: gpus 4 is not divisible by tp 3 x cp 1 x pp 1 = 3"
