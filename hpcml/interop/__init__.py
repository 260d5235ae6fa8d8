"""Conversions between hpcml and other ecosystems: Hugging Face (``hf``, ``hf_files``) and
torchtitan through DCP (``torchtitan``). They know both a model and the checkpoint format,
so they sit above ``hpcml.models`` and ``hpcml.ckpt`` (docs/how-it-fits.md): neither of those
imports this package."""

from __future__ import annotations

import os


def export(path: str | os.PathLike, out: str | os.PathLike, fmt_name: str = "safetensors") -> int:
    """:func:`hpcml.ckpt.tools.export`, plus ``hf``: a Hugging Face Llama directory ``out``
    (:func:`hpcml.interop.hf.export_hf`). Returns bytes written."""
    from hpcml.ckpt import tools
    from hpcml.errors import ConfigError

    if fmt_name not in ("safetensors", "torch", "hf"):  # before reading every weight
        raise ConfigError(f"export format {fmt_name!r} unknown: expected safetensors, torch or hf")
    if fmt_name == "hf":
        from hpcml.interop.hf import export_hf

        return export_hf(path, tools.out_dir(out))["bytes"]
    return tools.export(path, out, fmt_name)


__all__ = ["export"]
