"""One layout in, one prediction out: does it fit, how long a step takes, tokens/s and MFU,
and in words why (what fills the memory, or where the step's time goes)."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from hpcml import safeio
from hpcml.errors import ConfigError, GridError, HpcmlError
from hpcml.grid.layout import Layout
from hpcml.models.transformer.config import TransformerConfig
from hpcml.models.transformer.presets import PRESETS
from hpcml.models.transformer.rules import check_plan
from hpcml.numeric import is_real
from hpcml.parallel.config import ParallelConfig
from hpcml.plan import calibration, devfile, traffic
from hpcml.plan.devices import Device, device, site_device
from hpcml.plan.memory import memory
from hpcml.plan.placement import stage_layer_lists
from hpcml.plan.candidate import MAX_LAYERS, PlanLayout, sized_config
from hpcml.plan.constants import Constants, reserved_gib
from hpcml.plan.timing import step_time

MAX_CONFIG_BYTES = 1 << 20
MAX_LINE = 4096


def load_model(spec: str | TransformerConfig) -> TransformerConfig:
    """A preset by name, or a model config file: Hugging Face's ``config.json`` (or its
    directory) or hpcml's (the ``TransformerConfig`` fields, as a checkpoint stores them)."""
    return _source(spec)[0]


def hf_dir(spec: str | TransformerConfig) -> Path | None:
    """The directory of the Hugging Face config ``spec`` names (``llm_pretrain.py --init-from``
    takes it), or None for a preset, hpcml's config or a config object."""
    return _source(spec)[1]


@lru_cache(maxsize=64)
def near_preset(name: str) -> str:
    """``"did you mean 'x'? "`` for the preset nearest a misspelt ``name``, or ``""``."""
    near = difflib.get_close_matches(name[:200], list(PRESETS), n=1)
    return f"did you mean {near[0]!r}? " if near else ""


def _source(spec: str | TransformerConfig) -> tuple[TransformerConfig, Path | None]:
    """:func:`load_model` and :func:`hf_dir` at once: each file is read once."""
    if isinstance(spec, TransformerConfig):
        return spec, None
    if spec in PRESETS:
        return PRESETS[spec], None
    from hpcml.interop.hf_files import model_json

    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"model {spec[:200]!r} is neither a preset ({near_preset(spec)}the presets: "
                          f"{', '.join(PRESETS)}) nor an existing config path")
    file = path / "config.json" if path.is_dir() else path
    try:  # a regular file, opened without blocking, at most MAX_CONFIG_BYTES read
        data = model_json(file.parent, file.name, MAX_CONFIG_BYTES)
    except RecursionError:
        raise ConfigError(f"model config {file}: JSON nested too deeply") from None
    if isinstance(data, dict) and "model_type" in data:
        from hpcml.interop.hf import config_from_hf

        if file.name != "config.json":
            raise ConfigError(f"model config {file}: a Hugging Face config must be named config.json")
        return config_from_hf(file.parent), file.parent
    if isinstance(data, dict) and isinstance(data.get("model"), dict):  # a run directory's config.json
        data = data["model"].get("config", data["model"])
    return sized_config(data, f"model config {file}"), None


@lru_cache(maxsize=1024)
def _flops_per_token(cfg: TransformerConfig, seq_len: int) -> float:
    return cfg.flops_per_token(seq_len)


@lru_cache(maxsize=1024)
def blocks(cfg: TransformerConfig, activation: str | None, norm: str | None, bias: bool | None,
           positions: str | None = None) -> TransformerConfig:
    """``cfg`` with the blocks a layout names (its MLP's width kept); ConfigError where the
    model cannot have them (a GeLU MLP with experts)."""
    return cfg.with_blocks(activation, norm, bias, positions)


def resolve_device(lay: PlanLayout) -> Device:
    """The layout's device (its site's, or ``gpu``), at the share of its peak calibrated for it,
    with ``lay.gpus_per_node`` of them a node when given; a device file's (``--device-file``) as
    one of ``lay.gpus`` ranks."""
    df = devfile.registered(lay.gpu)
    if df is not None:
        dev = df.resolve(lay.gpus)
    else:
        dev = calibration.calibrated(site_device(lay.site) if lay.site else device(lay.gpu))
    n = lay.gpus_per_node
    if n is not None and n != dev.gpus_per_node:
        dev = replace(dev, name=f"{dev.name}x{n}", gpus_per_node=n)
    if lay.node_injection_gbps is not None:  # a node's, shared by its devices
        dev = replace(dev, name=f"{dev.name}@{lay.node_injection_gbps:g}GBps",
                      inter_gbps=lay.node_injection_gbps / dev.gpus_per_node)
    return dev


def tied(cfg: TransformerConfig, framework: str, tp: int, pp: int, model: str | TransformerConfig
         ) -> tuple[TransformerConfig, TransformerConfig, bool, str | None]:
    """How ``framework`` runs ``cfg``'s tied embedding at ``tp`` x ``pp``: (the config its plan's
    rules check, the config it is priced as, whether the last stage holds a copy, why the framework
    refuses it, or None). Megatron ties across a pipeline -- the last stage keeps a copy as its
    output layer (its own gradient, all-reduced with the first's once a step, and optimizer state);
    torchtitan ties under tp only (its model configs raise ``NotImplementedError`` for weight tying
    with pipeline parallelism); hpcml's trainer neither, unless ``llm_pretrain.py --init-from``
    unties a Hugging Face model's (its rules say why)."""
    if not cfg.tie_embeddings or (tp == 1 and pp == 1):
        return cfg, cfg, False, None
    untied = replace(cfg, tie_embeddings=False)
    if framework == "hpcml":
        return (untied, untied, False, None) if hf_dir(model) is not None else (cfg, cfg, False, None)
    if framework == "torchtitan" and pp > 1:
        return cfg, cfg, False, (f"torchtitan does not tie the embedding under pipeline parallelism (pp {pp}): its "
                                 f"model configs refuse weight tying with pp > 1 -- untie it (tie_embeddings false) "
                                 f"or use pp 1")
    return untied, (untied if pp > 1 else cfg), pp > 1, None


MEGATRON_MOE_SP = ("Megatron runs a MoE model under tp with sequence parallelism only (\"When using MoE and tensor "
                   "parallelism, sequence parallelism must be used.\") -- add sequence_parallel, or tp 1")


def megatron_wants_sp(cfg: TransformerConfig, framework: str, tp: int) -> bool:
    """Megatron refuses a MoE model under tp without sequence parallelism (its argument checks)."""
    return framework == "megatron" and cfg.n_experts > 0 and tp > 1


def model_rules(cfg: TransformerConfig, lay: PlanLayout) -> str | None:
    """Why the model's plan refuses ``lay``, or None (the rules the trainer checks before it builds)."""
    if megatron_wants_sp(cfg, lay.framework, lay.tp) and not lay.sequence_parallel:
        return MEGATRON_MOE_SP
    # the trainer's refusals of sequence parallelism (with cp, with experts, with learned positions)
    # are hpcml's own: Megatron, torchtitan and DeepSpeed run SP with each of them
    sp = lay.sequence_parallel and lay.framework == "hpcml"
    why = plan_rules(cfg, lay.gpus, lay.tp, lay.cp, lay.pp, lay.ep, lay.zero >= 2, sp,
                     lay.schedule, lay.stages_per_rank, lay.cp_kind, lay.split)
    stages, units = lay.pp * lay.v, cfg.n_layers + 2
    if not why and lay.framework == "megatron" and lay.split == "ends" and lay.pp > 1 and units % stages:
        return (f"framework megatron with pipeline_split ends: n_layers {cfg.n_layers} + the embedding and the "
                f"output = {units} is not divisible by pp {lay.pp} x {lay.v} stages per rank = {stages} (Megatron's "
                f"--account-for-embedding/loss-in-pipeline-split split whole layers evenly)")
    if why and lay.split != "ends" and lay.framework in ("torchtitan", "megatron") and lay.pp > 1 and (
            lay.framework == "torchtitan" or units % stages == 0) and plan_rules(
            cfg, lay.gpus, lay.tp, lay.cp, lay.pp, lay.ep, lay.zero >= 2, sp, lay.schedule, lay.stages_per_rank,
            lay.cp_kind, "ends") is None:  # the split alone refuses it
        why += f"; {lay.framework} takes it with pipeline_split ends (the embedding and the output a stage's block)"
    return why


@lru_cache(maxsize=65536)
def plan_rules(cfg: TransformerConfig, gpus: int, tp: int, cp: int, pp: int, ep: int, fsdp: bool, sp: bool,
               schedule: str, stages_per_rank: int | None, cp_kind: str = "ulysses", split: str = "blocks"
               ) -> str | None:
    """:func:`model_rules` by the degrees alone (cached): what a search asks before it builds a layout
    (``split``: whose rule splits the blocks over the stages, :attr:`PlanLayout.split`)."""
    try:
        grid = Layout(world_size=gpus, tp=tp, cp=cp, pp=pp, ep=ep)
        config = ParallelConfig(fsdp=fsdp, sequence_parallel=sp, pp_schedule=schedule,
                                stages_per_rank=stages_per_rank, cp_kind=cp_kind)
        check_plan(cfg, grid, config, stages=split != "ends")
        if split == "ends" and pp > 1:
            stage_layer_lists(cfg.n_layers, pp * config.n_stages_per_rank, split)
    except (ConfigError, GridError) as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Prediction:
    layout: PlanLayout
    fits: bool
    memory_gib: dict[str, float]
    step_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    why: str
    parts_s: dict[str, float]
    dp_bytes: dict[str, float] = field(default_factory=dict)
    """FSDP's bytes a data rank sends a step inside and across nodes (:mod:`hpcml.plan.traffic`)."""

    def to_dict(self) -> dict:
        lay = self.layout.to_dict()
        if self.layout.pp > 1:  # what was priced, the framework's defaults resolved
            lay |= {"pipeline_split": "ends" if self.layout.split == "ends" else "blocks",
                    "stages_per_rank": self.layout.v}
        if self.layout.zero >= 2:
            lay["grad_sync"] = "step" if self.layout.step_sync else "microbatch"
        timed = math.isfinite(self.step_s)  # (a refused layout, or one not timed, has no rate: null, not 0)
        r = {"layout": lay, "fits": self.fits,
             "memory_gib": {k: round(v, 3) for k, v in self.memory_gib.items()},
             "step_s": _sig(self.step_s) if timed else None,
             "tokens_per_s": _sig(self.tokens_per_s) if timed else None, "mfu": round(self.mfu, 4) if timed else None,
             "hfu": round(self.hfu, 4) if timed else None, "why": self.why,
             "time_s": {k: _sig(v) for k, v in self.parts_s.items()}}
        if self.dp_bytes:
            r["dp_bytes"] = {k: int(v) for k, v in self.dp_bytes.items()}
        return r


def _sig(x: float) -> float:
    return float(f"{x:.5g}")


def predict(lay: PlanLayout, constants: Constants | None = None) -> Prediction:
    """The prediction for ``lay`` (model rules broken: ``fits`` False and the rule in ``why``)."""
    dev = resolve_device(lay)
    return evaluate(load_model(lay.model), dev, constants or calibration.constants(dev), lay)


def planned(cfg: TransformerConfig, dev: Device, lay: PlanLayout) -> tuple[TransformerConfig, bool, str | None]:
    """The model as ``lay`` runs it (its block keys, a tied embedding's copy), whether the last stage
    holds that copy, and the model's rule ``lay`` breaks (None if none)."""
    if cfg.n_layers > MAX_LAYERS:
        raise ConfigError(f"model n_layers {cfg.n_layers}: expected at most {MAX_LAYERS}")
    if lay.activation is not None or lay.norm is not None or lay.bias is not None or lay.positions is not None:
        cfg = blocks(cfg, lay.activation, lay.norm, lay.bias, lay.positions)
    rules_cfg, cfg, tied_copy, refused = tied(cfg, lay.framework, lay.tp, lay.pp, lay.model)
    if lay.precision == "fp8" and dev.fp8_tflops is None:
        raise ConfigError(f"precision fp8 on {dev.name}: it has no FP8 tensor cores (an H100 or H200 has)")
    return cfg, tied_copy, refused or model_rules(rules_cfg, lay)


def memory_gib(cfg: TransformerConfig, dev: Device, c: Constants, lay: PlanLayout) -> float:
    """:func:`evaluate`'s memory total alone, in GiB (infinite where the model's rules refuse ``lay``):
    what the search asks of a layout it would not time."""
    cfg, _, refused = planned(cfg, dev, lay)
    if refused:
        return math.inf
    return memory(cfg, lay, reserved_gib(c, lay.zero) * (1 << 30), dev.gpus_per_node).total / (1 << 30)


def tokens_per_s(cfg: TransformerConfig, dev: Device, c: Constants, lay: PlanLayout) -> float:
    """:func:`evaluate`'s tokens/s alone (0 where the model's rules refuse ``lay``): the fit's inner loop."""
    cfg, tied_copy, refused = planned(cfg, dev, lay)
    return 0.0 if refused else lay.global_batch * lay.seq_len / step_time(cfg, lay, dev, c, tied_copy=tied_copy).step_s


def evaluate(cfg: TransformerConfig, dev: Device, c: Constants, lay: PlanLayout, *, time_if_oom: bool = True,
             traffic: bool = True) -> Prediction:
    """:func:`predict` with the model, device and constants resolved (the search's inner loop).
    A sequence longer than the model's ``max_seq_len`` is planned as if it were raised (rotary
    tables are the only thing it sizes). ``traffic``: count the data-parallel bytes (a search
    counts them for its best alone)."""
    cfg, tied_copy, refused = planned(cfg, dev, lay)
    if refused:
        return Prediction(lay, False, {}, float("nan"), 0.0, 0.0, 0.0, f"the model's plan refuses it: {refused}", {})
    mem = memory(cfg, lay, reserved_gib(c, lay.zero) * (1 << 30), dev.gpus_per_node)
    gib = mem.gib()
    cap = dev.memory_gib
    fits = gib["total"] <= cap
    if not fits and not time_if_oom:
        return Prediction(lay, False, gib, float("nan"), 0.0, 0.0, 0.0, "out of memory", {})
    t = step_time(cfg, lay, dev, c, tied_copy=tied_copy)
    tokens = lay.global_batch * lay.seq_len / t.step_s
    peak = lay.gpus * dev.peak_tflops * 1e12
    mfu = _flops_per_token(cfg, lay.seq_len) * tokens / peak
    hfu = t.flops_per_rank / t.step_s / (dev.peak_tflops * 1e12)
    parts = {"compute": t.compute_s, "tp": t.tp_s, "cp": t.cp_s, "ep": t.ep_s, "pp_p2p": t.pp_s, "bubble": t.bubble_s,
             "dp": t.dp_s, "optimizer": t.optimizer_s}
    if not fits:
        big = max(("params", "grads", "optimizer", "activations", "buffers"), key=lambda k: gib[k])
        why = (f"needs {gib['total']:.1f} GiB on pipeline rank {mem.pp_rank}, the device has {cap:.1f}: "
               f"{big} {gib[big]:.1f} GiB is the largest part")
    else:
        top = sorted(((v, k) for k, v in parts.items() if v > 0), reverse=True)[:3]
        why = (f"{gib['total']:.1f} of {cap:.1f} GiB; step " + ", ".join(f"{k} {v / t.step_s:.0%}" for v, k in top))
    sent = dp_traffic(cfg, dev, lay) if traffic else {}
    return Prediction(lay, fits, gib, t.step_s, tokens, mfu, hfu, why, parts, sent)


def dp_traffic(cfg: TransformerConfig, dev: Device, lay: PlanLayout) -> dict[str, float]:
    """:attr:`Prediction.dp_bytes` of ``lay`` (empty when it sends none)."""
    sent = traffic.dp_bytes(cfg, lay, lay.gpus_per_node or dev.gpus_per_node)
    return sent if any(sent.values()) else {}


MEASURED = ("step_s", "tokens_per_s")
#: A measured figure's range: a step of under a microsecond, or past 10^12 tokens/s, was not measured.
MEASURED_RANGE = (1e-6, 1e12)


def measured_ok(v: object) -> bool:
    """``v`` is a measured step time or token rate: a real number within :data:`MEASURED_RANGE`."""
    return is_real(v) and math.isfinite(v) and MEASURED_RANGE[0] <= v < MEASURED_RANGE[1]


def pop_measured(d: dict, where: str = "") -> tuple[str, float] | None:
    """Take a layout line's measured ``step_s`` or ``tokens_per_s`` (all ranks) out of ``d``:
    ``(key, value)``, or None when it has neither; one line for both, or a value that is no
    positive number."""
    keys = [k for k in MEASURED if k in d]
    if not keys:
        return None
    prefix = f"{where}: " if where else ""
    if len(keys) > 1:
        raise ConfigError(f"{prefix}give exactly one of step_s (seconds a step) or tokens_per_s (all ranks)")
    v = d.pop(keys[0])
    if not measured_ok(v):
        raise ConfigError(f"{prefix}{keys[0]}={repr(v)[:40]}: expected a measured figure, a number from "
                          f"{MEASURED_RANGE[0]:g} to {MEASURED_RANGE[1]:g}")
    return keys[0], float(v)


def measured_step(lay: PlanLayout, key: str, value: float) -> float:
    """Seconds a step of ``lay`` took, from its measured ``step_s`` or ``tokens_per_s``."""
    return value if key == "step_s" else lay.global_batch * lay.seq_len / value


#: How deep a layout line's JSON may nest (a model given as an object, its fields one level below).
LINE_DEPTH = 8


def numbered(lines) -> list[tuple[int, str]]:
    """A layouts file's lines that hold something, stripped, with their 1-based numbers (blank ones skipped)."""
    return [(n, line.strip()) for n, line in enumerate(lines, 1) if line.strip()]


def predict_lines(lines, defaults: dict | None = None) -> list[dict]:
    """One prediction per JSON line, in order; a line that is not a valid layout gets
    ``{"error": "..."}`` in its place (the rest still run). A line with a measured ``step_s``
    or ``tokens_per_s`` also gets the prediction's error against it."""
    out = []
    for n, line in numbered(lines):
        if len(line) > MAX_LINE:
            out.append({"line": n, "error": f"line of {len(line)} characters: expected at most {MAX_LINE}"})
            continue
        try:
            d = safeio.parse_json(line, "a layout", max_depth=LINE_DEPTH, unique=True)
            if isinstance(d, dict) and isinstance(d.get("model"), str) and d["model"] not in PRESETS:
                raise ConfigError(f"model {d['model'][:80]!r}: a line of layouts names a preset "
                                  f"({near_preset(d['model'])}the presets: "
                                  f"{', '.join(PRESETS)}) or gives the config as an object; a config file's path "
                                  f"goes in --model (a file of layouts never makes hpcml read another file)")
            measured = pop_measured(d) if isinstance(d, dict) else None
            lay = PlanLayout.from_dict(d, **(defaults or {}))
            r = predict(lay).to_dict()
            if measured:  # a measured run (as `hpcml plan calibrate` reads them): the prediction's error
                step, got = measured_step(lay, *measured), r["step_s"]
                r |= {"measured_step_s": _sig(step), "step_error": None if got is None else round(got / step - 1, 4)}
            out.append(r)
        except (HpcmlError, ValueError, TypeError, RecursionError, OverflowError) as e:
            out.append({"line": n, "error": str(e).splitlines()[0]})
    return out

