"""The one dispatch point for attention over the paged cache.

Model code calls `attend`; which implementation runs is chosen here, never in the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import gather_kv, paged_attention_reference, visibility_mask


def paged_attention_cudnn(q, kv_pages, page_table, q_start, kv_len, block_mask=None,
                          *, sliding_window=None, scale=None, mask_start=None):
    """Same contract as the reference; the softmax(QK^T)V part runs as one cuDNN fused kernel
    (GPU, bf16/fp16 only). Gathering the pages stays in XLA."""
    T = q.shape[1]
    k, v = gather_kv(kv_pages, page_table)  # [B, S, Hkv, D]
    S = k.shape[1]
    if T == 1 and block_mask is None and sliding_window is None:  # decode: keys [0, kv_len)
        # a slot stepped past its last page (steps computed after a request ended are dropped)
        # must not make cuDNN read past the S gathered keys
        return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=jnp.minimum(kv_len, S),
                                            implementation="cudnn")
    mask = visibility_mask(q_start, kv_len, S, T, block_mask, sliding_window, mask_start)[:, None]  # [B, 1, T, S]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")


_IMPLS = {"reference": paged_attention_reference, "cudnn": paged_attention_cudnn}
_active = "auto"  # cuDNN fused attention on GPU for bf16/fp16, else the jnp reference


def register(name: str, fn) -> None:
    """Plug in an implementation with the reference's signature."""
    _IMPLS[name] = fn


def set_impl(name: str) -> None:
    global _active
    if name not in _IMPLS and name != "auto":
        raise ValueError(f"unknown attention implementation {name!r}; known: {sorted(_IMPLS)}")
    _active = name


def attend(q, kv_pages, meta, *, sliding_window=None):
    """q: [B, T, H, D] over the pages named by meta (AttnMeta). Returns [B, T, H, D]."""
    name = _active
    if name == "auto":
        name = "cudnn" if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else "reference"
    return _IMPLS[name](q, kv_pages, meta.page_table, meta.q_start, meta.kv_len,
                           meta.block_mask, sliding_window=sliding_window, mask_start=meta.mask_start)
