"""Mixture-of-Experts feed-forward: top-k router, token permutation, experts, combine.

The layer knows no ranks. Its plan (:mod:`hpcml.models.transformer.parallelize`) sets

* ``dispatch``: how permuted tokens reach the experts and come back -- here, the local
  experts are all of them; under expert parallelism :class:`hpcml.parallel.ep.AllToAllDispatch`
  (an all-to-all of counts, then of tokens, and the reverse);
* ``data_group``: the dense data-parallel group (dp x cp) over which the step's expert loads
  are summed (load ratio, bias update); ``cp_group``/``cp_ranks``: a sequence split over cp
  sums its routing counts there, so the per-sequence aux loss is the same on every layout;
* ``tp_group``: with expert tensor parallelism, the tokens are the same on every tp rank
  and each holds a slice of every expert's hidden width.

Balancing: the Switch auxiliary loss ``E * sum_e f_e * P_e`` plus the router z-loss (their
gradients enter through :class:`_AttachAux`, as Megatron's MoEAuxLossAutoScaler does, so a
pipeline stage needs no extra loss), or DeepSeek-V3's aux-loss-free bias, updated after
each optimizer step from the global expert loads (:meth:`MoE.update_bias`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpcml.ckpt.state import local_piece
from hpcml.parallel.ep import copy_to_group, local_tensor, reduce_from_group


def route(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
          normalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert indices [N, k], weights [N, k]) of each token: the top-k of ``scores`` (plus the
    balancing ``bias``, which picks experts but never weighs them), renormalised to sum to 1."""
    choose = scores if bias is None else scores + bias
    idx = torch.topk(choose, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, idx)
    if normalise:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return idx, weights


def permutation(idx: torch.Tensor, n_experts: int, capacity: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): ``order`` lists the flat assignments (token * k + slot) grouped by
    expert, tokens in their original order within an expert (a stable sort); ``counts[e]`` is
    how many expert ``e`` receives, 0 included. With a ``capacity`` an expert keeps only its
    first ``capacity`` assignments (token order) and the rest are dropped."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[position < capacity]
        counts = counts.clamp(max=capacity)
    return order, counts


class Experts(nn.Module):
    """``n`` SwiGLU experts as three stacked weights, expert index first (the global index in
    a checkpoint): ``w1``, ``w3`` [E, hidden, dim] and ``w2`` [E, dim, hidden], each expert's
    matrix laid out as ``nn.Linear.weight`` is (HF Mixtral's per-expert ``w1/w2/w3``)."""

    def __init__(self, n: int, dim: int, hidden: int, grouped_mm: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.grouped_mm = grouped_mm
        """One ``torch.nn.functional.grouped_mm`` per projection; False: the per-expert loop (the reference)."""

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [T, dim] grouped by local expert (``counts[e]`` rows each) -> [T, dim]."""
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        if self.grouped_mm and x.shape[0] > 0:
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            w1t, w2t, w3t = (w.to(x.dtype).transpose(-2, -1) for w in (w1, w2, w3))
            h = F.silu(F.grouped_mm(x, w1t, offs=offs)) * F.grouped_mm(x, w3t, offs=offs)
            return F.grouped_mm(h, w2t, offs=offs)
        out = [F.linear(F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e]), w2[e])
               for e, chunk in enumerate(x.split(counts))]
        return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


class LocalDispatch(nn.Module):
    """Every expert is on this rank: the permuted tokens go straight to them."""

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        return experts(tokens, counts.tolist())


class _AttachAux(torch.autograd.Function):
    """Identity on ``out``; in backward, d(aux)/d(router) flows as if ``aux`` were added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=torch.float32, device=grad.device)


class Router(nn.Module):
    """Scores in fp32 (softmax or sigmoid) of each token for each expert; ``expert_bias`` (a
    frozen parameter, so checkpoints carry it) exists for aux-loss-free balancing."""

    def __init__(self, dim: int, n_experts: int, bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), local_tensor(self.gate.weight).float())


class MoE(nn.Module):
    """The MoE feed-forward of one block: [B, S, dim] -> [B, S, dim] (see the module docstring)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        from hpcml.models.transformer.model import FeedForward

        self.n_experts, self.top_k = cfg.n_experts, cfg.moe_top_k
        self.score, self.balance = cfg.moe_score, cfg.moe_balance
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.bias_rate, self.capacity_factor = cfg.moe_bias_rate, cfg.moe_capacity
        self.normalise = cfg.moe_norm_topk or cfg.moe_score == "sigmoid"
        self.router = Router(cfg.dim, cfg.n_experts, bias=cfg.moe_balance == "bias")
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_hidden, grouped_mm=cfg.moe_grouped_mm)
        self.shared_expert = FeedForward(cfg, hidden=cfg.moe_shared_hidden) if cfg.moe_shared_hidden else None
        self.dispatch: nn.Module = LocalDispatch()
        self.data_group, self.tp_group, self.cp_group, self.cp_ranks = None, None, None, 1
        self.grad_scale = 1.0
        """Multiplies the balancing gradients: 1 / micro-batches under gradient accumulation (set by the engine)."""
        self.load_local = torch.zeros(cfg.n_experts, dtype=torch.float64)
        """Assignments each expert got from this rank's tokens since the last step."""
        self.load = torch.zeros(cfg.n_experts, dtype=torch.float64)
        """Assignments each expert got over the global batch of the last step (:meth:`reduce_load`)."""
        self.last: dict[str, float] = {}
        """Sums over this step's forwards (``calls``) of this rank's ``aux`` and ``z``; the global load ratio."""

    def capacity(self, n_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        logits = self.router(x2)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        bias = self.router.expert_bias
        idx, weights = route(scores, self.top_k, None if bias is None else local_tensor(bias).detach(), self.normalise)
        aux = self._balancing(logits, scores, idx, shape[0] if x.dim() == 3 else 1)
        order, counts = permutation(idx, self.n_experts, self.capacity(x2.shape[0]))
        xe = x2 if self.tp_group is None else copy_to_group(x2, self.tp_group)
        y = self.dispatch(xe[order // self.top_k], counts, self.experts)
        if self.tp_group is not None:  # each tp rank's experts gave a partial sum over their hidden slice
            y = reduce_from_group(y, self.tp_group)
        w = weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(x2, dtype=y.dtype).index_add(0, order // self.top_k, y * w).to(x.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        if aux is not None:
            out = _AttachAux.apply(out, aux)
        return out.view(shape)

    def _balancing(self, logits: torch.Tensor, scores: torch.Tensor, idx: torch.Tensor, batch: int
                   ) -> torch.Tensor | None:
        """The balancing losses of this micro-batch, scaled as the language-model loss is (a
        mean over this rank's tokens), so the engines' gradient averaging gives theirs.

        The Switch loss is per sequence (Megatron's "seq_aux_loss"): ``E * sum_e f_e P_e``
        with f the fraction of the sequence's assignments routed to e and P its mean score,
        averaged over the sequences -- a quantity of the data alone, the same on every layout
        (under cp the sequence's counts are summed over the cp group: one small all-reduce)."""
        if not torch.is_grad_enabled() or idx.device.type == "meta":
            return None  # evaluation, or a pipeline stage inferring shapes: no training statistics
        e = self.n_experts
        counts = torch.bincount(idx.reshape(-1), minlength=e).double()
        self.load_local += counts.cpu()
        self.last["calls"] = self.last.get("calls", 0) + 1
        total = None
        if self.balance == "aux" and self.aux_coef > 0:
            seq = torch.zeros(batch, e, device=idx.device).scatter_add_(
                1, idx.reshape(batch, -1), torch.ones(idx.numel(), device=idx.device).reshape(batch, -1))
            n = torch.full((batch, 1), float(idx.shape[0] // batch), device=idx.device)
            if self.cp_group is not None:
                both = torch.cat([seq, n], 1)
                dist.all_reduce(both, group=self.cp_group)
                seq, n = both[:, :e], both[:, e:]
            probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            p_sum = probs.reshape(batch, -1, e).sum(1)
            aux = (e * (seq / (n * self.top_k)) * p_sum / n).sum(1).mean() * self.cp_ranks
            self.last["aux"] = self.last.get("aux", 0.0) + float(aux.detach()) / self.cp_ranks
            total = self.aux_coef * aux
        if self.z_coef > 0:
            z = torch.logsumexp(logits, -1).pow(2).mean()
            self.last["z"] = self.last.get("z", 0.0) + float(z.detach())
            total = self.z_coef * z if total is None else total + self.z_coef * z
        return None if total is None else total * self.grad_scale

    @torch.no_grad()
    def reduce_load(self) -> None:
        """The global expert loads since the last step (one all-reduce over dp x cp): into
        ``load`` and ``last["load_max_over_mean"]``."""
        load = self.load_local.clone().to(self.router.gate.weight.device)
        if self.data_group is not None:
            dist.all_reduce(load, group=self.data_group)
        self.load = load.cpu()
        self.load_local.zero_()
        self.last["load_max_over_mean"] = float(self.load.max() / self.load.mean().clamp_min(1e-20))

    @torch.no_grad()
    def update_bias(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts and
        lower that of over-loaded ones by ``bias_rate``, from the global loads of the step;
        the same on every rank, since the loads are global. Clears the step's statistics."""
        if "load_max_over_mean" not in self.last:
            self.reduce_load()
        bias = self.router.expert_bias
        if bias is not None and self.load.sum() > 0:
            step = torch.sign(self.load.mean() - self.load).to(torch.float32) * self.bias_rate
            local, _, offset = local_piece(bias)  # sharded (FSDP): this rank's rows of the step
            local.add_(step[offset[0]:offset[0] + local.shape[0]].to(local.device))
        self.last = {}


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


__all__ = ["Experts", "LocalDispatch", "MoE", "Router", "moe_layers", "permutation", "route"]
