"""``hpcml.plan``: the model's footprint against the real module, the layout rules, the
predictions against published measured runs, the search, ``--emit`` and the command line.
(The per-rank exactness under real parallelism is tests/mpi/test_plan_exact.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcml.cli import main as cli
from hpcml.errors import ConfigError
from hpcml.models.transformer import footprint as fp
from hpcml.models.transformer.model import Transformer, TransformerConfig, cross_entropy
from hpcml.models.transformer.presets import PRESETS
from hpcml.plan import PlanLayout, load_model, predict
from hpcml.plan.placement import rank_elements, rank_state
from hpcml.plan.published import CALIBRATION, TABLES
from hpcml.plan.emit import emit, member_entry
from hpcml.plan.search import candidates, search
from hpcml.train.memory import SavedBytes

ROOT = Path(__file__).resolve().parents[2]
TINY = PRESETS["tiny"]


def _variants() -> dict[str, TransformerConfig]:
    out = {n: dataclasses.replace(c, n_layers=min(c.n_layers, 2)) if c.num_params() > 2e10 else c
           for n, c in PRESETS.items()}
    out["fused+bias"] = dataclasses.replace(TINY, fused_qkv=True, fused_mlp=True, qkv_bias=True)
    out["tied"] = dataclasses.replace(TINY, tie_embeddings=True)
    out["gpt"] = dataclasses.replace(TINY, activation="gelu", norm="layernorm", bias=True, ffn_hidden=None)
    out["gpt-fused-qkv"] = dataclasses.replace(TINY, activation="gelu", bias=True, fused_qkv=True)
    out["mpt"] = dataclasses.replace(TINY, activation="gelu", norm="layernorm", bias=True, positions="learned",
                                     tie_embeddings=True)
    out["moe-bias-shared"] = dataclasses.replace(PRESETS["tiny-moe"], moe_balance="bias", moe_shared_hidden=32,
                                                 moe_every=2, fused_mlp=True)
    return out


@pytest.mark.parametrize("name,cfg", list(_variants().items()), ids=list(_variants()))
def test_param_shapes_are_the_modules(name, cfg):
    with torch.device("meta"):
        model = Transformer(cfg)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert list(fp.param_shapes(cfg).items()) == real  # names, shapes and order
    assert sum(math.prod(s) for _, s in real) == cfg.num_params()
    for n, _ in real:
        fp.shard_dims(n)  # every parameter has a rule


def _saved_bytes(cfg: TransformerConfig, b: int, s: int, checkpointing: bool, fpdt: int = 0) -> int:
    torch.manual_seed(0)
    model = Transformer(cfg)
    for block in model.layers.values():
        block.activation_checkpointing = checkpointing
    if fpdt:
        model.parallel_plan().apply_fpdt(model, None, 0, 1, fpdt)
    account = SavedBytes({}, [model])
    x = torch.randint(0, cfg.vocab_size, (b, s + 1))
    with account:
        if fpdt:
            model(x[:, :-1], targets=x[:, 1:])
        else:
            cross_entropy(model(x[:, :-1]), x[:, 1:])
    return sum(account.take()[0].values())


@pytest.mark.parametrize("blocks", [{}, {"activation": "gelu", "norm": "layernorm", "bias": True},
                                    {"activation": "gelu", "norm": "layernorm", "bias": True, "positions": "learned"}],
                         ids=["llama", "gpt", "mpt"])
@pytest.mark.parametrize("shape", [(64, 4, 4, 128, 2, 256), (96, 6, 2, 200, 3, 1000)], ids=["mha", "gqa"])
@pytest.mark.parametrize("mode", ["none", "full", "fpdt"])
def test_layer_saved_is_what_autograd_keeps(shape, mode, blocks):
    dim, heads, kv, hidden, layers, vocab = shape
    cfg = TransformerConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                            ffn_hidden=hidden, max_seq_len=64, **blocks)
    b, s = 3, 32
    fpdt = mode == "fpdt"
    how = fp.Saved(recompute="full" if mode == "full" else "none", fpdt=fpdt, chunked_loss=fpdt)
    want = b * s * (sum(fp.layer_saved(cfg, i, s, how) for i in range(layers))
                    + fp.head_saved(cfg, how, first=True, last=True)) + fp.head_constant(cfg, how, last=True)
    assert _saved_bytes(cfg, b, s, mode == "full", fpdt=8 if fpdt else 0) == pytest.approx(want, rel=0.01)


@pytest.mark.parametrize("cfg", [TINY, PRESETS["tiny-moe"], dataclasses.replace(TINY, tie_embeddings=True),
                                 dataclasses.replace(PRESETS["tiny-moe"], moe_balance="bias", fused_qkv=True)],
                         ids=["tiny", "moe", "tied", "moe-bias-fused"])
def test_one_rank_states_equal_the_plan(cfg):
    """One process, one AdamW step: parameter, gradient and moment elements as planned (the
    aux-loss-free bias is a parameter without a gradient or optimizer state)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    x = torch.randint(0, cfg.vocab_size, (2, 17))
    cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    params = list(model.parameters())
    got = {"params": sum(p.numel() for p in params), "grads": sum(p.grad.numel() for p in params if p.grad is not None),
           "optimizer": sum(opt.state[p]["exp_avg"].numel() for p in params if p in opt.state),
           "tensors": sum("step" in opt.state.get(p, {}) for p in params)}
    lay = PlanLayout(model=cfg, gpus=1, gpu="a100-80gb", seq_len=16, global_batch=2, precision="fp32")
    assert got == rank_elements(cfg, lay, 0, 0)


def test_rank_state_is_the_first_shard_of_rank_elements():
    cfg = dataclasses.replace(TINY, vocab_size=250, ffn_hidden=96, n_layers=5)
    for kw in ({"zero": 3}, {"zero": 2, "tp": 2}, {"pp": 2, "zero": 0}, {"pp": 2, "schedule": "interleaved1f1b"},
               {"cp": 2, "zero": 3}):
        lay = PlanLayout(model=cfg, gpus=8, gpu="a100-80gb", seq_len=32, global_batch=16, **kw)
        for r in range(lay.pp):
            st, ex = rank_state(cfg, lay, r), rank_elements(cfg, lay, r, 0)
            assert (st.params, st.grads, st.optimizer, st.tensors) == tuple(ex.values()), kw
        # the shards of one group add up to the whole (FSDP's dim-0 chunks, uneven ones included)
        ws = lay.dp * lay.cp
        if lay.zero == 3:
            total = sum(rank_elements(cfg, lay, 0, i)["params"] for i in range(ws))
            assert total == rank_state(cfg, lay, 0).compute_params


@pytest.mark.parametrize("kw,message", [
    ({"tp": 3}, "gpus 8 is not divisible by tp 3 x cp 1 x pp 1 = 3"),
    ({"global_batch": 12}, "global_batch 12 is not divisible by dp 8 x micro_batch 1 = 8"),
    ({"zero": 4}, "zero=4: expected 0, 1, 2 or 3"),
    ({"recompute": "some"}, "recompute='some': expected one of"),
    ({"gpu": None}, "give exactly one of them"),
    ({"micro_batch": 0}, "micro_batch=0: expected an integer in [1, 2^40]"),
    ({"seq_len": 10 ** 400}, "seq_len=1000000000000000000000000000000000000000: expected an integer in [1, 2^40]"),
    ({"stages_per_rank": "2"}, "stages_per_rank='2': expected an integer"),
    ({"site": ["frontier"], "gpu": None}, "site=['frontier']: expected a name"),
    ({"pp": 2, "global_batch": 4, "micro_batch": 1, "gpus": 8}, "1 micro-batches per step < pp 2"),
    ({"cp": 2, "sequence_parallel": True}, "sequence_parallel with cp 2 > 1 is not supported"),
    ({"cp": 2, "fpdt_chunk": 3}, "fpdt_chunk 3: seq_len 4096 must be a multiple of cp 2 x fpdt_chunk, without "
                                 "sequence_parallel"),
    ({"fpdt_chunk": 64, "framework": "megatron"}, "fpdt_chunk 64 with framework megatron: FPDT is planned for hpcml"),
    ({"fpdt_chunk": -1}, "fpdt_chunk=-1: expected an integer in [0, 2^40]"),
    ({"pp": 2, "schedule": "interleaved1f1b", "global_batch": 20, "framework": "megatron"},
     "needs micro-batches (5) divisible by its rounds (2 = micro-batches // pp 2, torch's rule)"),
    ({"hpz": True, "zero": 2}, "dp_replicate 1, hpz True, qwz False, qgz False with zero 2: they shard FSDP's"),
    ({"dp_replicate": 2}, "dp_replicate 2, hpz False, qwz False, qgz False with zero 0"),
    ({"dp_replicate": 3, "zero": 3}, "dp_replicate 3 does not divide dp 8"),
    ({"dp_replicate": 2, "zero": 3, "qgz": True}, "dp_replicate 2 with hpz False, qgz True: hybrid sharding"),
    ({"qwz": 1, "zero": 3}, "qwz=1: expected true or false"),
    ({"quant_block": 0, "zero": 3}, "quant_block=0: expected an integer in [1, 2^40]"),
])
def test_layout_refused_in_one_line(kw, message):
    base = {"model": "llama3-8b", "gpus": 8, "gpu": "h100-80gb", "seq_len": 4096, "global_batch": 16}
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        PlanLayout(**{**base, **kw})
    assert "\n" not in str(e.value)


def test_from_dict_keys_and_fsdp_alias():
    lay = PlanLayout.from_dict({"fsdp": True, "tp": 2}, model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=4096,
                               global_batch=16)
    assert (lay.zero, lay.tp, lay.dp) == (3, 2, 4)
    with pytest.raises(ConfigError, match=r"layout keys \['tensor_parallel'\] unknown"):
        PlanLayout.from_dict({"tensor_parallel": 2}, model="tiny", gpus=1, gpu="h100-80gb", seq_len=8, global_batch=1)
    inline = PlanLayout.from_dict({"model": TINY.to_dict(), "gpus": 1, "gpu": "h100-80gb", "seq_len": 8,
                                   "global_batch": 1})
    assert inline.model == TINY


def test_prediction_parts_add_up_and_oom_says_why():
    p = predict(PlanLayout(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=8192, global_batch=8, zero=3,
                           recompute="full"))
    m = p.memory_gib
    assert m["total"] == pytest.approx(sum(m[k] for k in ("params", "grads", "optimizer", "activations",
                                                          "buffers")), rel=1e-9)
    assert p.fits and 0 < p.mfu < 1 and p.step_s == pytest.approx(8 * 8192 / p.tokens_per_s)
    assert p.step_s >= sum(p.parts_s.values()) - 1e-9  # the parts are what the step is made of
    # 8B on one device, no sharding: Adam alone needs 8 bytes x 8B parameters
    one = predict(PlanLayout(model="llama3-8b", gpus=1, gpu="h100-80gb", seq_len=8192, global_batch=1))
    assert not one.fits and one.memory_gib["optimizer"] == pytest.approx(8 * 8.03e9 / 2**30, rel=0.01)
    assert one.why.startswith("needs") and "the device has 79.1" in one.why
    # FSDP over 8 divides parameters, gradients and moments by 8 (to the row)
    z3 = predict(PlanLayout(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=8192, global_batch=8, zero=3))
    assert z3.memory_gib["optimizer"] == pytest.approx(one.memory_gib["optimizer"] / 8, rel=1e-3)
    refused = predict(PlanLayout(model="llama3-8b", gpus=16, gpu="h100-80gb", seq_len=8192, global_batch=16, tp=16))
    assert not refused.fits and "n_kv_heads 8 is not divisible by tp 16" in refused.why


def _errors(table: str) -> tuple[float, float, list[str]]:
    """(share of rows whose fit/OOM outcome agrees, share within 15% in tokens/s, misses)."""
    agree = close = n_tput = 0
    misses = []
    cases = TABLES[table]()
    for case in cases:
        p = predict(case.layout)
        agree += p.fits == case.fits
        if case.tokens_per_gpu and case.fits:
            n_tput += 1
            err = p.tokens_per_s / case.layout.gpus / case.tokens_per_gpu - 1
            close += abs(err) <= 0.15
            if abs(err) > 0.15:
                misses.append(f"{case.label}: {err:+.0%}")
    return agree / len(cases), close / max(1, n_tput), misses


@pytest.mark.parametrize("table", ["sc21-table1", "korthikanti-table5", "torchtitan-a100", "megatron-core-h100",
                                   "torchtitan-h100"])
def test_published_tables_are_predicted(table):
    """The issue's bar on each table: fit/OOM agrees on >= 90% of the rows, throughput (and so
    MFU under the publisher's FLOP count) within 15% on >= 80%. sc21-table1 and
    megatron-core-h100 are fitted on, torchtitan-h100 for its parts' share of their peak only;
    korthikanti-table5 and torchtitan-a100 are held out."""
    agree, close, misses = _errors(table)
    assert agree >= 0.9 and close >= 0.8, misses


def test_held_out_tables_are_not_fitted_on():
    from hpcml.plan.published import DEVICE_CALIBRATION

    fitted = {t for ts in (*CALIBRATION.values(), *DEVICE_CALIBRATION.values()) for t in ts}
    assert {"korthikanti-table5", "torchtitan-a100"}.isdisjoint(fitted)
    # the OOM rows of torchtitan's table are predicted as OOM, the others as fitting
    outcomes = [(c.fits, predict(c.layout).fits) for c in TABLES["torchtitan-a100"]()]
    assert outcomes.count((False, False)) == 2 and all(a == b for a, b in outcomes)


def test_torchtitan_h100_fits_and_memory():
    """The 500 W H100 table: every row fits as published and the peak memory, whose rows fit
    nvidia-h100's reserved constant, is within 5%. The only thing fitted on its throughput is the
    share of the SXM peak its parts run at, inside the range its source gives (NVL's 835 to SXM's
    989 TFLOPS); with the family's constants fitted with flash attention's own efficiency it
    lands at 0.92 of the SXM peak, inside that range, and the rows are predicted 2% slow and 1%
    fast there (held to that, not to the bar, so that a change moving them shows)."""
    from hpcml.plan import calibration
    from hpcml.plan.devices import device
    from hpcml.plan.published import DEVICE_CALIBRATION, MEMORY_CALIBRATION

    errors = []
    for case in TABLES["torchtitan-h100"]():
        p = predict(case.layout)
        assert p.fits and p.memory_gib["total"] == pytest.approx(case.memory_gib, rel=0.05), case.label
        errors.append(p.tokens_per_s / case.layout.gpus / case.tokens_per_gpu - 1)
    assert [round(e, 2) for e in errors] == [-0.02, 0.01], errors
    assert "torchtitan-h100" in MEMORY_CALIBRATION["nvidia-h100"]
    assert DEVICE_CALIBRATION == {"h100-96gb-500w": ["torchtitan-h100"]}
    raw = device("h100-96gb-500w")
    assert raw.sustained_range == pytest.approx((835 / 989, 1.0))
    assert calibration.calibrated(raw).sustained == pytest.approx(0.92, abs=1e-4)
    assert calibration.calibrated(device("h100-80gb")).sustained == 1.0  # a part without a range is not touched


def test_a_sustained_share_outside_its_range_is_refused():
    from dataclasses import replace

    from hpcml.plan.devices import device

    with pytest.raises(ConfigError, match=r"^device h100-96gb-500w: sustained=0\.5 must lie in sustained_range="
                                          r"\(0\.844.*, 1\.0\), within \(0, 1\]$"):
        replace(device("h100-96gb-500w"), sustained=0.5)


def test_calibration_file_is_what_the_fit_gives():
    out = subprocess.run([sys.executable, "-m", "hpcml.plan.fit", "--check"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)  # ~35 s: four starts a family, to convergence
    assert out.returncode == 0, out.stdout + out.stderr


def test_fpdt_plans_less_activation_memory_and_emits_its_flag():
    """128k positions of Llama 3 8B on 8 H100s, cp 8: FPDT keeps well under half the activations
    (no logits, a dense block's MLP its input alone), recomputes the MLP (more FLOPs), and its
    layout runs as llm_pretrain.py --fpdt-chunk."""
    base = dict(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=131072, global_batch=8, cp=8, zero=3)
    plain, fpdt = predict(PlanLayout(**base)), predict(PlanLayout(**base, fpdt_chunk=2048))
    assert fpdt.memory_gib["activations"] < 0.5 * plain.memory_gib["activations"]
    assert fpdt.memory_gib["total"] < plain.memory_gib["total"] and fpdt.step_s > plain.step_s
    assert emit(fpdt.layout)[-2:] == ["--seq-len", "131072"] and "--fpdt-chunk" in emit(fpdt.layout)
    assert emit(fpdt.layout)[emit(fpdt.layout).index("--fpdt-chunk") + 1] == "2048"


def test_a_search_given_fpdt_keeps_it_on_the_cp_degrees_it_divides():
    base = PlanLayout(model="llama3-8b", gpus=8, gpu="h100-80gb", seq_len=12288, global_batch=8, fpdt_chunk=2048,
                      degrees_checked=False)
    result = search(base, top=50)
    assert result.best and all(p.layout.fpdt_chunk == 2048 for p in result.best)
    assert {p.layout.cp for p in result.best} <= {1, 2} and all(not p.layout.sequence_parallel
                                                               for p in result.best)  # 12288 = 6 x 2048


def test_search_ranks_valid_fitting_layouts_and_emits_them():
    base = PlanLayout(model="llama3-70b", gpus=1024, site="frontier", seq_len=8192, global_batch=1024)
    r = search(base, top=3)
    assert r.candidates >= 10_000 and r.fitting > 0 and len(r.best) == 3
    assert [p.tokens_per_s for p in r.best] == sorted((p.tokens_per_s for p in r.best), reverse=True)
    assert all(p.fits and p.memory_gib["total"] <= 64.0 for p in r.best)
    # no candidate breaks the model's rules: kv heads 8 bound tp
    assert all(c.tp <= 8 for c in candidates(base, load_model("llama3-70b"), __import__(
        "hpcml.plan.devices", fromlist=["x"]).site_device("frontier")))
    sys.path.insert(0, str(ROOT / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    best = r.best[0].layout
    args = llm_pretrain.parse_args(emit(best))
    assert (args.model, args.tp, args.pp, args.cp, args.micro_batch, args.global_batch, args.seq_len) == \
        (best.model, best.tp, best.pp, best.cp, best.micro_batch, best.global_batch, best.seq_len)
    assert args.fsdp == (best.zero >= 2) and args.zero2 == (best.zero == 2)
    assert args.activation_checkpointing == (best.recompute == "full") and args.bf16
    with pytest.raises(ConfigError, match="cannot emit this layout for llm_pretrain.py: zero 1"):
        emit(dataclasses.replace(best, zero=1))
    # data parallelism across nodes: the flags the trainer takes
    fsdp = dataclasses.replace(best, zero=3, tp=1, pp=1, cp=1)
    zpp = llm_pretrain.parse_args(emit(dataclasses.replace(fsdp, hpz=True, qwz=True, qgz=True, quant_block=128)))
    assert (zpp.hpz, zpp.qwz, zpp.qgz, zpp.quant_block, zpp.dp_replicate) == (True, True, True, 128, 1)
    hsdp = llm_pretrain.parse_args(emit(dataclasses.replace(fsdp, dp_replicate=fsdp.dp)))
    assert (hsdp.dp_replicate, hsdp.hpz, hsdp.quant_block) == (fsdp.dp, False, 256)
    # a bf16 gradient reduction: priced at half the bytes, run by the trainer as it was priced
    assert args.reduce_dtype == "fp32" and "--reduce-dtype" not in emit(fsdp)
    half = dataclasses.replace(fsdp, reduce_dtype="bf16")
    assert llm_pretrain.parse_args(emit(half)).reduce_dtype == "bf16"
    assert member_entry(half)["reduce_dtype"] == "bf16" and "reduce_dtype" not in member_entry(fsdp)
    # gradients synced once a step, as priced
    assert llm_pretrain.parse_args(emit(dataclasses.replace(fsdp, grad_sync="step"))).grad_sync == "step"
    assert args.grad_sync is None


def test_model_from_config_files(tmp_path):
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = load_model(str(tmp_path / "config.json"))
    assert (cfg.dim, cfg.n_layers, cfg.hidden, cfg.vocab_size) == (4096, 32, 11008, 32000)
    assert load_model(str(tmp_path)) == cfg
    own = tmp_path / "own.json"
    own.write_text(json.dumps(TINY.to_dict()))
    assert load_model(str(own)) == TINY
    with pytest.raises(ConfigError, match="neither a preset") as missing:
        load_model(str(tmp_path / "missing.json"))
    assert "did you mean" not in str(missing.value)
    with pytest.raises(ConfigError, match="did you mean 'llama3-8b'\\? the presets: tiny, "):  # a typo, as the layouts'
        load_model("llama3-8bb")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_model(str(big))


def test_cli_one_layout_a_file_and_bad_input(tmp_path, capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "8192",
            "--global-batch", "16"]
    assert cli(base + ["--global-batch", "8", "--fsdp", "--recompute", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and set(out["memory_gib"]) == {"params", "grads", "optimizer", "activations", "buffers",
                                                      "total"}
    assert out["layout"]["zero"] == 3 and out["step_s"] > 0 and 0 < out["mfu"] < 1
    lines = tmp_path / "layouts.jsonl"
    lines.write_text('{"tp": 2}\n{"tp": 3}\n\n{"zero": 3, "micro_batch": 2}\nnot json\n')
    assert cli(base + ["--layouts", str(lines), "--json"]) == 1  # some lines were refused
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [("error" in r) for r in rows] == [False, True, False, True]
    assert rows[1] == {"line": 2, "error": "gpus 8 is not divisible by tp 3 x cp 1 x pp 1 = 3"}
    assert rows[0]["layout"]["tp"] == 2 and rows[2]["layout"]["micro_batch"] == 2
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len, --global-batch, --gpu, --site or --device-file" in err
    assert cli(base + ["--layouts", str(tmp_path)]) == 2  # a directory
    os.mkfifo(tmp_path / "fifo")  # issue 40: refused at once, named for what it is
    assert cli(base + ["--layouts", str(tmp_path / "fifo")]) == 2
    assert "fifo: is a FIFO; expected a regular file (not a link, FIFO or device)" in capsys.readouterr().err
    lines.write_text('{"tp": 2}\n' * 20_001)  # more lines than a run of the planner should take
    assert cli(base + ["--layouts", str(lines)]) == 2
    assert "20001 lines, at most 20000" in capsys.readouterr().err


def test_gpus_per_node_other_than_the_devices_default():
    """Issue 42, item 3: a 4-GPU H100 node. tp 8 then crosses nodes (slower: its traffic takes
    the inter-node links), a search keeps tp within the node, and a --layouts line takes the key."""
    from hpcml.plan.predict import resolve_device

    base = dict(model="llama3-8b", gpus=16, gpu="h100-80gb", seq_len=8192, global_batch=32, zero=3)
    steps = {n: predict(PlanLayout(**base, tp=8, gpus_per_node=n)).step_s for n in (None, 8, 4, 2)}
    assert steps[None] == steps[8] < steps[4] < steps[2]
    dev = resolve_device(PlanLayout(**base, gpus_per_node=4))
    assert dev.gpus_per_node == 4 and dev.name.endswith("x4")
    found = search(PlanLayout(**{k: v for k, v in base.items() if k != "zero"}, gpus_per_node=4,
                              degrees_checked=False))
    assert found.best and all(p.layout.tp <= 4 for p in found.best)
    with pytest.raises(ConfigError, match=r"gpus_per_node=0: expected an integer in \[1, 64\]"):
        PlanLayout(**base, gpus_per_node=0)
    out = subprocess.run([sys.executable, "-m", "hpcml.cli", "plan", "--model", "llama3-8b", "--gpus", "16", "--gpu",
                          "h100-80gb", "--seq-len", "8192", "--global-batch", "32", "--layouts", "-", "--json"],
                         input='{"tp": 8, "zero": 3, "gpus_per_node": 4}\n{"tp": 8, "zero": 3}\n', capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    four, eight = (json.loads(line) for line in out.stdout.splitlines())
    assert four["step_s"] > eight["step_s"]


def test_reduce_dtype_bf16_halves_the_gradient_reduction():
    """Issue 42, item 3: a bf16 gradient reduction sends half the bytes of fp32 (the default)."""
    base = dict(model="llama3-8b", gpus=64, gpu="h100-80gb", seq_len=8192, global_batch=64, tp=8, zero=0,
                recompute="full")
    fp32, bf16 = (predict(PlanLayout(**base, reduce_dtype=r)) for r in ("fp32", "bf16"))
    assert fp32.parts_s["dp"] > 0 and math.isclose(bf16.parts_s["dp"], fp32.parts_s["dp"] / 2, rel_tol=0.05)
    assert bf16.memory_gib == fp32.memory_gib  # gradients are kept as before; only the wire carries bf16
    assert predict(PlanLayout(**base)).step_s == fp32.step_s
    with pytest.raises(ConfigError, match="reduce_dtype='fp16': expected one of fp32, bf16"):
        PlanLayout(**base, reduce_dtype="fp16")


def _llm_pretrain():
    sys.path.insert(0, str(ROOT / "workflows"))
    try:
        import llm_pretrain
    finally:
        sys.path.pop(0)
    return llm_pretrain


def test_emit_job_is_a_job_that_runs_to_completion(capsys, monkeypatch):
    """Issue 43, item 5: the emitted job carries the account the site requires (or says how to
    give it), the steps, a checkpoint directory and cadence, --auto-resume (the job requeues at
    the walltime and resumes) and the data; the layout leaves --headroom of memory free."""
    import shlex

    monkeypatch.delenv("HPCML_ACCOUNT", raising=False)
    base = ["plan", "--model", "llama3-8b", "--gpus", "16", "--site", "polaris", "--seq-len", "4096",
            "--global-batch", "64", "--emit", "job", "--walltime", "06:00:00"]
    assert cli(base + ["--steps", "1000"]) == 2
    assert "site polaris requires an account: pass --account PROJECT or set HPCML_ACCOUNT" in capsys.readouterr().err
    assert cli(base + ["--account", "MYPROJ"]) == 2
    assert capsys.readouterr().err.strip() == ("hpcml: error: --emit job needs --steps N: the optimizer steps of the "
                                               "whole run, over every requeue (the job saves, requeues at its walltime "
                                               "and resumes until they are done)")
    assert cli(base + ["--account", "MYPROJ", "--steps", "1000", "--data", "/lus/p/corpus.h5"]) == 0
    line = shlex.split(capsys.readouterr().out.strip())
    cut = line.index("--")
    job, run = line[:cut], line[cut + 3:]  # -- python .../workflows/llm_pretrain.py
    assert "--submit" in job and line[cut + 2] == str(ROOT / "workflows" / "llm_pretrain.py")  # eval submits it
    assert job[:3] == ["hpcml", "job", "--site"] and job[job.index("--account") + 1] == "MYPROJ"
    assert job[job.index("--nodes") + 1] == "4"  # 4 GPUs a Polaris node
    args = _llm_pretrain().parse_args(run)
    assert (args.steps, args.ckpt_dir, args.auto_resume, args.data) == (1000, "checkpoints", True, ["/lus/p/corpus.h5"])
    assert 1 <= args.ckpt_every <= 1000
    assert cli(["job", *(a for a in job[2:] if a != "--submit"), "--", *line[cut + 1:]]) == 0  # a script, no refusal
    assert "--auto-resume" in capsys.readouterr().out
    monkeypatch.setenv("HPCML_ACCOUNT", "ENVPROJ")
    assert cli(base + ["--steps", "10", "--ckpt-every", "5"]) == 0
    out = capsys.readouterr().out
    assert "--account ENVPROJ" in out and "--ckpt-every 5 " in out
    # a job's flags where no job is printed: one line, not silently dropped
    args_only = [a if a != "job" else "args" for a in base]
    assert cli(args_only + ["--account", "MYPROJ"]) == 2
    assert capsys.readouterr().err.strip() == ("hpcml: error: --walltime, --account shape the job --emit job prints; "
                                               "--emit args prints no job: add --emit job (and --site), or drop them")
    assert cli([a for a in base if a not in ("--emit", "job")] + ["--ckpt-every", "5"]) == 2
    assert "--walltime, --ckpt-every shape the job" in capsys.readouterr().err


def test_a_search_leaves_headroom_and_emit_refuses_a_layout_at_the_edge(capsys):
    base = PlanLayout(model="llama3-8b", gpus=8, gpu="a100-80gb", seq_len=4096, global_batch=16)
    full, kept = search(base, top=20), search(base, top=20, headroom=0.10)
    assert all(p.memory_gib["total"] <= 0.9 * 79.15 for p in kept.best) and kept.fitting <= full.fitting
    edge = next(((mb, rc, seq) for seq in (4096, 3072, 7168) for rc in ("none", "full") for mb in (1, 2)
                 if 0.9 * 79.15 < predict(PlanLayout(model="llama3-8b", gpus=8, gpu="a100-80gb", seq_len=seq,
                                                     global_batch=16, zero=3, micro_batch=mb,
                                                     recompute=rc)).memory_gib["total"] <= 79.15), None)
    assert edge is not None  # a layout that fits, but within 10% of the device's memory
    common = ["--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", str(edge[2]),
              "--global-batch", "16", "--fsdp"]
    flags = ["--micro-batch", str(edge[0]), "--recompute", edge[1]]
    assert cli(["plan", *common, *flags, "--emit", "args"]) == 2
    err = capsys.readouterr().err
    assert "not emitting a layout this close to the device's memory: it needs" in err and "(--headroom 0.1)" in err
    assert cli(["plan", *common, *flags, "--emit", "args", "--headroom", "0"]) == 0
    capsys.readouterr()
    assert cli(["plan", "--model", "tiny", "--gpus", "1", "--gpu", "a100-80gb", "--seq-len", "64", "--global-batch",
                "8", "--headroom", "0.95"]) == 2
    assert "--headroom 0.95: expected a fraction of device memory in [0, 0.9)" in capsys.readouterr().err


def test_node_aware_data_parallelism_moves_bytes_off_the_network():
    """Llama 3 8B on 4 nodes of 8: HSDP's bytes across nodes are its all-reduce's alone, hpZ's
    about two thirds of FSDP's, hpZ + qwZ + qgZ under a quarter; HSDP holds a replica's shard
    (4x FSDP's optimizer state here) and hpZ a node's secondary shard of the weights."""
    from hpcml.plan.traffic import dp_bytes

    base = {"model": "llama3-8b", "gpus": 32, "gpu": "h100-80gb", "seq_len": 4096, "global_batch": 32, "zero": 3,
            "precision": "fp32"}  # (weights and gradients alike 4 bytes: the collectives' bytes compare as counts)
    cfg = load_model("llama3-8b")
    got = {name: dp_bytes(cfg, PlanLayout(**base, **kw), 8) for name, kw in (
        ("fsdp", {}), ("hsdp", {"dp_replicate": 4}), ("hpz", {"hpz": True}),
        ("zeropp", {"hpz": True, "qwz": True, "qgz": True}))}
    across = {k: v["dp_bytes_inter_node"] for k, v in got.items()}
    assert got["fsdp"]["dp_bytes_inter_node"] == pytest.approx(24 / 7 * got["fsdp"]["dp_bytes_intra_node"], rel=1e-3)
    # (FSDP: ~3 collectives of P/32 to 24 peers -- the root is gathered once, not twice; HSDP: the
    # all-reduce of P/8 over 4 replicas)
    assert across["hsdp"] / across["fsdp"] == pytest.approx((2 * 3 / 4 / 8) / (3 * 24 / 32), rel=0.06)
    assert across["hpz"] / across["fsdp"] == pytest.approx(2 / 3, rel=0.06)  # (the root again)
    assert across["zeropp"] < 0.25 * across["fsdp"]
    mem = {name: predict(PlanLayout(**base, **kw)).memory_gib for name, kw in (
        ("fsdp", {}), ("hsdp", {"dp_replicate": 4}), ("hpz", {"hpz": True}))}
    assert mem["hsdp"]["optimizer"] == pytest.approx(4 * mem["fsdp"]["optimizer"], rel=0.01)
    st = rank_state(cfg, PlanLayout(**base), 0)  # the blocks' weights, fp32 in hpcml, over a node's 8 ranks
    assert mem["hpz"]["buffers"] - mem["fsdp"]["buffers"] == pytest.approx(
        (st.compute_params - st.root) * 4 / 8 / 2 ** 30, rel=1e-3)
