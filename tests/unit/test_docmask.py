"""Issue 43: per-document attention masking of packed sequences. Against an independent
reference: every document run through the model alone (no mask at all)."""

from __future__ import annotations

import pytest
import torch

from hpcml.errors import ConfigError
from hpcml.models.transformer import Transformer, TransformerConfig, cross_entropy
from hpcml.parallel.docmask import AttentionMask, document_ids
from hpcml.train import TrainConfig
from tests.reference import document_by_document_loss

EOD = 0
CFG = TransformerConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


pytestmark = pytest.mark.usefixtures("fp64")


def _packed(seed: int = 0) -> torch.Tensor:
    """[2, 24] tokens: documents of 5, 1, 9, ... tokens, each ended by EOD."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 64, (2, 24), generator=g)
    for b, ends in ((0, (4, 5, 15)), (1, (0, 11, 12, 23))):
        x[b, list(ends)] = EOD
    return x


def test_document_ids_count_the_ends_before_each_position():
    x = torch.tensor([[5, 0, 7, 7, 0, 0, 3]])
    assert document_ids(x, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3]]  # an end belongs to the document it ends
    assert document_ids(torch.tensor([[1, 2, 3]]), 0).tolist() == [[0, 0, 0]]


def test_the_mask_is_causal_within_documents_and_its_rows_are_cut_for_a_context_parallel_rank():
    ids = document_ids(torch.tensor([[5, 0, 7, 7, 0, 3]]), 0)
    full = AttentionMask(ids).rows(0, 6)[0, 0].int().tolist()
    assert full == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                    [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    m = AttentionMask(ids)
    assert m.rows(3, 3)[0, 0].int().tolist() == full[3:]
    assert m.rows(3, 3) is m.rows(3, 3)  # one mask per forward, shared by every layer
    with pytest.raises(ConfigError, match="mask rows 4..8: outside the sequence of 6"):
        m.rows(4, 4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_masked_packed_sequence_gives_each_document_the_logits_it_has_alone(checkpointing):
    torch.manual_seed(0)
    model = Transformer(CFG)
    for block in model.layers.values():
        block.activation_checkpointing = checkpointing
    x = _packed()
    masked = model(x, doc_ids=document_ids(x, EOD))
    for b, (a, z) in ((0, (6, 16)), (1, (13, 24)), (0, (0, 5))):
        alone = model(x[b:b + 1, a:z])
        assert torch.allclose(masked[b, a:z], alone[0], rtol=0, atol=1e-10), (b, a, z)
    plain = model(x)
    assert (plain[0, 6:16] - masked[0, 6:16]).abs().max() > 1e-3  # unmasked, the text before leaks in


def test_masked_loss_and_gradients_equal_the_documents_run_one_by_one():
    torch.manual_seed(1)
    model = Transformer(CFG)
    x, y = _packed(1)[:, :-1], _packed(1)[:, 1:]
    loss = cross_entropy(model(x, doc_ids=document_ids(x, EOD)), y)
    got = torch.autograd.grad(loss, list(model.parameters()))
    ref = document_by_document_loss(model, x, y, EOD)
    want = torch.autograd.grad(ref, list(model.parameters()))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-9) for g, w in zip(got, want))  # rope tables: fp32 angles


def test_doc_ids_of_another_shape_than_the_sequence_are_refused_in_one_line():
    model = Transformer(CFG)
    x = _packed()
    with pytest.raises(ConfigError, match=r"doc_ids of shape \(2, 23\): expected \[2, 24\]"):
        model(x, doc_ids=document_ids(x, EOD)[:, 1:])


def test_the_config_checks_the_end_token_and_refuses_fpdt():
    from hpcml.grid.layout import Layout

    assert TrainConfig(doc_mask_eod=3).doc_mask_eod == 3
    for bad in (True, -1, "0", 1.0):
        with pytest.raises(ConfigError, match="doc_mask_eod"):
            TrainConfig(doc_mask_eod=bad)
    with pytest.raises(ConfigError, match="document masking under FPDT is not built"):
        TrainConfig(doc_mask_eod=3, seq_len=32).check_layout(Layout.from_degrees(1, {}), 32, fpdt_chunk=8)


def test_a_source_whose_documents_end_with_another_token_is_refused():
    from hpcml.train.trainer import check_source

    class Source:
        seq_len, eods = 16, {7}

    check_source(Source(), 16, 64, eod=7)
    check_source(Source(), 16, 64)  # no masking: the end token does not matter
    with pytest.raises(ConfigError,
                       match=r"masking by end-of-document token 3, but the data's documents end with \[7\]"):
        check_source(Source(), 16, 64, eod=3)
