"""Attention of new query tokens over a paged KV cache.

`paged_attention_reference` is the pure-jnp definition; a Pallas kernel with the same
signature can be registered in `specjax.attention` (the one dispatch point).

Visibility rule (cache index k, row b, new token i; m = mask_start[b], q_start[b] when None):
  k < m                                           -> visible (prefix)
  m <= k < m + W                                  -> block_mask[b, i, k - m]   (block_mask [B, T, W])
                                                     (causal k - q_start[b] <= i when block_mask is None)
  k >= kv_len[b]                                  -> never
  sliding_window w                                -> additionally q_start[b] + i - k < w
A draft tree grown step by step uses mask_start < q_start: the new nodes see the committed prefix
and, of the tree entries written by earlier steps, only their own ancestors.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility_mask(q_start, kv_len, S: int, T: int, block_mask=None, sliding_window=None, mask_start=None):
    """[B, T, S] bool mask over gathered cache entries."""
    k_idx = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    i = jnp.arange(T, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
    start = q_start[:, None, None]
    m0 = start if mask_start is None else mask_start[:, None, None]
    rel = k_idx - m0  # position of key inside the masked block
    if block_mask is None:
        in_block = rel <= i
    else:
        W = block_mask.shape[2]
        rel_c = jnp.clip(rel, 0, W - 1)
        in_block = jnp.take_along_axis(block_mask, jnp.broadcast_to(rel_c, block_mask.shape[:2] + (S,)), axis=2)
        in_block &= rel < W
    mask = jnp.where(rel < 0, True, in_block) & (k_idx < kv_len[:, None, None])
    if sliding_window is not None:
        mask &= (start + i - k_idx) < sliding_window
    return mask


def gather_kv(kv_pages, page_table):
    """kv_pages [N, page_size, 2, Hkv, D], page_table [B, P] -> k, v: [B, P * page_size, Hkv, D]."""
    B, P = page_table.shape
    _, ps, _, Hkv, D = kv_pages.shape
    kv = kv_pages[page_table].reshape(B, P * ps, 2, Hkv, D)  # one gather for K and V
    return kv[:, :, 0], kv[:, :, 1]


def paged_attention_reference(q, kv_pages, page_table, q_start, kv_len, block_mask=None,
                              *, sliding_window=None, scale=None, mask_start=None):
    """q: [B, T, H, D]; kv_pages: [N, page_size, 2, Hkv, D] (K then V); page_table: [B, P] int32;
    q_start, kv_len: [B] int32; block_mask: [B, T, W] bool or None; mask_start: [B] int32 or None.
    Returns [B, T, H, D]."""
    B, T, H, D = q.shape
    Hkv = kv_pages.shape[3]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    k, v = gather_kv(kv_pages, page_table)  # [B, S, Hkv, D]
    S = k.shape[1]
    qg = q.reshape(B, T, Hkv, G, D)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32 for f32 on GPU
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=prec, preferred_element_type=jnp.float32) * scale
    mask = visibility_mask(q_start, kv_len, S, T, block_mask, sliding_window, mask_start)  # [B, T, S]
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)
