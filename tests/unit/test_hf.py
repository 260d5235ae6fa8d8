"""Hugging Face Llama out of and into the Transformer, one process: logits equal transformers'
(fp32, 1e-5) for plain, fused, grouped-query and tied models; what is untrusted is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hpcml import ckpt  # noqa: E402
from hpcml.errors import CheckpointError, ConfigError  # noqa: E402
from hpcml.models.transformer import Transformer, TransformerConfig  # noqa: E402
from hpcml.interop import hf  # noqa: E402
from hpcml.models.transformer.parallelize import TransformerPlan  # noqa: E402
from tests.hf_reference import hf_logits, make_llama, randomise  # noqa: E402

TOL = 1e-5
BASE = dict(vocab_size=250, dim=64, n_layers=2, n_heads=4, max_seq_len=64, rope_theta=500.0, norm_eps=1e-6)
MODELS = {"plain": {}, "fused": {"fused_qkv": True, "fused_mlp": True, "n_kv_heads": 2},
          "gqa": {"n_kv_heads": 1, "ffn_hidden": 96}, "tied": {"tie_embeddings": True, "n_kv_heads": 2}}
TOKENS = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(1))


def saved(tmp_path: Path, cfg: TransformerConfig, extra: dict | None = None) -> tuple[Transformer, Path]:
    """A randomised Transformer of ``cfg`` and its checkpoint, as the Trainer writes one (model part)."""
    model = Transformer(cfg)
    randomise(model.parameters())
    extra = {"model": cfg.describe()} if extra is None else extra
    res = ckpt.save(tmp_path / "ck", 7, ckpt.training_tensors(model.named_parameters(), None), extra=extra,
                    tensor_attrs=TransformerPlan(cfg).tensor_attrs())
    return model, res.path


def logits(model: Transformer, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[..., :model.config.vocab_size]


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= TOL
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("kind", MODELS)
def test_export_loads_in_transformers_with_equal_logits(tmp_path, kind):
    model, path = saved(tmp_path, TransformerConfig(**BASE, **MODELS[kind]))
    out = hf.export_hf(path, tmp_path / "hf")
    assert out["files"] == ["model.safetensors"]
    assert_close(hf_logits(tmp_path / "hf", TOKENS), logits(model))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is (kind == "tied") and config["torch_dtype"] == "float32"
    assert (config["vocab_size"], config["num_key_value_heads"], config["rope_theta"]) == (
        250, model.config.kv_heads, 500.0)


@pytest.mark.parametrize("kind", MODELS)
def test_import_gives_transformers_logits(tmp_path, kind):
    m = MODELS[kind]
    src = make_llama(tmp_path / "hf", kv_heads=m.get("n_kv_heads", 4), tied=m.get("tie_embeddings", False))
    assert hf.config_from_hf(src).padded_vocab == 250  # by default no padding: HF's softmax
    cfg = hf.config_from_hf(src, fused_qkv=m.get("fused_qkv", False), fused_mlp=m.get("fused_mlp", False),
                            vocab_multiple=64)
    model = Transformer(cfg)
    report = hf.load_hf_into(model, src)
    assert report.bytes_read == report.hf_bytes  # one process reads everything exactly once
    assert_close(logits(model), hf_logits(src, TOKENS))
    assert model.tok_embeddings.weight[250:].abs().max() == 0  # padded vocabulary: zeros


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def test_llama3_rope_scaling_both_ways_gives_transformers_logits(tmp_path):
    """Llama 3.1's rope scaling (what every torchtitan Llama 3 uses): head_dim 16 and theta 500
    put the 8 frequencies in all three bands (wavelengths 6 to 1147 against 8 and 32). Imported:
    transformers' logits; a model without the scaling is refused, not loaded 1e-3 off; exported:
    transformers reads the scaling back and gives hpcml's logits."""
    from dataclasses import replace

    src = make_llama(tmp_path / "hf", rope=LLAMA3, theta=500.0)
    cfg = hf.config_from_hf(src)
    assert (cfg.rope_scaling, cfg.rope_llama3, cfg.rope_theta) == ("llama3", (4.0, 1.0, 4.0, 32), 500.0)
    model = Transformer(cfg)
    hf.load_hf_into(model, src)
    tokens = torch.randint(0, 250, (2, 60), generator=torch.Generator().manual_seed(2))
    assert_close(logits(model, tokens), hf_logits(src, tokens))
    plain = Transformer(replace(cfg, rope_scaling="none"))
    with pytest.raises(ConfigError, match=r"does not fit the model \(model vs HF\): rope_llama3 None vs "
                                          r"\(4.0, 1.0, 4.0, 32\)$"):
        hf.load_hf_into(plain, src)
    assert not torch.allclose(plain.rope_cos, model.rope_cos)  # the scaling changes the function
    ours, path = saved(tmp_path / "ours", cfg)
    hf.export_hf(path, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_parameters"] == {**LLAMA3, "rope_theta": 500.0}
    assert_close(hf_logits(tmp_path / "back", tokens), logits(ours, tokens))
    # the legacy spelling (transformers 4.x: rope_theta + rope_scaling) reads the same
    c = json.loads((src / "config.json").read_text())
    del c["rope_parameters"]
    (src / "config.json").write_text(json.dumps({**c, "rope_theta": 500.0, "rope_scaling": LLAMA3}))
    assert hf.config_from_hf(src) == cfg


@pytest.mark.parametrize("fused", [False, True])
def test_qwen2_attention_biases_both_ways_give_transformers_logits(tmp_path, fused):
    """Qwen2 is Llama with biases on q, k and v (not o): imported, plain or fused, the logits
    are transformers' (the q/k bias rows take the rotary permutation as the weight rows do);
    exported, transformers builds a Qwen2ForCausalLM with hpcml's logits. torchtitan's Llama
    has no biases: refused in one line."""
    from hpcml.interop import torchtitan

    src = make_llama(tmp_path / "qwen", kv_heads=2, qwen2=True, tied=True, sliding_window=4096)
    cfg = hf.config_from_hf(src, fused_qkv=fused)
    assert cfg.qkv_bias and cfg.tie_embeddings  # the window size is written but unused (use_sliding_window false)
    model = Transformer(cfg)
    report = hf.load_hf_into(model, src)
    assert report.bytes_read == report.hf_bytes
    assert_close(logits(model), hf_logits(src, TOKENS))
    assert model.layers["0"].attention.state_dict()["wqkv.bias" if fused else "wq.bias"].abs().min() > 0.5
    ours, path = saved(tmp_path / "ours", cfg)
    hf.export_hf(path, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["model_type"], back["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])
    assert_close(hf_logits(tmp_path / "back", TOKENS), logits(ours))
    with pytest.raises(ConfigError, match=r"^a model with q, k, v biases \(qkv_bias, Qwen2's attention\): "
                                          r"torchtitan's Llama has no biases"):
        torchtitan.param_maps(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_tied_hf_model_loads_untied(tmp_path):
    src = make_llama(tmp_path / "hf", tied=True)
    model = Transformer(hf.config_from_hf(src, tie_embeddings=False))
    hf.load_hf_into(model, src)
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    assert_close(logits(model), hf_logits(src, TOKENS))


def test_sharded_export_has_an_index_and_reads_back(tmp_path):
    model, path = saved(tmp_path, TransformerConfig(**BASE, fused_qkv=True))
    out = hf.export_hf(path, tmp_path / "hf", max_shard_bytes=100_000)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 2 and files == out["files"] and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files) and index["metadata"]["total_size"] == out["bytes"]
    assert_close(hf_logits(tmp_path / "hf", TOKENS), logits(model))
    back = Transformer(hf.config_from_hf(tmp_path / "hf"))
    hf.load_hf_into(back, tmp_path / "hf")
    assert_close(logits(back), logits(model))


def test_bf16_export(tmp_path):
    _, path = saved(tmp_path, TransformerConfig(**BASE))
    out = hf.export_hf(path, tmp_path / "hf", dtype="bfloat16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert out["bytes"] == TransformerConfig(**BASE).num_params() * 2 - 2 * 6 * 64 * 2  # no vocab padding


def test_cli_export_and_inspect_show_the_model(tmp_path, capsys):
    from hpcml.cli import main

    _, path = saved(tmp_path, TransformerConfig(**BASE))
    assert main(["ckpt", "export", str(path), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert "hf)" in capsys.readouterr().out and (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["ckpt", "inspect", str(path)]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("model: transformer ")]
    assert TransformerConfig.from_dict(json.loads(line[0].split(" ", 2)[2])) == TransformerConfig(**BASE)


def test_safetensors_export_carries_the_model_config(tmp_path):
    from safetensors import safe_open

    cfg = TransformerConfig(**BASE, **MODELS["fused"])
    _, path = saved(tmp_path, cfg)
    ckpt.tools.export(path, tmp_path / "m.safetensors")
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        model = json.loads(f.metadata()["hpcml_model"])
    assert TransformerConfig.from_dict(model["config"]) == cfg
    assert model["fused_widths"] == cfg.fused_widths and model["rope"]["pairs"] == "interleaved"


def test_config_dict_round_trip_and_refusals():
    cfg = TransformerConfig.preset("small", fused_qkv=True, n_kv_heads=4)
    assert TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    d = cfg.describe()
    assert (d["head_dim"], d["kv_heads"], d["hidden"], d["padded_vocab"], d["rope"]["pairs"]) == (64, 4, 2048, 32000,
                                                                                                 "interleaved")
    with pytest.raises(ConfigError, match=r"unknown keys \['width'\]"):
        TransformerConfig.from_dict({"width": 3})
    with pytest.raises(ConfigError, match=r"bad values dim='64' \(expected int\), fused_qkv=1 \(expected bool\)"):
        TransformerConfig.from_dict({"dim": "64", "fused_qkv": 1})
    with pytest.raises(ConfigError, match="norm_eps must be > 0"):
        TransformerConfig.from_dict({"norm_eps": 0.0})
    with pytest.raises(ConfigError, match=r"^rope_scaling 'yarn': expected 'none' or 'llama3'$"):
        TransformerConfig.from_dict({"rope_scaling": "yarn"})
    with pytest.raises(ConfigError, match=r"^llama3 rope scaling: factor 8.0, low_freq_factor 4.0, high_freq_factor "
                                          r"1.0, original max seq 8192: expected factor >= 1, 0 < low < high"):
        TransformerConfig(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)
    assert TransformerConfig(rope_factor=0.5).rope_llama3 is None  # the factors mean nothing without the scaling


def test_export_refusals(tmp_path):
    _, path = saved(tmp_path, TransformerConfig(**BASE), extra={"step": 7})
    with pytest.raises(CheckpointError, match=r"has no transformer config in extra\['model'\]"):
        hf.export_hf(path, tmp_path / "hf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        hf.export_hf(path, tmp_path / "full")
    with pytest.raises(ConfigError, match="export format 'onnx' unknown"):
        ckpt.tools.export(path, tmp_path / "o", "onnx")
    # a mixture of experts has no Llama form: one line, nothing written (issue 13)
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    _, moe = saved(moe_dir, TransformerConfig.preset("tiny-moe", n_layers=1))
    with pytest.raises(ConfigError, match=r"a mixture-of-experts model \(8 experts\) has no Hugging Face Llama form"):
        hf.export_hf(moe, tmp_path / "hf-moe")
    assert not (tmp_path / "hf-moe").exists()
    info = ckpt.tools.inspect(moe)["tensors"]["model/layers.0.feed_forward.experts.w2"]
    assert info["experts"] == 8 and info["shape"] == [8, 64, 64]


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "^config.json llama3 rope parameters lack "
                                                                "low_freq_factor$"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"^config.json rope_type 'yarn': unsupported by hpcml's Transformer \(it has 'default' and 'llama3'\)$"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 4.0}},
     r"^config.json rope parameters: rope_type 'default' with \['factor'\]: expected only rope_theta$"),
    ({"rope_scaling": "linear"}, r"^config.json rope_scaling linear: expected an object$"),
    ({"rope_theta": 1e4}, r"^config.json gives rope_theta 10000.0 \(rope_theta\), 500.0 \(rope_parameters\): "
                          r"expected one value$"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     r"rope_theta=inf: expected a positive finite number"),
    ({"attention_dropout": 0.1}, r"attention_dropout=0.1 \(no dropout\)"),
    ({"attention_bias": True}, r"attention_bias=True \(attention biases on q, k, v and o: hpcml has Qwen2's"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' \(only silu\)"),
    ({"head_dim": 32}, "head_dim 32 with hidden_size 64 and 4 heads"),
    ({"model_type": "gpt2"}, r"expected a Llama model \(model_type 'llama', LlamaForCausalLM\) or Qwen2"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 16}, r"sliding_window=16 \(sliding-window attention\)"),
    ({"vocab_size": -3}, r"vocab_size=-3: expected an integer from 1 to"),
])
def test_config_refusals(tmp_path, change, match):
    src = make_llama(tmp_path / "hf")
    c = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**c, **change}))
    with pytest.raises(ConfigError, match=match):
        hf.config_from_hf(src)


def _rewrite(src: Path, tensors: dict) -> None:
    from safetensors.torch import load_file, save_file

    save_file({**load_file(src / "model.safetensors"), **tensors}, src / "model.safetensors")


def test_untrusted_files_are_checked_before_reading(tmp_path):
    src = make_llama(tmp_path / "hf")
    cfg = hf.config_from_hf(src)
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        ({q: torch.zeros(64, 64, dtype=torch.int64)}, "has dtype 'I64'"),
        ({q: torch.zeros(60, 64)}, r"has shape \[60, 64\], the config says \[64, 64\]"),
        ({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, r"unexpected \['model.layers.0.self_attn.q_pr"),
    ]
    for tensors, match in cases:
        make_llama(tmp_path / "x")
        _rewrite(tmp_path / "x", tensors)
        with pytest.raises(CheckpointError, match=match):
            hf.load_hf_into(Transformer(cfg), tmp_path / "x")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-1000])  # truncated: the last tensor's bytes are not all there
    with pytest.raises(CheckpointError, match=r"data_offsets \[\d+, \d+\] do not hold"):
        hf.load_hf_into(Transformer(cfg), src)
    (src / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length 1099511627776 does not fit"):
        hf.load_hf_into(Transformer(cfg), src)


def test_paths_outside_the_directory_are_not_followed(tmp_path):
    src = make_llama(tmp_path / "hf")
    model = Transformer(hf.config_from_hf(src))
    index = src / "model.safetensors.index.json"
    for name in ("../model.safetensors", "/etc/passwd.safetensors", "sub/x.safetensors"):
        index.write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))
        with pytest.raises(CheckpointError, match="is not a plain"):
            hf.load_hf_into(model, src)
    (tmp_path / "elsewhere.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    (src / "link.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "link.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a file inside"):
        hf.load_hf_into(model, src)
    index.unlink()
    (src / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="only safetensors are read"):
        hf.load_hf_into(model, src)
    (src / "config.json").write_text(" " * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1048576 bytes, expected a model.s JSON"):
        hf.config_from_hf(src)


def hub_snapshot(tmp_path: Path, src: Path) -> Path:
    """``src`` laid out as the hub cache lays out a download: a snapshot of links into blobs."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    return snap


def test_a_hub_cache_snapshot_loads_but_no_link_leaves_its_repository(tmp_path):
    src = make_llama(tmp_path / "hf")
    snap = hub_snapshot(tmp_path, src)
    want = Transformer(hf.config_from_hf(src))
    hf.load_hf_into(want, src)
    got = Transformer(hf.config_from_hf(snap))
    assert hf.load_hf_into(got, snap).bytes_read > 0
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    (snap / "model.safetensors").unlink()  # a link out of the repository's blobs: refused
    (snap / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a file inside .* other than the hub cache's own"):
        hf.load_hf_into(got, snap)
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(src / "config.json")
    with pytest.raises(CheckpointError, match="config.json: not a file inside"):
        hf.config_from_hf(snap)


def test_model_that_does_not_fit_is_refused(tmp_path):
    src = make_llama(tmp_path / "hf")
    with pytest.raises(ConfigError, match="does not fit the model .*rope_theta 10000.0 vs 500.0"):
        hf.load_hf_into(Transformer(TransformerConfig(**{**BASE, "rope_theta": 10000.0}, n_kv_heads=2,
                                                      ffn_hidden=96)), src)


def test_importing_hpcml_loads_no_transformers_or_safetensors():
    code = ("import sys, hpcml, hpcml.ckpt.tools, hpcml.interop.hf; "
            "print([m for m in ('transformers', 'safetensors') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_rope_permutation_is_what_makes_the_logits_equal(tmp_path, monkeypatch):
    """The comparison has the power to see a wrong rotary convention (not only a wrong name)."""
    src = make_llama(tmp_path / "hf")
    monkeypatch.setattr(hf, "hf_rows", lambda rows, head_dim: rows)
    model = Transformer(hf.config_from_hf(src))
    hf.load_hf_into(model, src)
    assert (logits(model) - hf_logits(src, TOKENS)).abs().max().item() > 1e-2
