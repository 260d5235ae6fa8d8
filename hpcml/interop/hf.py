"""Hugging Face Llama checkpoints in and out of :class:`~hpcml.models.transformer.Transformer`.

Out: :func:`export_hf` turns an hpcml checkpoint (any layout; its ``extra["model"]``
rebuilds the config) into a directory ``transformers.AutoModelForCausalLM`` loads.
In: :func:`config_from_hf` builds the config from ``config.json`` and :func:`load_hf_into`
fills a model on any layout, each rank reading only the rows and columns of its own
parameter pieces (``safe_open(...).get_slice``), so no rank holds the whole model.

The map lives here, with the model: names (``layers.i.attention.wq`` ->
``model.layers.i.self_attn.q_proj``), fused weights split by the config's widths, the
vocabulary padding dropped (out) or zero-filled (in), and the rotary convention: hpcml
rotates interleaved pairs ``(x[2i], x[2i+1])``, HF Llama the halves ``(x[i], x[i + d/2])``,
so q and k rows are permuted within each head (attention scores are unchanged by any
permutation applied to both). Files from HF are untrusted: sizes are bounded before
parsing, every tensor's dtype and shape is checked against the config before a byte of it
is read, and no path leads outside the directory. docs/huggingface.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcml import safeio
from hpcml.errors import CheckpointError, ConfigError, HpcmlError
from hpcml.interop.hf_config import config_from_checkpoint, config_from_hf, hf_config
from hpcml.interop.hf_files import SafetensorsDir
from hpcml.models.transformer.config import TransformerConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_SHARD_BYTES = 5 * 10**9
"""Largest safetensors file :func:`export_hf` writes (Hugging Face's default, 5 GB)."""

_BLOCK = {  # hpcml name within a block -> its HF parts, in fused order
    "attention.wq.weight": ("self_attn.q_proj",), "attention.wk.weight": ("self_attn.k_proj",),
    "attention.wv.weight": ("self_attn.v_proj",),
    "attention.wqkv.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.wo.weight": ("self_attn.o_proj",), "feed_forward.w1.weight": ("mlp.gate_proj",),
    "feed_forward.w3.weight": ("mlp.up_proj",), "feed_forward.w13.weight": ("mlp.gate_proj", "mlp.up_proj"),
    "feed_forward.w2.weight": ("mlp.down_proj",), "attention_norm.weight": ("input_layernorm",),
    "ffn_norm.weight": ("post_attention_layernorm",),
    "attention.wq.bias": ("self_attn.q_proj",), "attention.wk.bias": ("self_attn.k_proj",),
    "attention.wv.bias": ("self_attn.v_proj",),
    "attention.wqkv.bias": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
}
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class HFPart:
    """One HF tensor making up (part of) an hpcml parameter: rows ``width`` of it, along dim 0."""

    name: str
    width: int
    rope: bool
    """q or k rows: permuted within each head between the two rotary conventions."""


def hf_shapes(cfg: TransformerConfig, tied: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF Llama model of ``cfg`` and its shape, in HF's order (``tied``:
    no ``lm_head``; default the config's)."""
    d, hd, h = cfg.dim, cfg.head_dim, cfg.hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (cfg.n_heads * hd, d),
                    p + "self_attn.k_proj.weight": (cfg.kv_heads * hd, d),
                    p + "self_attn.v_proj.weight": (cfg.kv_heads * hd, d),
                    p + "self_attn.o_proj.weight": (d, cfg.n_heads * hd),
                    p + "mlp.gate_proj.weight": (h, d), p + "mlp.up_proj.weight": (h, d),
                    p + "mlp.down_proj.weight": (d, h),
                    p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (cfg.n_heads * hd,),
                        p + "self_attn.k_proj.bias": (cfg.kv_heads * hd,),
                        p + "self_attn.v_proj.bias": (cfg.kv_heads * hd,)})
    out["model.norm.weight"] = (d,)
    if not (cfg.tie_embeddings if tied is None else tied):
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def hf_parts(name: str, cfg: TransformerConfig, hf_tied: bool = False) -> list[HFPart]:
    """The HF tensors of hpcml parameter ``name`` (``hf_tied``: the HF model has no ``lm_head``,
    so hpcml's ``output`` reads the embedding)."""
    if name == "tok_embeddings.weight" or (name == "output.weight" and hf_tied):
        return [HFPart("model.embed_tokens.weight", cfg.vocab_size, False)]
    if name in ("norm.weight", "output.weight"):
        return [HFPart("model.norm.weight" if name == "norm.weight" else "lm_head.weight",
                       cfg.dim if name == "norm.weight" else cfg.vocab_size, False)]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m or m[2] not in _BLOCK:
        raise CheckpointError(f"{name!r} has no Hugging Face Llama name (expected a Transformer parameter)")
    hd = cfg.head_dim
    rows = {"q_proj": cfg.n_heads * hd, "k_proj": cfg.kv_heads * hd, "v_proj": cfg.kv_heads * hd,
            "gate_proj": cfg.hidden, "up_proj": cfg.hidden}
    kind = m[2].rsplit(".", 1)[1]  # weight or bias
    return [HFPart(f"model.layers.{m[1]}.{part}.{kind}", rows.get(part.rsplit(".", 1)[-1], cfg.dim),
                   part.endswith(("q_proj", "k_proj"))) for part in _BLOCK[m[2]]]


def rope_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k rows from hpcml's interleaved order to HF's halves: HF row ``c*d/2 + i`` of a head is
    hpcml row ``2i + c``."""
    return w.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2)


def hf_rows(rows, head_dim: int):
    """The HF row of each hpcml q/k row (numpy array in, array out): the inverse of :func:`rope_to_hf`."""
    j = rows % head_dim
    return rows - j + j // 2 + (j % 2) * (head_dim // 2)


# -- out ------------------------------------------------------------------------------------
def to_hf_weights(weights: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF tensors from hpcml's (unparallelised names, vocabulary padding stripped), checked complete."""
    out = {}
    for name, t in weights.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        parts = hf_parts(name, cfg)
        for part, piece in zip(parts, t.split([p.width for p in parts]) if len(parts) > 1 else [t]):
            out[part.name] = (rope_to_hf(piece, cfg.head_dim) if part.rope else piece).contiguous()
    want = hf_shapes(cfg)
    wrong = [f"{n} {list(out[n].shape)} (expected {list(s)})" for n, s in want.items()
             if n in out and tuple(out[n].shape) != s]
    missing = sorted(set(want) - set(out))
    if missing or wrong:
        raise CheckpointError(f"checkpoint weights do not make the model of its config: missing {missing[:4]}"
                              f"{'...' if len(missing) > 4 else ''}, mis-shaped {wrong[:4]}")
    return {n: out[n] for n in want}


def export_hf(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str | None = None) -> dict:
    """Write checkpoint ``ckpt_path`` as a HF Llama directory ``out_dir`` (new or empty):
    ``config.json`` and safetensors, sharded above ``max_shard_bytes`` with
    ``model.safetensors.index.json``. ``dtype``: float32, bfloat16 or float16 (default: as saved).
    Returns ``{"files", "bytes", "seconds", "read_seconds"}`` (reading the checkpoint, of the seconds)."""
    import torch
    from safetensors.torch import save_file

    from hpcml.ckpt.tools import model_weights

    t0 = time.perf_counter()
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    if max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export directory {out} exists and is not empty: name a new one")
    cfg = config_from_checkpoint(ckpt_path)  # before reading any weight
    if cfg.n_experts:
        raise ConfigError(f"{ckpt_path}: a mixture-of-experts model ({cfg.n_experts} experts) has no Hugging Face "
                          f"Llama form; export --format safetensors keeps its experts (expert index first)")
    weights = to_hf_weights(model_weights(ckpt_path), cfg)
    read_s = time.perf_counter() - t0
    if dtype is not None:
        weights = {n: t.to(getattr(torch, dtype)) for n, t in weights.items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, names in zip(files, shards):
        save_file({n: weights[n] for n in names}, str(out / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, ns in zip(files, shards) for n in ns}}
        safeio.replace(out / "model.safetensors.index.json", json.dumps(index, indent=2))
    saved_dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    safeio.replace(out / "config.json", json.dumps(hf_config(cfg, saved_dtype), indent=2))
    return {"files": files, "bytes": total, "seconds": time.perf_counter() - t0, "read_seconds": read_s}


# -- in -------------------------------------------------------------------------------------
@dataclass
class HFLoadReport:
    """What :func:`load_hf_into` read on this rank: ``bytes_read`` of the files' ``hf_bytes``."""

    bytes_read: int = 0
    hf_bytes: int = 0
    seconds: float = 0.0


def _check_fits(model: TransformerConfig, hf: TransformerConfig, path) -> None:
    keys = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "hidden", "rope_theta", "rope_llama3", "norm_eps",
            "qkv_bias")
    diff = [f"{k} {getattr(model, k)} vs {getattr(hf, k)}" for k in keys if getattr(model, k) != getattr(hf, k)]
    if model.tie_embeddings and not hf.tie_embeddings:
        diff.append("tie_embeddings True vs False (the HF model has its own lm_head)")
    if diff:
        raise ConfigError(f"{path} does not fit the model (model vs HF): {', '.join(diff)}")


def _fill(files: SafetensorsDir, name: str, p: torch.Tensor, cfg: TransformerConfig, hf_tied: bool) -> None:
    """Copy this rank's piece of parameter ``name`` from the HF files (its rows and columns only)."""
    import numpy as np

    from hpcml.ckpt.chunks import fused_boxes
    from hpcml.ckpt.state import fused_shards, local_piece

    local, _, offset = local_piece(p)
    if local.numel() == 0:
        return
    parts = hf_parts(name, cfg, hf_tied)
    boxes = ([(0, offset, tuple(local.shape))] if len(parts) == 1 else  # fused: sub-parameter rows of this rank
             fused_boxes([q.width for q in parts], 0, fused_shards(p, 0), offset, tuple(local.shape)))
    cols = (offset[1], offset[1] + local.shape[1]) if local.dim() == 2 else None
    for lo, off, shp in boxes:
        start = 0
        for part in parts:  # one part: every row (the padded vocabulary, past HF's rows, reads as zeros)
            end = start + part.width if len(parts) > 1 else off[0] + shp[0]
            a, b = max(off[0], start), min(off[0] + shp[0], end)
            if a < b:
                rows = np.arange(a - start, b - start)
                if part.rope:
                    rows = hf_rows(rows, cfg.head_dim)
                files.read_into(local.narrow(0, lo + a - off[0], b - a), part.name, rows, cols)
            start += part.width


def load_hf_into(target, path: str | os.PathLike, *, comm=None) -> HFLoadReport:
    """Fill ``target`` (a Trainer, a :class:`~hpcml.parallel.ParallelModel` or a Transformer;
    any layout) with the weights of the HF Llama directory ``path``. Each rank reads only its
    own parameter pieces. With ``comm`` (default the target's grid; collective: one small
    allgather) an error on any rank is raised on all. Not a resume: step and optimizer are untouched."""
    import torch

    t0 = time.perf_counter()
    model = getattr(target, "model", target)
    cfg: TransformerConfig = model.parts[0].config if hasattr(model, "parts") else model.config
    grid = getattr(model, "grid", None)
    comm = comm if comm is not None else getattr(grid, "comm", None)
    report, error = HFLoadReport(), None
    try:
        hf_cfg = config_from_hf(path)
        _check_fits(cfg, hf_cfg, path)
        with SafetensorsDir(path, hf_shapes(hf_cfg)) as files, torch.no_grad():
            for name, p in model.named_parameters():
                _fill(files, name, p, cfg, hf_cfg.tie_embeddings)
            report.bytes_read, report.hf_bytes = files.bytes_read, files.total_bytes
    except Exception as e:  # noqa: BLE001 -- a corrupt file fails one rank: every rank must hear of it
        error = e if isinstance(e, HpcmlError) else CheckpointError(f"{path}: reading failed: {type(e).__name__}: {e}")
    if comm is not None:
        errors = [e for e in comm.allgather(None if error is None else (type(error).__name__, str(error))) if e]
        if errors and error is None:
            raise (ConfigError if errors[0][0] == "ConfigError" else CheckpointError)(errors[0][1])
    if error is not None:
        raise error
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["HFLoadReport", "HFPart", "config_from_checkpoint", "config_from_hf", "export_hf", "hf_config", "hf_parts",
           "hf_shapes", "load_hf_into", "rope_to_hf", "to_hf_weights"]
