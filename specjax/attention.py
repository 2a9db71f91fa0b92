"""The one dispatch point for attention over the paged cache.

Model code calls `attend`; which implementation runs is chosen here, never in the model.
"""
from __future__ import annotations

from pallas_kernels.paged_attention import paged_attention_reference

_IMPLS = {"reference": paged_attention_reference}
_active = "reference"


def register(name: str, fn) -> None:
    """Plug in an implementation with the reference's signature."""
    _IMPLS[name] = fn


def set_impl(name: str) -> None:
    global _active
    if name not in _IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}; known: {sorted(_IMPLS)}")
    _active = name


def attend(q, k_pages, v_pages, meta, *, sliding_window=None):
    """q: [B, T, H, D] over the pages named by meta (AttnMeta). Returns [B, T, H, D]."""
    return _IMPLS[_active](q, k_pages, v_pages, meta.page_table, meta.q_start, meta.kv_len,
                           meta.block_mask, sliding_window=sliding_window)
