"""What ``hpcml plan`` answers a newcomer: a search that tries each context parallelism its
framework runs, matmuls priced at the rank's own tokens, lines that tell layouts apart, a model
config that names its size, a misspelt key answered with the key meant, ``python -m hpcml``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcml.cli import main as cli
from hpcml.errors import ConfigError
from hpcml.plan import PlanLayout, load_model, predict
from hpcml.plan.predict import predict_lines
from hpcml.plan.search import search

ROOT = Path(__file__).resolve().parents[2]
LONG = ["plan", "--model", "llama3-70b", "--gpus", "256", "--gpu", "h100-80gb", "--seq-len", "131072",
        "--global-batch", "16", "--framework", "megatron", "--json"]


def test_a_search_tries_all_gathered_keys_and_values_where_ulysses_is_refused(capsys):
    """Llama 3 70B (8 kv heads) at 128K on 256 H100s under Megatron: Ulysses holds cp to kv heads
    over tp, so its best layouts need a deep pipeline; all-gathered keys and values take cp 16+."""
    assert cli(LONG) == 0
    both = json.loads(capsys.readouterr().out)
    assert cli(LONG + ["--cp-kind", "ulysses"]) == 0
    ulysses = json.loads(capsys.readouterr().out)
    assert all(b["layout"]["cp_kind"] == "ulysses" for b in ulysses["best"])
    best = both["best"][0]
    assert best["layout"]["cp_kind"] == "allgather" and best["layout"]["cp"] > 8
    assert best["mfu"] > 1.05 * ulysses["best"][0]["mfu"]  # it was never tried before
    assert both["candidates"] > 1.5 * ulysses["candidates"]
    # DeepSpeed runs Ulysses alone: a search under it never answers with the other kind
    base = PlanLayout(model="llama3-70b", gpus=64, gpu="h100-80gb", seq_len=32768, global_batch=16,
                      framework="deepspeed", degrees_checked=False)
    r = search(base, top=20, cp_kinds=("ulysses", "allgather"))
    assert r.best and {p.layout.cp_kind for p in r.best} == {"ulysses"}


def test_matmuls_are_priced_at_the_ranks_own_tokens():
    """cp 128 of 8K tokens leaves a rank 64 rows a matmul: priced as such. It was priced at the
    efficiency of the whole sequence's 8,192 rows, the same compute at every cp (5.34 s, 40.6% MFU
    for Llama 3 405B at cp 128); a 64-row matmul runs at 64 / (64 + m_half 256) of a long one's."""
    kw = dict(model="llama3-405b", gpus=16384, gpu="h100-80gb", seq_len=8192, global_batch=2048, tp=1, pp=64,
              zero=2, micro_batch=1, cp_kind="allgather", grad_sync="step")
    thin, wide = predict(PlanLayout(cp=128, **kw)), predict(PlanLayout(cp=8, **kw))
    assert 2.5 < thin.parts_s["compute"] / wide.parts_s["compute"] < 4.0  # the linear layers' 4x, attention's 1x
    assert thin.fits and thin.mfu < 0.15


def test_search_lines_tell_layouts_apart(capsys):
    """The same degrees priced twice (gradients reduced each micro-batch or once a step) read as two layouts."""
    assert cli(["plan", "--model", "llama2-7b", "--gpus", "64", "--gpu", "h100-80gb", "--seq-len", "32768",
                "--global-batch", "64", "--top", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    shapes = [line.split(":")[0] for line in lines]
    assert len(lines) == 8 and len(set(shapes)) == 8, lines
    assert any("grad-sync step" in s for s in shapes)
    assert cli(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-80gb", "--seq-len", "8192",
                "--global-batch", "128", "--framework", "megatron", "--tp", "4", "--pp", "4", "--cp", "2",
                "--schedule", "interleaved1f1b", "--stages-per-rank", "5", "--sequence-parallel", "--zero", "1",
                "--micro-batch", "1", "--precision", "fp8"]) == 0
    line = capsys.readouterr().out
    assert "interleaved1f1b x5" in line and "precision fp8" in line and "of the bf16 peak" in line


def test_a_model_config_names_its_size(tmp_path, capsys):
    empty = tmp_path / "cfg.json"
    empty.write_text("{}")
    with pytest.raises(ConfigError, match="without vocab_size, dim, n_layers, n_heads: expected the model's size"):
        load_model(str(empty))
    assert cli(["plan", "--model", str(empty), "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "4096",
                "--global-batch", "64", "--fsdp"]) == 2
    assert "cfg.json: a model config without vocab_size" in capsys.readouterr().err
    out = predict_lines(['{"model": {"dim": 4096}, "gpus": 8}', '{"tpp": 2}', '{"zerro": 3, "mb": 2}'],
                        {"model": "llama3-8b", "gpu": "h100-80gb", "seq_len": 4096, "global_batch": 8})
    assert "model: a model config without vocab_size, n_layers, n_heads" in out[0]["error"]
    assert "did you mean ['tp']?" in out[1]["error"]
    assert "did you mean ['zero']?" in out[2]["error"] and "'mb'" in out[2]["error"]


def test_python_dash_m_hpcml_is_the_command():
    r = subprocess.run([sys.executable, "-m", "hpcml", "plan", "--model", "llama3-8b", "--gpus", "8", "--gpu",
                        "h100-80gb", "--seq-len", "8192", "--global-batch", "16", "--fsdp", "--recompute", "full",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layout"]["zero"] == 3
