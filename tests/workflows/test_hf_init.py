"""workflows/llm_pretrain.py --init-from a Hugging Face Llama: fine-tuning on tp 2 starts at
transformers' loss, and the checkpoint it writes exports back to a directory transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from hpcml.ckpt.tools import model_weights  # noqa: E402
from hpcml.interop import export  # noqa: E402
from hpcml.models.transformer import Transformer, cross_entropy  # noqa: E402
from hpcml.interop.hf import config_from_checkpoint  # noqa: E402
from hpcml.train.data import SyntheticTokens  # noqa: E402
from tests.hf_reference import hf_logits, make_llama  # noqa: E402
from tests.workflows.test_mpi_launch import ENV, ROOT, mpiexec  # noqa: E402

SCRIPT = str(ROOT / "workflows" / "llm_pretrain.py")
ARGS = ["--steps", "2", "--seq-len", "16", "--global-batch", "4", "--lr", "1e-3", "--no-progress"]


def test_init_from_hf_on_tp2_then_export_back(tmp_path):
    src = make_llama(tmp_path / "llama", tied=True)  # tied: the workflow unties it for tp
    tokens = SyntheticTokens(vocab_size=250, seq_len=16, seed=0).global_batch(0, 4)
    hf_loss = float(cross_entropy(hf_logits(src, tokens[:, :-1]), tokens[:, 1:]))
    out = mpiexec(2, sys.executable, SCRIPT, "--init-from", str(src), "--tp", "2", *ARGS,
                  "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "2", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"]
    assert abs(losses[0] - hf_loss) <= 1e-5  # step 0: transformers' model on the same tokens
    assert losses[1] < losses[0]

    ck = tmp_path / "ck" / "step_00000002"  # written on tp 2, fine-tuned: export it back
    assert export(ck, tmp_path / "out", "hf") > 0
    model, weights = Transformer(config_from_checkpoint(ck)), model_weights(ck)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        want = model(tokens[:, :-1])
    got = hf_logits(tmp_path / "out", tokens[:, :-1])
    assert (got - want).abs().max().item() <= 1e-5


def test_unsupported_hf_model_is_one_line(tmp_path):
    src = make_llama(tmp_path / "llama")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}}))
    out = subprocess.run([sys.executable, SCRIPT, "--init-from", str(src), *ARGS], capture_output=True, text=True,
                         env=ENV, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "llm_pretrain: error: config.json rope_type 'yarn': unsupported by hpcml's Transformer (it has 'default' and "
        "'llama3')"]
