"""One candidate layout of a training run: the model, the devices, the batch, and every choice
per axis. Validated in ``__post_init__`` with the numbers in the message, so a bad line of a
``--layouts`` file is refused alone, naming its value."""

from __future__ import annotations

import difflib
from dataclasses import InitVar, asdict, dataclass, fields, replace

from hpcml.errors import ConfigError
from hpcml.models.transformer.config import TransformerConfig
from hpcml.numeric import is_int, is_real
from hpcml.parallel.config import GRAD_SYNCS, PP_SCHEDULES, REDUCE_DTYPES
from hpcml.plan.framework_rules import check_degrees, deepspeed_refuses

RECOMPUTE = ("none", "selective", "selective-op", "selective-layer", "full")
ATTENTION = ("flash", "flash-attn", "eager")
"""flash: the framework's own fused attention (Megatron's Transformer Engine picks cuDNN's kernel on
Hopper; hpcml's and torchtitan's SDPA, FlashAttention-2); flash-attn: FlashAttention-2's kernel
whatever the framework (Transformer Engine with ``NVTE_FUSED_ATTN=0``); eager: the scores kept."""
PRECISIONS = ("bf16", "fp32", "fp8")
ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
CP_KINDS = ("ulysses", "allgather")
PIPELINE_SPLITS = ("blocks", "ends")
POSITIONS = ("rope", "learned", "alibi")
LOSSES = ("eager", "fused")
MASTER_WEIGHTS = ("fp32", "remainder")
FRAMEWORKS = ("hpcml", "megatron", "torchtitan", "deepspeed")
"""Whose implementation runs the layout: the same layout keeps different bytes in each.
hpcml: fp32 weights and Adam, bf16 by autocast (``--bf16``), torch's sequence parallelism
(keeps gathered inputs), one flat gradient all-reduce under DDP; megatron: bf16 weights, fp32
main gradients, fp32 master weights and moments (the distributed optimizer shards them at ZeRO-1),
sequence parallelism keeping shards; torchtitan: FSDP2 with bf16 compute over fp32 shards;
deepspeed: Megatron-DeepSpeed -- Megatron's blocks on DeepSpeed's engine, whose ``BF16_Optimizer``
(ZeRO 0-1) keeps bf16 gradients and a whole fp32 copy it accumulates into and all-reduces after the
last micro-batch (after the pipeline's schedule: nothing overlapped), fp32 master weights and
moments sharded at ZeRO-1, the bf16 weights all-gathered after the step; ZeRO-2 and -3 without a
pipeline (its pipeline engine runs ZeRO 0-1 and 1F1B only)."""
MEGATRON_MODEL = ("megatron", "deepspeed")
"""Frameworks running Megatron's model code: fused blocks, sequence parallelism keeping shards, a
vocabulary-parallel embedding whose gradient is a shard."""


MAX = 1 << 40
"""Largest device count, batch, sequence or degree a layout may name (beyond it the arithmetic
is no plan of anything that runs)."""
MAX_LAYERS = 100_000


#: What :meth:`PlanLayout.with_degrees` may change.
_DEGREE_FIELDS = ("tp", "pp", "cp", "ep", "sequence_parallel", "schedule", "stages_per_rank", "micro_batch")


def _int(name: str, value, least: int = 1) -> int:
    if not is_int(value) or not least <= value <= MAX:
        raise ConfigError(f"{name}={repr(value)[:40]}: expected an integer in [{least}, 2^40]")
    return value


#: What a model config the planner prices must name: without them it would price the config's defaults, a toy model.
SIZE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads")


def sized_config(d: object, where: str) -> TransformerConfig:
    """A model config of the planner's (a layouts line's ``model`` object, a config file): its size
    named, the rest as :meth:`TransformerConfig.from_dict` takes it."""
    if isinstance(d, dict):
        lacking = [k for k in SIZE_KEYS if k not in d]
        if lacking:
            raise ConfigError(f"{where}: a model config without {', '.join(lacking)}: expected the model's size "
                              f"(e.g. {{\"vocab_size\": 128256, \"dim\": 4096, \"n_layers\": 32, \"n_heads\": 32}}) "
                              f"or a preset's name")
    return TransformerConfig.from_dict(d)


@dataclass(frozen=True, kw_only=True)
class PlanLayout:
    """A layout to predict: ``gpus`` devices of kind ``gpu`` (or a ``site``'s), ``global_batch``
    sequences of ``seq_len`` tokens per step, degrees tp x cp x pp x dp = gpus (dp inferred),
    ep folded over cp x dp, ZeRO stage ``zero`` over the data-parallel ranks."""

    model: str | TransformerConfig
    """A preset name, a path to a Hugging Face ``config.json`` (or its directory) or to hpcml's
    model config, or the config itself (in JSON: an object of its fields)."""
    gpus: int
    seq_len: int
    global_batch: int
    gpu: str | None = None
    site: str | None = None
    gpus_per_node: int | None = None
    """Devices per node when the machine's differ from the device's default (a 4-GPU H100 node):
    tensor parallelism stays within a node, and what crosses nodes takes the inter-node links
    (each device keeps its own share of them). None: the device's (or site's) own."""
    node_injection_gbps: float | None = None
    """The node's bandwidth off the node in GB/s (bytes), one direction, its network interfaces together
    -- as a site file gives it: 4 x 100 Gb/s Omni-Path is 50, 8 x 400 Gb/s NDR 400 -- when not the
    device's (or site's) own: every device of the node takes an equal share."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    """0: replicated (DDP); 1: optimizer state sharded (Megatron's distributed optimizer); 2: FSDP
    without resharding after forward (hpcml's ``--fsdp --zero2``: everything sharded at rest,
    every block gathered from forward to backward); 3: FSDP (``--fsdp``)."""
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    attention: str = "flash"
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    precision: str = "bf16"
    """bf16 (mixed precision), fp32, or fp8: bf16 training whose linear layers' matmuls run in FP8
    (TransformerEngine, torchao's float8) at the device's FP8 peak; attention, the output layer
    and the memory as bf16 (the FP8 copies of the weights and of the saved inputs are not counted)."""
    reduce_dtype: str = "fp32"
    """The data-parallel gradient reduction's dtype: fp32 (hpcml's, and Megatron's and torchtitan's
    defaults) or bf16 (FSDP2's ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``, Megatron without
    ``--accumulate-allreduce-grads-in-fp32``): half the bytes on the wire; Megatron's main gradients
    are the buffer it reduces, so they are held in it too."""
    grad_sync: str | None = None
    """FSDP (``zero`` 2 or 3) under gradient accumulation: microbatch (reduce-scatter each
    micro-batch's gradients: FSDP2's default, torchtitan's, DeepSpeed's ZeRO-2/3) or step (once,
    after the last: every rank holds its unsharded gradients meanwhile; hpcml's ``--grad-sync
    step``). None: the framework's default, microbatch; step under a pipeline, whose schedule
    reduces after the last backward only."""
    framework: str = "hpcml"
    activation: str | None = None
    norm: str | None = None
    bias: bool | None = None
    positions: str | None = None
    """The model's blocks, where they differ from its config: activation swiglu or gelu (the
    MLP's width kept), norm rmsnorm or layernorm, bias (every projection's and norm's),
    positions rope, learned or alibi. None: the model's own (``TransformerConfig``'s fields)."""
    master_weights: str = "fp32"
    """How the optimizer keeps its master copy of the bf16 weights (``framework`` megatron, zero
    0-1): fp32 (Megatron-core's distributed optimizer: 4 bytes a parameter) or remainder (NeMo's
    Apex distributed Adam, ``store_param_remainders``: the 16 low bits the bf16 weight drops, which
    with it make the fp32 value: 2 bytes)."""
    fp8_params: bool = False
    """Weights held in FP8 alone (Transformer Engine's ``fp8_model_init``, NeMo's ``fp8_params``;
    precision fp8, framework megatron): 1 byte a parameter, all-gathered as such; the optimizer
    keeps fp32 master weights (NeMo's distributed Adam then stores them whole)."""
    loss: str = "eager"
    """eager: the fp32 log-softmax of every logit kept and its gradient made whole (torch's
    ``cross_entropy``, hpcml's trainer without FPDT); fused: a loss kernel that keeps the
    logits and writes their gradient over them (flash-attn's or Liger's cross-entropy,
    llm-foundry's default). FPDT's chunked loss is ``fpdt_chunk``'s."""
    cp_kind: str = "ulysses"
    """How cp splits attention: ulysses (an all-to-all of q, k, v and the output; heads divisible by
    cp) or allgather (keys and values all-gathered, no heads split: Llama 3's form, any kv heads)."""
    pipeline_split: str | None = None
    """How a pipeline's blocks are split over its stages: blocks (the blocks alone, at least one a
    stage: hpcml's trainer, Megatron's default, DeepSpeed) or ends (the embedding and the output
    count as a block each, so the first and last stages hold one block fewer: torchtitan's default,
    Megatron's ``--account-for-embedding/loss-in-pipeline-split``, Llama 3 405B's). None: the
    framework's default."""
    loss_chunk: int = 0
    """hpcml's ``--loss-chunk``: the output layer and loss this many positions at a time, their
    gradients taken in forward (no whole logits; without pp, FPDT and sequence parallelism)."""
    fpdt_chunk: int = 0
    """FPDT on cp (hpcml's ``--fpdt-chunk``): positions per chunk per rank; attention, MLP and
    loss run chunk by chunk (docs/parallel.md). 0: plain Ulysses."""
    dp_replicate: int = 1
    """HSDP (``zero`` 2 or 3): the data ranks in this many replicas, each sharding over its own
    consecutive dp x cp / dp_replicate ranks, gradients all-reduced across replicas."""
    hpz: bool = False
    """ZeRO++'s hpZ (``zero`` 3): backward gathers a secondary shard over the node's data ranks."""
    qwz: bool = False
    """ZeRO++'s qwZ (``zero`` 2 or 3): weights all-gathered in int8, a scale per ``quant_block``."""
    qgz: bool = False
    """ZeRO++'s qgZ (``zero`` 2 or 3): gradients reduce-scattered inside the node, int8 across."""
    quant_block: int = 256
    compile: bool = False
    """Each block compiled by ``torch.compile`` (torchtitan's ``training.compile``): its elementwise
    work fused into fewer kernels (:attr:`~hpcml.plan.constants.Constants.compiled_passes`)."""
    overlap: bool = False
    """Communication overlapped by the framework beyond what its schedule does anyway: tensor-
    parallel traffic with the matmuls (async TP, userbuffers) and data-parallel gradients and
    parameters with the compute of every micro-batch (Megatron-core's ``--overlap-grad-reduce
    --overlap-param-gather --tp-comm-overlap``)."""
    degrees_checked: InitVar[bool] = True
    """False: only the fields are checked, not how the degrees split the devices and the batch
    (the search's starting point, whose degrees it replaces)."""

    def __post_init__(self, degrees_checked: bool = True) -> None:
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", sized_config(self.model, "model"))
        if not (isinstance(self.model, TransformerConfig) or isinstance(self.model, str) and self.model):
            raise ConfigError(f"model={str(self.model)[:80]!r}: expected a preset name, a config path or a "
                              f"TransformerConfig")
        if isinstance(self.model, TransformerConfig) and self.model.n_layers > MAX_LAYERS:
            raise ConfigError(f"model n_layers {self.model.n_layers}: expected at most {MAX_LAYERS}")
        for name in ("gpus", "seq_len", "global_batch", "tp", "pp", "cp", "ep", "micro_batch"):
            _int(name, getattr(self, name))
        if self.stages_per_rank is not None:
            _int("stages_per_rank", self.stages_per_rank)
        n = self.gpus_per_node
        if n is not None and (not is_int(n) or not 1 <= n <= 64):
            raise ConfigError(f"gpus_per_node={repr(n)[:40]}: expected an integer in [1, 64]")
        g = self.node_injection_gbps
        if g is not None and not (is_real(g) and 0.1 <= g <= 1e4):
            raise ConfigError(f"node_injection_gbps={repr(g)[:40]}: expected GB/s (bytes) in [0.1, 10000]: the "
                              f"node's network interfaces together, e.g. 50 for 4 x 100 Gb/s")
        for name in ("gpu", "site"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= 64):
                raise ConfigError(f"{name}={repr(value)[:40]}: expected a name")
        _int("zero", self.zero, least=0)
        _int("dp_replicate", self.dp_replicate)
        _int("quant_block", self.quant_block)
        for name in ("hpz", "qwz", "qgz"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected true or false")
        if (self.dp_replicate > 1 or self.qwz or self.qgz) and self.zero < 2 or self.hpz and self.zero != 3:
            raise ConfigError(f"dp_replicate {self.dp_replicate}, hpz {self.hpz}, qwz {self.qwz}, qgz {self.qgz} "
                              f"with zero {self.zero}: they shard FSDP's collectives (zero 2 or 3; hpz: zero 3)")
        if self.hpz and self.dp_replicate > 1 or self.qgz and self.dp_replicate > 1:
            raise ConfigError(f"dp_replicate {self.dp_replicate} with hpz {self.hpz}, qgz {self.qgz}: hybrid "
                              f"sharding keeps its shards inside the node; hpz and qgz are for FSDP over every rank")
        _int("fpdt_chunk", self.fpdt_chunk, least=0)
        _int("loss_chunk", self.loss_chunk, least=0)
        if self.loss_chunk and (self.framework != "hpcml" or self.fpdt_chunk or self.sequence_parallel or self.pp > 1
                                or self.loss != "eager"):
            raise ConfigError(f"loss_chunk {self.loss_chunk} with framework {self.framework}, fpdt_chunk "
                              f"{self.fpdt_chunk}, sequence_parallel {self.sequence_parallel}, pp {self.pp}, loss "
                              f"{self.loss}: hpcml's chunked loss runs without them (other frameworks: loss fused)")
        if self.fpdt_chunk and self.cp_kind != "ulysses":
            raise ConfigError(f"fpdt_chunk {self.fpdt_chunk} with cp_kind {self.cp_kind}: FPDT runs on Ulysses")
        if self.fpdt_chunk and self.framework != "hpcml":
            raise ConfigError(f"fpdt_chunk {self.fpdt_chunk} with framework {self.framework}: FPDT is planned for "
                              f"hpcml")
        if self.zero > 3:
            raise ConfigError(f"zero={self.zero}: expected 0, 1, 2 or 3")
        if self.grad_sync is not None:
            if self.grad_sync not in GRAD_SYNCS:
                raise ConfigError(f"grad_sync={self.grad_sync!r}: expected one of {', '.join(GRAD_SYNCS)}")
        if self.pipeline_split is not None and self.pipeline_split not in PIPELINE_SPLITS:
            raise ConfigError(f"pipeline_split={self.pipeline_split!r}: expected one of {', '.join(PIPELINE_SPLITS)}")
        if self.pipeline_split == "ends" and self.framework in ("hpcml", "deepspeed"):
            raise ConfigError(f"pipeline_split ends with framework {self.framework}: its pipeline splits the blocks "
                              f"alone (torchtitan's split counts the embedding and the output; Megatron's with "
                              f"--account-for-embedding/loss-in-pipeline-split)")
        for name, allowed in (("recompute", RECOMPUTE), ("attention", ATTENTION), ("precision", PRECISIONS),
                              ("framework", FRAMEWORKS), ("reduce_dtype", REDUCE_DTYPES),
                              ("loss", LOSSES), ("cp_kind", CP_KINDS), ("master_weights", MASTER_WEIGHTS),
                              ("schedule", PP_SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("positions", POSITIONS)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {', '.join(allowed)}")
        if self.bias is not None and not isinstance(self.bias, bool):
            raise ConfigError(f"bias={self.bias!r}: expected true or false")
        for name in ("sequence_parallel", "overlap", "fp8_params", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected true or false")
        if self.compile and self.framework != "torchtitan":
            raise ConfigError(f"compile with framework {self.framework}: torch.compile of each block is torchtitan's "
                              f"(framework torchtitan); hpcml's trainer runs its blocks eager, Megatron and DeepSpeed "
                              f"their own fused kernels -- drop compile")
        if (self.gpu is None) == (self.site is None):
            raise ConfigError(f"gpu={self.gpu!r}, site={self.site!r}: give exactly one of them")
        if self.fp8_params and (self.precision != "fp8" or self.framework != "megatron"):
            raise ConfigError(f"fp8_params with precision {self.precision}, framework {self.framework}: weights held "
                              f"in FP8 are Transformer Engine's (precision fp8, framework megatron)")
        if self.master_weights == "remainder" and (self.framework != "megatron" or self.zero > 1
                                                   or self.precision == "fp32" or self.fp8_params):
            raise ConfigError(f"master_weights remainder with framework {self.framework}, zero {self.zero}, precision "
                              f"{self.precision}, fp8_params {self.fp8_params}: remainders complete bf16 weights in "
                              f"NeMo's distributed Adam (framework megatron, zero 0-1, bf16 or fp8 matmuls, "
                              f"weights not in FP8)")
        why = deepspeed_refuses(self.pp, self.zero, self.schedule, self.overlap) if self.framework == "deepspeed" \
            else None
        if why:
            raise ConfigError(why)
        if degrees_checked:
            self._check_degrees()

    def _check_degrees(self) -> None:
        check_degrees(self)

    def with_degrees(self, **degrees) -> PlanLayout:
        """This layout with other degrees, micro-batch, schedule or sequence parallelism (the search's
        loop), checked by the rules that read them (``replace`` checked every field again)."""
        unknown = sorted(set(degrees) - set(_DEGREE_FIELDS))
        if unknown:
            raise ConfigError(f"with_degrees({', '.join(unknown)}): expected some of {', '.join(_DEGREE_FIELDS)}")
        out = self.unchecked(**degrees)
        plain = all(is_int(v) and 1 <= v <= MAX for v in (getattr(out, k) for k in
                    ("tp", "pp", "cp", "ep", "micro_batch", "stages_per_rank")) if v is not None) \
            and isinstance(out.sequence_parallel, bool)
        if not plain or out.framework == "deepspeed" or out.grad_sync or out.loss_chunk \
                or out.schedule not in PP_SCHEDULES:
            return replace(out)  # the rules these fields meet beyond the degrees', named by the full check
        out._check_degrees()
        return out

    def with_zero(self, zero: int) -> PlanLayout:
        """This layout at another ZeRO stage, checked in full only where a rule reads the stage beyond
        its range (hybrid or quantized sharding, NeMo's remainders, DeepSpeed's, a gradient sync)."""
        out = self.unchecked(zero=zero)
        if not (is_int(zero) and 0 <= zero <= 3) or out.framework == "deepspeed" or out.grad_sync \
                or out.dp_replicate > 1 or out.qwz or out.qgz or out.hpz or out.master_weights == "remainder":
            return replace(out)
        return out

    def with_recompute(self, recompute: str) -> PlanLayout:
        """This layout with another recompute mode, without checking the rest again: no other field's
        rule depends on it (the search's inner loop: a full check per mode was a fifth of a search)."""
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)}")
        return self.unchecked(recompute=recompute)

    def unchecked(self, **values) -> PlanLayout:
        """A copy with ``values`` set and nothing checked, for callers that check what they set (a
        search's inner loop, where ``copy.copy`` took a tenth of it)."""
        out = object.__new__(type(self))
        fields_ = self.__dict__.copy()
        fields_.update(values)
        object.__setattr__(out, "__dict__", fields_)
        return out

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def fsdp_piped(self) -> bool:
        """FSDP inside ``torch.distributed.pipelining``'s stages (hpZ apart; hpcml's, torchtitan's and
        Megatron's alike): no backward but the last reshards or reduces, so a stage is gathered once a
        step (once more in each backward at ZeRO-3) and its gradients reduced once."""
        return self.zero >= 2 and self.pp > 1 and not self.hpz

    @property
    def step_sync(self) -> bool:
        """FSDP's gradients reduce-scattered once a step, after the last micro-batch (held unsharded
        until then): under a pipeline, or where :attr:`grad_sync` says step."""
        return self.zero >= 2 and (self.pp > 1 or self.grad_sync == "step")

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each pipeline (gradient accumulation without pp)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def split(self) -> str:
        """The rule that splits the blocks over stages (:data:`hpcml.plan.memory.SPLITS`): ends where
        :attr:`pipeline_split` says so or torchtitan's default; the blocks alone otherwise, the
        remainder to the first stages in torchtitan (``first``), to the middle ones elsewhere."""
        titan = self.framework == "torchtitan"
        if self.pipeline_split == "ends" or self.pipeline_split is None and titan:
            return "ends"
        return "first" if titan else "blocks"

    @property
    def v(self) -> int:
        """Pipeline stages per rank."""
        return self.stages_per_rank or (2 if self.schedule == "interleaved1f1b" else 1)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if isinstance(self.model, TransformerConfig):
            d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, **defaults) -> PlanLayout:
        """A layout from a JSON object (the option names with underscores; ``fsdp: true`` is
        ``zero: 3``); ``defaults`` fill keys the object lacks. Unknown keys are refused."""
        if not isinstance(d, dict):
            raise ConfigError(f"a layout must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        if "fsdp" in d:
            fsdp = d.pop("fsdp")
            if not isinstance(fsdp, bool):
                raise ConfigError(f"fsdp={fsdp!r}: expected true or false")
            if "zero" in d and (d["zero"] == 3) != fsdp:
                raise ConfigError(f"fsdp={str(fsdp).lower()} with zero={d['zero']!r}: fsdp is zero 3")
            d.setdefault("zero", 3 if fsdp else 0)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            near = [m[0] for k in unknown[:8] if (m := difflib.get_close_matches(str(k)[:100], known | {"fsdp"}, n=1))]
            raise ConfigError(f"layout keys {unknown} unknown: {f'did you mean {near}? ' if near else ''}"
                              f"expected some of {sorted(known | {'fsdp'})}")
        merged = {**{k: v for k, v in defaults.items() if v is not None}, **d}
        if merged.get("gpu") is not None and "site" in d and d["site"] is not None:
            merged.pop("gpu")
        if merged.get("site") is not None and "gpu" in d and d["gpu"] is not None:
            merged.pop("site")
        missing = sorted({"model", "gpus", "seq_len", "global_batch"} - set(merged))
        if missing:
            raise ConfigError(f"layout lacks {missing}")
        return cls(**merged)
