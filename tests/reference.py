"""A plain single-process PyTorch training loop: the reference every parallel layout must match.

It shares only the model, the data and the learning-rate rule with hpcml's Trainer; the
loop, gradient accumulation and clipping (torch.nn.utils.clip_grad_norm_) are torch's own.
"""

from __future__ import annotations

import functools

import torch

from hpcml.models.transformer import Transformer, TransformerConfig, cross_entropy
from hpcml.models.transformer.moe import moe_layers
from hpcml.train import SyntheticTokens, TrainConfig
from hpcml.train.loop import make_optimizer


def assert_trains_as_one_process(trainer, model_cfg: TransformerConfig, cfg: TrainConfig, tol: float) -> None:
    """``trainer.fit()`` gives the one-process run's losses and gradient norms to ``tol`` (relative),
    and its parameters (whole, from their shards) to ``tol`` of each one's norm; the trainer closed."""
    import pytest

    ref_losses, ref_norms, ref_params = reference_run(model_cfg, cfg)
    history = trainer.fit()
    assert [m["loss"] for m in history] == pytest.approx(ref_losses, rel=tol)
    assert [m["grad_norm"] for m in history] == pytest.approx(ref_norms, rel=tol)
    for name, p in trainer.model.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        assert float((full - ref_params[name]).norm()) <= tol * float(ref_params[name].norm()) + 1e-12, name
    trainer.close()


def document_by_document_loss(model: Transformer, x: torch.Tensor, y: torch.Tensor, eod: int) -> torch.Tensor:
    """The mean next-token loss of packed sequences, each document (ended by ``eod``) run through
    the model alone, from position 0: what document masking must give with no mask at all
    (rotary positions are relative, so a document's place in the sequence does not count)."""
    total, count = 0.0, 0
    for xs, ys in zip(x, y):
        cuts = [0, *[int(e) + 1 for e in (xs == eod).nonzero().flatten() if int(e) + 1 < len(xs)], len(xs)]
        for a, b in zip(cuts, cuts[1:]):
            total = total + cross_entropy(model(xs[None, a:b]), ys[None, a:b]) * (b - a)
            count += b - a
    return total / count


def reference_run(model_cfg: TransformerConfig, cfg: TrainConfig, data=None
                  ) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(losses, gradient norms before clipping, final parameters by name); ``data``: a token
    source (default: the synthetic tokens of ``cfg.seed``)."""
    return reference_run_with_stats(model_cfg, cfg, data)[:3]


@functools.lru_cache(maxsize=8)
def reference_run_with_stats(model_cfg: TransformerConfig, cfg: TrainConfig, data=None):
    """:func:`reference_run` and, for a MoE model, each step's mean Switch aux loss over
    layers, micro-batches and sequences (the MoE layer's own statistics, no engine)."""
    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg)
    moes = moe_layers(model)
    opt, sched = make_optimizer(model.parameters(), cfg)
    if data is None:
        data = SyntheticTokens(vocab_size=model_cfg.vocab_size, seq_len=cfg.seq_len, seed=cfg.seed)
    n_micro = cfg.global_batch // cfg.micro_batch
    losses, norms, aux = [], [], []
    for moe in moes:  # balancing gradients follow the micro-batch mean, as the loss does
        moe.grad_scale = 1.0 / n_micro
    for step in range(cfg.steps):
        tokens = data.global_batch(step, cfg.global_batch)
        x, y = tokens[:, :-1], tokens[:, 1:]
        total = 0.0
        for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro)):
            loss = cross_entropy(model(xm), ym) if cfg.doc_mask_eod is None else \
                document_by_document_loss(model, xm, ym, cfg.doc_mask_eod)
            (loss / n_micro).backward()
            total += loss.item()
        losses.append(total / n_micro)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))))
        opt.step()
        if moes:
            aux.append(sum(m.last.get("aux", 0.0) / m.last["calls"] for m in moes) / len(moes))
        for moe in moes:
            moe.update_bias()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}, aux
