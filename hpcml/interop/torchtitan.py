"""hpcml's :class:`~hpcml.models.transformer.Transformer` under torchtitan's Llama3 names:
the map a DCP conversion (:mod:`hpcml.ckpt.dcp`) walks, and the two conversions.

Matched against torchtitan commit ``b5bcd76c66d0`` (2026-08-21): ``models/llama3/model.py``
on ``models/common/decoder.py`` (``tok_embeddings``, ``layers.<i>``, ``norm``, ``lm_head``)
and ``models/common/attention.py`` (``GQAttention.qkv_linear`` then ``wo``). Its Llama3
configs all build ``FusedQKVLinear`` (``fuse_qkv=True``): one ``qkv_linear.wqkv`` parameter
whose rows are grouped per key/value head, ``[q heads of group g; k_g; v_g]`` for each g,
and a state-dict hook that saves it as ``qkv_linear.wq/wk/wv`` -- so torchtitan's *model*
entries are split while its *optimizer* state (keyed by ``named_parameters``) stays fused in
that grouped order. hpcml's ``wqkv`` is ``[wq; wk; wv]``, its ``w13`` ``[w1; w3]``; torchtitan
has no fused feed-forward. Both rotate interleaved pairs (torchtitan's ``ComplexRoPE`` views
``(x[2i], x[2i+1])`` as one complex number, hpcml's ``apply_rope`` the same), so no row of
q or k is permuted (the Hugging Face adapters permute, for HF's half-split RoPE).
"""

from __future__ import annotations

import os
from dataclasses import replace

from hpcml.ckpt.dcp import Converted, ParamMap, Rows, export_titan
from hpcml.ckpt.dcp_import import carried_extra, import_titan
from hpcml.errors import CheckpointError, ConfigError
from hpcml.models.transformer.config import TransformerConfig

TORCHTITAN_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
"""The torchtitan commit whose names and checkpoint layout this map follows."""


def _attention(cfg: TransformerConfig, p: str, titan_fused_qkv: bool) -> list[ParamMap]:
    hd, kv = cfg.head_dim, cfg.kv_heads
    per = cfg.n_heads // kv  # query heads per key/value head
    nq, nkv, r = cfg.n_heads * hd, kv * hd, per + 2
    fused = f"{p}attention.qkv_linear.wqkv.weight"
    parts = {"q": (0, nq), "k": (nq, nkv), "v": (nq + nkv, nkv)}

    def optim(part: str, base: int) -> tuple[Rows, ...]:
        name = f"{p}attention.qkv_linear.w{part}.weight"
        if not titan_fused_qkv:
            return (Rows(name, base, 0, parts[part][1]),)
        width, skip = (per * hd, 0) if part == "q" else (hd, per + (part == "v"))
        return tuple(Rows(fused, base + g * width, (g * r + skip) * hd, width) for g in range(kv))

    def model(part: str, base: int) -> tuple[Rows, ...]:
        return (Rows(f"{p}attention.qkv_linear.w{part}.weight", base, 0, parts[part][1]),)

    if cfg.fused_qkv:
        model_rows = sum((model(x, parts[x][0]) for x in "qkv"), ())
        return [ParamMap(f"{p}attention.wqkv.weight", (nq + 2 * nkv, cfg.dim), model_rows,
                         sum((optim(x, parts[x][0]) for x in "qkv"), ()))]
    return [ParamMap(f"{p}attention.w{x}.weight", (parts[x][1], cfg.dim), model(x, 0), optim(x, 0)) for x in "qkv"]


def _feed_forward(cfg: TransformerConfig, p: str) -> list[ParamMap]:
    h, f = cfg.hidden, f"{p}feed_forward."
    if cfg.fused_mlp:
        rows = (Rows(f"{f}w1.weight", 0, 0, h), Rows(f"{f}w3.weight", h, 0, h))
        return [ParamMap(f"{f}w13.weight", (2 * h, cfg.dim), rows, rows), ParamMap.same(f"{f}w2.weight", (cfg.dim, h))]
    return [ParamMap.same(f"{f}w1.weight", (h, cfg.dim)), ParamMap.same(f"{f}w2.weight", (cfg.dim, h)),
            ParamMap.same(f"{f}w3.weight", (h, cfg.dim))]


def param_maps(cfg: TransformerConfig, *, titan_fused_qkv: bool = True) -> list[ParamMap]:
    """Each parameter of ``cfg``'s model and its torchtitan names and rows, in ``named_parameters``
    order. ``titan_fused_qkv``: the torchtitan model builds ``FusedQKVLinear`` (all its Llama3
    configs do), so its optimizer state is ``qkv_linear.wqkv`` in grouped order."""
    if cfg.qkv_bias:
        raise ConfigError("a model with q, k, v biases (qkv_bias, Qwen2's attention): torchtitan's Llama has no "
                          "biases, so it has no torchtitan form; export it to Hugging Face instead")
    vocab = (cfg.padded_vocab, cfg.dim)
    emb = ParamMap.same("tok_embeddings.weight", vocab)
    if cfg.tie_embeddings:  # torchtitan's state dict holds the shared weight under both names
        emb = replace(emb, model=emb.model + (Rows("lm_head.weight", 0, 0, vocab[0]),))
    maps = [emb]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        maps.append(ParamMap.same(f"{p}attention_norm.weight", (cfg.dim,)))
        maps += _attention(cfg, p, titan_fused_qkv)
        maps.append(ParamMap.same(f"{p}attention.wo.weight", (cfg.dim, cfg.n_heads * cfg.head_dim)))
        maps.append(ParamMap.same(f"{p}ffn_norm.weight", (cfg.dim,)))
        maps += _feed_forward(cfg, p)
    maps.append(ParamMap.same("norm.weight", (cfg.dim,)))
    if not cfg.tie_embeddings:
        maps.append(ParamMap.same("output.weight", vocab, "lm_head.weight"))
    return maps


def to_dcp(src: str | os.PathLike, dst: str | os.PathLike, cfg: TransformerConfig | None = None, *,
           titan_fused_qkv: bool = True) -> Converted:
    """hpcml checkpoint ``src`` (a step directory, or a root with ``latest``) as a torchtitan
    DCP directory ``dst``. The model config is the one ``src`` carries unless ``cfg`` is
    given; whether ``src`` holds fused ``wqkv``/``w13`` is read from its names either way."""
    from hpcml.ckpt import tools

    info = tools.inspect(src)
    cfg = cfg or _carried(info["extra"], info["path"], len(info["tensors"]))
    cfg = replace(cfg, fused_qkv="model/layers.0.attention.wqkv.weight" in info["tensors"],
                  fused_mlp="model/layers.0.feed_forward.w13.weight" in info["tensors"])
    return export_titan(src, dst, param_maps(cfg, titan_fused_qkv=titan_fused_qkv))


def from_dcp(src: str | os.PathLike, root: str | os.PathLike, cfg: TransformerConfig | None = None, *,
             fused_qkv: bool | None = None, fused_mlp: bool | None = None,
             schedule_steps: int | None = None) -> Converted:
    """torchtitan DCP directory ``src`` as hpcml checkpoint ``root/step_N`` of a ``cfg`` model
    (default: the config an hpcml export stored in it), in the layout ``fused_qkv`` /
    ``fused_mlp`` ask for (None: ``cfg``'s); ``schedule_steps``: see
    :func:`hpcml.ckpt.dcp_import.import_titan`. Whether ``src``'s optimizer state is fused is read from it."""
    from hpcml.ckpt.dcp_safe import DcpReader
    from hpcml.models.transformer.parallelize import TransformerPlan

    reader = DcpReader(src)
    if cfg is None:
        cfg = _carried(carried_extra(reader), src, len(reader.entries))
    cfg = replace(cfg, fused_qkv=cfg.fused_qkv if fused_qkv is None else fused_qkv,
                  fused_mlp=cfg.fused_mlp if fused_mlp is None else fused_mlp)
    fused = bool(reader.children("optimizer.state.layers.0.attention.qkv_linear.wqkv.weight."))
    return import_titan(reader, root, param_maps(cfg, titan_fused_qkv=fused),
                        tensor_attrs=TransformerPlan(cfg).tensor_attrs(), schedule_steps=schedule_steps,
                        extra={"model": cfg.describe()})


def _carried(extra: dict, where: str | os.PathLike, entries: int) -> TransformerConfig:
    """The model config a checkpoint's JSON state carries (``extra["model"]``, the LLM Trainer's),
    no more layers than the checkpoint has ``entries`` (before any per-layer map is built)."""
    model = extra.get("model")
    if not isinstance(model, dict) or model.get("type") != "transformer" or "config" not in model:
        raise CheckpointError(f"{where} carries no transformer config (extra['model']): give the model "
                              f"(--model PRESET, or cfg=)")
    cfg = TransformerConfig.from_dict(model["config"])
    if cfg.n_layers > entries:
        raise CheckpointError(f"{where}: its model config says {cfg.n_layers} layers, but it holds {entries} tensors "
                              f"in all: config and checkpoint do not match")
    return cfg


__all__ = ["TORCHTITAN_COMMIT", "from_dcp", "param_maps", "to_dcp"]
