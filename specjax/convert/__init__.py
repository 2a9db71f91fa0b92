"""Checkpoint conversion to specjax model directories (see specjax.checkpoint).

    convert("path/to/hf_folder", "out_dir")            # config.json + *.safetensors
    convert("path/to/model.Q4_1.gguf", "out_dir")      # GGUF, dequantized
    convert_draft("path/to/eagle_head", "out_dir")     # EAGLE-1 / EAGLE-3 draft head
"""
from __future__ import annotations

from pathlib import Path


class ConvertError(ValueError):
    """An input that cannot be converted; the message names the file and the problem."""


def convert(src: str | Path, out: str | Path, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Convert an HF folder or a .gguf file to a specjax model directory at `out`; returns `out`.

    dtype: 'bfloat16' | 'float32' | 'float16', the dtype the parameters are stored in."""
    src = Path(src)
    if not src.exists():
        raise ConvertError(f"conversion source {src} does not exist")
    if src.is_dir():
        from specjax.convert.hf import convert_hf
        return convert_hf(src, out, dtype=dtype, progress=progress)
    if src.is_file() and src.suffix.lower() == ".gguf":
        from specjax.convert.gguf import convert_gguf
        return convert_gguf(src, out, dtype=dtype, progress=progress)
    raise ConvertError(f"cannot convert {src}: expected a Hugging Face model folder or a .gguf file")


def convert_draft(src: str | Path, out: str | Path, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Convert an EAGLE-1 / EAGLE-3 head folder (config.json + pytorch_model.bin or *.safetensors)
    to a specjax draft directory at `out`; returns `out`. See specjax.convert.draft."""
    from specjax.convert.draft import convert_draft as _convert_draft
    return _convert_draft(src, out, dtype=dtype, progress=progress)


__all__ = ["ConvertError", "convert", "convert_draft"]
