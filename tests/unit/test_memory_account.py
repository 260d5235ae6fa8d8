"""The memory account (hpcml.train.memory): bytes saved for backward, per layer, each storage
once, parameters never, a fresh count per micro-batch; and what FPDT saves against plain
attention on the same model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hpcml.models.transformer import Transformer, TransformerConfig
from hpcml.models.transformer.model import cross_entropy
from hpcml.train.memory import OUTSIDE, SavedBytes, summary


def test_each_storage_counts_once_in_the_layer_that_saved_it_and_parameters_not_at_all():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh())
    account = SavedBytes({"lin0": model[0], "relu": model[1], "lin2": model[2]}, [model])
    x = torch.randn(5, 8)
    with account:
        model(x).sum().backward()
        model(x[:2]).sum().backward()  # a second micro-batch: a count of its own (x's view keeps all of x)
    first, second = account.take()
    # lin0 saves its input (5 x 8 floats), relu its output (5 x 16), which lin2 saves again
    # (counted once, in relu), tanh its output (5 x 4, outside any named layer); no weight counts
    assert first == {"lin0": 5 * 8 * 4, "relu": 5 * 16 * 4, OUTSIDE: 5 * 4 * 4}
    assert second == {"lin0": 5 * 8 * 4, "relu": 2 * 16 * 4, OUTSIDE: 2 * 4 * 4}
    assert summary([first, second]) == {"saved_mib": 560 / 2**20, "saved_mib_per_layer": 320 / 2**20}
    assert account.take() == []
    model(x).sum().backward()  # hooks gone after the with: nothing counted
    assert account.take() == []


def test_fpdt_saves_less_per_layer_and_no_logits():
    """One rank, 512 positions in chunks of 64: per layer FPDT keeps its input, q, k, v, the
    output and the output projection's input (about 7 x dim per token), where plain attention
    and the unchunked MLP keep about 17 x dim; the chunked loss keeps no vocabulary-sized logits."""
    torch.manual_seed(0)
    cfg = TransformerConfig.preset("tiny", max_seq_len=512, vocab_size=4096)
    plain = Transformer(cfg)
    fpdt = copy.deepcopy(plain)
    fpdt.parallel_plan().apply_fpdt(fpdt, None, 0, 1, 64)
    x, y = torch.randint(0, cfg.vocab_size, (1, 512)), torch.randint(0, cfg.vocab_size, (1, 512))
    counts = {}
    for name, model in (("plain", plain), ("fpdt", fpdt)):
        account = SavedBytes(dict(model.layers.items()), [model])
        with account:
            loss = model(x, targets=y) if name == "fpdt" else cross_entropy(model(x), y)
        counts[name] = account.take()[0]
        loss.backward()
    token = 512 * cfg.dim * 4  # one float per position and model dimension
    for layer in ("1", "2", "3"):
        assert 6.5 * token < counts["fpdt"][layer] < 7.5 * token, counts["fpdt"][layer] / token
        assert counts["plain"][layer] > 16 * token, counts["plain"][layer] / token
    logits = 512 * cfg.padded_vocab * 4
    assert counts["plain"][OUTSIDE] > logits  # the log-softmax of the logits, for the loss's backward
    # FPDT's loss keeps d loss / d h (h's size) and the output layer's gradient, not the logits
    grads = 512 * cfg.dim * 4 + cfg.padded_vocab * cfg.dim * 4
    assert grads < counts["fpdt"][OUTSIDE] < grads + 16 * 1024 < logits / 6


@pytest.fixture(autouse=True)
def _grad():
    with torch.enable_grad():
        yield
