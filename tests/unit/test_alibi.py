"""ALiBi positions (Press et al. 2022) in the model: the paper's slopes, the mask's rows and
head parts, and a forward equal to attention written out by hand with the bias."""

from __future__ import annotations

import math

import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.models.transformer import Transformer, TransformerConfig, cross_entropy
from hpcml.models.transformer.alibi import alibi_slopes
from hpcml.parallel import ParallelConfig
from hpcml.parallel.docmask import AttentionMask, document_ids
from hpcml.grid.layout import Layout
from hpcml.models.transformer.rules import check_plan

CFG = TransformerConfig(vocab_size=64, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=32, positions="alibi")


pytestmark = pytest.mark.usefixtures("fp64")


def test_slopes_are_the_papers_geometric_sequence_and_its_interleave_for_other_head_counts():
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    # 12 heads: the 8-head sequence, then every other slope of the 16-head one (2^-0.5, 2^-1.5, ...)
    assert alibi_slopes(12).tolist() == pytest.approx([2.0 ** -k for k in range(1, 9)]
                                                      + [2.0 ** -(k + 0.5) for k in range(4)], rel=1e-15)
    assert alibi_slopes(1).tolist() == [2.0 ** -8]


def test_mask_rows_bias_each_head_by_its_distance_and_parts_take_contiguous_heads():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    m = AttentionMask(seq_len=5, slopes=slopes)
    full = m.rows(0, 5, torch.float64)
    assert full.shape == (1, 4, 5, 5)
    assert full[0, 1, 3].tolist() == [-0.75, -0.5, -0.25, 0.0, float("-inf")]
    assert m.rows(2, 2, torch.float64).equal(full[:, :, 2:4])  # a cp rank's queries
    part = m.heads(1, 2)  # tp rank 1 of 2: heads 2, 3
    assert part.rows(0, 5, torch.float64).equal(full[:, 2:4])
    assert part.heads(1, 2).rows(0, 5, torch.float64).equal(full[:, 3:4])  # then Ulysses rank 1 of 2: head 3
    assert m.rows(0, 5, torch.float64) is full  # one tensor per forward, every layer's
    assert m.rows(0, 5, torch.float32).dtype == torch.float32
    with pytest.raises(ConfigError, match="4 heads do not split so"):
        m.heads(0, 3)


def test_documents_and_biases_together_mask_other_documents():
    ids = document_ids(torch.tensor([[5, 0, 7, 7]]), 0)  # documents [0, 1], [2, 3]
    rows = AttentionMask(ids, slopes=torch.tensor([0.5])).rows(0, 4, torch.float64)[0, 0]
    inf = float("-inf")
    assert rows.tolist() == [[0, inf, inf, inf], [-0.5, 0, inf, inf], [inf, inf, 0, inf], [inf, inf, -0.5, 0]]


def _by_hand(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The logits with attention written out: softmax(q k^T / sqrt(d) - m_h (i - j), causal) v."""
    cfg = model.config
    b, s = x.shape
    h = model.tok_embeddings(x)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    bias = -alibi_slopes(cfg.n_heads)[:, None, None] * (i - j)
    group = cfg.n_heads // cfg.kv_heads
    for layer in model.layers.values():
        a, y = layer.attention, layer.attention_norm(h)
        q = a.wq(y).view(b, s, cfg.n_heads, -1).transpose(1, 2)
        k, v = (w(y).view(b, s, cfg.kv_heads, -1).transpose(1, 2).repeat_interleave(group, 1) for w in (a.wk, a.wv))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim) + bias).masked_fill(j > i, float("-inf"))
        h = h + a.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
        h = h + layer._mlp(h)
    return model.output(model.norm(h))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_forward_and_gradients_equal_attention_written_out_with_the_bias(checkpointing):
    torch.manual_seed(0)
    model = Transformer(CFG)
    assert model.pos_embeddings is None and not any("alibi" in n for n, _ in model.state_dict().items())
    for block in model.layers.values():
        block.activation_checkpointing = checkpointing
    x, y = torch.randint(0, 64, (2, 24)), torch.randint(0, 64, (2, 24))
    loss = cross_entropy(model(x), y)
    ref = cross_entropy(_by_hand(model, x), y)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-13)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(ref, list(model.parameters()))
    assert all(torch.allclose(g, w, rtol=1e-10, atol=1e-14) for g, w in zip(got, want))
    rope = Transformer(CFG.with_blocks(positions="rope"))
    rope.load_state_dict(model.state_dict())  # the same parameters: only the positions differ
    assert (rope(x) - model(x)).abs().max() > 1e-3


def test_a_prefix_sees_the_same_logits_as_the_whole_sequence():
    """Causal and relative: the first 10 positions' logits do not depend on what follows."""
    torch.manual_seed(1)
    model = Transformer(CFG)
    x = torch.randint(0, 64, (1, 24))
    assert torch.allclose(model(x)[:, :10], model(x[:, :10]), rtol=0, atol=1e-12)


def test_fpdt_with_alibi_is_refused_before_any_collective():
    with pytest.raises(ConfigError, match="positions alibi with fpdt_chunk 4: FPDT's chunked attention takes no"):
        check_plan(CFG, Layout(world_size=2, cp=2), ParallelConfig(fpdt_chunk=4))
    model = Transformer(CFG)
    model.parallel_plan().apply_fpdt(model, None, 0, 1, 4)
    with pytest.raises(ConfigError, match="ALiBi under FPDT is not built"):
        model(torch.randint(0, 64, (1, 16)))
