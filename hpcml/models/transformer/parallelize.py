"""The transformer's parallel plan: which layers each pipeline stage holds, Megatron's
column/row tensor-parallel split, Ulysses around attention, activation checkpointing per
block, FSDP units per block -- and the checks that run before any collective.

Tensor parallelism (DTensor ``parallelize_module``): attention q/k/v and the MLP's w1/w3
are column-parallel, wo and w2 row-parallel: one all-reduce per sub-block in forward and
one in backward. The embedding is vocabulary-parallel (row-wise), the output projection
column-parallel with logits left sharded over the vocabulary, so ``loss_parallel()``
computes the cross-entropy without gathering them. With ``sequence_parallel`` the norms
and residuals are sharded along the sequence and the all-reduces become reduce-scatter +
all-gather. Fused projections (``attention.wqkv``, ``feed_forward.w13``) give each rank
its slice of every sub-parameter (:class:`~hpcml.parallel.tp.FusedColwiseParallel`);
checkpoints store them logical (:meth:`TransformerPlan.tensor_attrs`).
"""

from __future__ import annotations

import copy

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hpcml.ckpt.state import fused_attrs
from hpcml.grid.layout import Layout
from hpcml.models.transformer.model import Transformer, TransformerConfig, cross_entropy
from hpcml.models.transformer.moe import MoE, moe_layers
from hpcml.models.transformer.moe_plan import apply_moe
from hpcml.models.transformer.rules import check_moe_plan, check_plan, stage_layers  # noqa: F401 (the plan's API)
from hpcml.parallel.config import ParallelConfig
from hpcml.parallel.fpdt import FPDTAttention
from hpcml.parallel.model_plan import ParallelPlan
from hpcml.parallel.tp import FusedColwiseParallel
from hpcml.parallel.cp_allgather import AllGatherAttention
from hpcml.parallel.ulysses import UlyssesAttention


def apply_tp(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard ``model`` (or a pipeline stage of it) over the 1-D tp ``mesh``, in place."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, plan)
    fused = model.config.fused_widths
    qkv, w13 = fused.get("attention.wqkv.weight"), fused.get("feed_forward.w13.weight")
    for block in model.layers.values():
        # a MoE block's dense MLP is its shared expert (its routed experts are sharded by apply_moe)
        ffn = "feed_forward.shared_expert" if isinstance(block.feed_forward, MoE) else "feed_forward"
        has_ffn = ffn == "feed_forward" or block.feed_forward.shared_expert is not None
        block_plan: dict = {
            **({"attention.wqkv": FusedColwiseParallel(qkv)} if qkv else
               {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel()}),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if has_ffn:
            block_plan.update({
                **({f"{ffn}.w13": FusedColwiseParallel(w13)} if w13 else
                   {f"{ffn}.w1": ColwiseParallel()}),
                **({f"{ffn}.w3": ColwiseParallel()} if model.config.activation == "swiglu" and not w13 else {}),
                f"{ffn}.w2": RowwiseParallel(output_layouts=seq),
                # The sub-block input enters as one replicated DTensor, so the input gradients of
                # q, k, v (and of w1, w3) add up as partial sums and are all-reduced once, not once
                # per projection; with sequence parallelism that one reduction is a reduce-scatter.
                ffn: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            })
        block_plan["attention"] = PrepareModuleInput(input_layouts=(seq, None, None, None),
                                                     desired_input_layouts=(Replicate(), None, None, None))
        if sp:
            block_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, mesh, block_plan)
        block.attention.head_part = (mesh.get_local_rank(), mesh.size())  # colwise q: a contiguous part of the heads
    model.sp_size = mesh.size() if sp else 1  # hidden states hold S / tp positions between regions


class TransformerPlan(ParallelPlan):
    """The :class:`~hpcml.parallel.model_plan.ParallelPlan` of :class:`Transformer`."""

    loss_fn = staticmethod(cross_entropy)

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config

    def check(self, layout: Layout, config: ParallelConfig) -> None:
        check_plan(self.config, layout, config)

    def stage(self, model: Transformer, stage: int, n_stages: int, config: ParallelConfig) -> Transformer:
        """A copy of ``model`` holding only this stage's layers (and the embedding / final norm
        and output on the first / last stage). Names stay those of the whole model."""
        part = copy.deepcopy(model)
        keep = {str(i) for i in stage_layers(self.config, n_stages, config)[stage]}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if stage != 0:
            part.tok_embeddings = part.pos_embeddings = None
        if stage != n_stages - 1:
            part.norm, part.output = None, None
        return part

    def apply_tp(self, part: Transformer, mesh: DeviceMesh, config: ParallelConfig) -> None:
        apply_tp(part, mesh, config.sequence_parallel)

    def apply_cp(self, part: Transformer, group, index: int, count: int) -> None:
        part.seq_shard = (index, count)
        for block in part.layers.values():
            block.attention.core = UlyssesAttention(block.attention.core, group)

    def apply_cp_allgather(self, part: Transformer, group, index: int, count: int) -> None:
        part.seq_shard = (index, count)
        for block in part.layers.values():
            block.attention.core = AllGatherAttention(group, index)

    def apply_fpdt(self, part: Transformer, group, index: int, count: int, chunk: int) -> None:
        """Strided chunks, chunked attention through per-chunk all-to-alls, chunked MLP (a MoE
        block's router keeps the whole sequence: its balancing statistics are per sequence) and
        chunked logits + loss."""
        part.seq_shard, part.fpdt_chunk = (index, count), chunk
        for block in part.layers.values():
            block.attention.core = FPDTAttention(group, chunk)
            block.mlp_chunk = 0 if isinstance(block.feed_forward, MoE) else chunk

    def apply_loss_chunk(self, part: Transformer, chunk: int) -> None:
        """The output layer and the loss ``chunk`` positions at a time (``ParallelConfig.loss_chunk``)."""
        part.loss_chunk = chunk

    def computes_loss(self, config: ParallelConfig) -> bool:
        return bool(config.fpdt_chunk or config.loss_chunk)

    def apply_moe(self, part: Transformer, grid, data_mesh: DeviceMesh | None) -> list:
        """Shard each MoE layer's experts over ep (and tp), give it its dispatch and groups;
        returns the expert parameters (their gradients reduce over edp, not dp x cp)."""
        return apply_moe(part, grid, data_mesh)

    def expert_modules(self, part: Transformer) -> list:
        """Each MoE layer's experts: their own FSDP unit over edp."""
        return [moe.experts for moe in moe_layers(part)]

    def after_step(self, part: Transformer) -> None:
        for moe in moe_layers(part):
            moe.update_bias()

    def reset_stats(self, part: Transformer) -> None:
        """Forget the statistics of forwards that were no training (a pipeline's shape inference)."""
        for moe in moe_layers(part):
            moe.last = {}
            moe.load_local.zero_()

    def set_grad_scale(self, part: Transformer, scale: float) -> None:
        for moe in moe_layers(part):
            moe.grad_scale = scale

    @property
    def stat_names(self) -> tuple[str, ...]:
        """Per-step statistics :meth:`step_stats` gives (the training loop's metrics)."""
        return ("moe_aux", "moe_z", "moe_load_max_over_mean") if self.config.n_experts else ()

    def step_stats(self, part: Transformer, layout: Layout) -> dict[str, float]:
        """This rank's share of the step's balancing statistics, each a mean over the model's
        MoE layers, micro-batches and sequences once summed over all ranks (one all-reduce of
        the expert loads over dp x cp first, for the load ratio and the bias update)."""
        n = max(1, self.config.n_moe_layers)
        out = dict.fromkeys(self.stat_names, 0.0)
        for moe in moe_layers(part):
            moe.reduce_load()
            calls = max(1, moe.last.get("calls", 1))
            out["moe_aux"] += moe.last.get("aux", 0.0) / (calls * layout.dp * layout.tp * n)
            out["moe_z"] += moe.last.get("z", 0.0) / (calls * layout.dp * layout.cp * layout.tp * n)
            out["moe_load_max_over_mean"] += moe.last["load_max_over_mean"] / (layout.world_size // layout.pp * n)
        return out

    def apply_activation_checkpointing(self, part: Transformer) -> None:
        for block in part.layers.values():
            block.activation_checkpointing = True

    def fsdp_units(self, part: Transformer) -> list:
        return list(part.layers.values())

    def tensor_attrs(self) -> dict[str, dict]:
        """The vocabulary-padded tensors' logical shape, fused weights' widths (docs/checkpoint-format.md)."""
        cfg = self.config
        vocab = {f"model/{n}": {"logical_shape": [cfg.vocab_size, cfg.dim]}
                 for n in ("tok_embeddings.weight", "output.weight")}
        attrs = {**vocab, **{f"optim/{n[6:]}/{s}": a for n, a in vocab.items() for s in ("exp_avg", "exp_avg_sq")}}
        attrs.update(fused_attrs({f"layers.{i}.{name}": widths for i in range(cfg.n_layers)
                                  for name, widths in cfg.fused_widths.items()}))
        for i in (i for i in range(cfg.n_layers) if cfg.is_moe(i)):  # row e of an expert tensor is global expert e
            for w in ("w1", "w2", "w3"):
                name = f"layers.{i}.feed_forward.experts.{w}"
                a = {"experts": cfg.n_experts, "expert_dim": 0}
                attrs.update({f"model/{name}": a,
                              **{f"optim/{name}/{st}": dict(a) for st in ("exp_avg", "exp_avg_sq")}})
        return attrs


__all__ = ["TransformerPlan", "apply_tp", "check_plan", "stage_layers"]
