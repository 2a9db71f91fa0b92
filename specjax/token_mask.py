"""Grammar token masks on the device: packed bitmasks applied to logits before sampling / acceptance.

Layout (xgrammar's): a mask row is ``W = ceil(V / 32)`` int32 words; bit ``j`` of word ``w`` (least
significant bit first) allows token ``32 * w + j``.

A step's masks come as `RowMasks`, the masks of the constrained rows only:

    bits [R, ..., W] int32   the masks (plain decoding: [R, W]; a draft tree: [R, N, W])
    rows [R] int32           the batch row each mask belongs to; R is bucketed (`rows_bucket`) and
                             padding rows hold an index >= B (read clamped, written nowhere)

`apply_token_mask(logits [B, ..., V], masks)` gathers the R rows, sets their disallowed logits to
-inf and scatters them back; the other B - R rows are untouched (unconstrained requests pay no mask
work, and the host uploads R x W words, not B x W). A dense [B, ..., W] array is accepted too (every
row masked).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["RowMasks", "apply_bitmask", "apply_token_mask", "rows_bucket"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowMasks:
    bits: jax.Array  # [R, ..., W] int32 packed masks of the constrained rows
    rows: jax.Array  # [R] int32 their batch rows; >= B: padding (no effect)


def rows_bucket(n: int, batch: int) -> int:
    """Padded count of n masked rows in a batch of `batch` rows: 1, 4, 16, ... capped at the batch
    (few distinct shapes: one compiled program per bucket)."""
    r = 1
    while r < n:
        r *= 4
    return max(n, min(r, batch))


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [..., V] with every token not allowed by bitmask [..., W] int32 set to -inf.

    Pure ``jnp`` with static shapes (jit-safe). Leading dimensions broadcast; a V that is not a
    multiple of 32 is fine, and tokens >= 32*W are disallowed.
    """
    vocab = logits.shape[-1]
    words = jax.lax.bitcast_convert_type(jnp.asarray(bitmask, jnp.int32), jnp.uint32)  # [..., W]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words[..., :, None] >> shifts) & jnp.uint32(1)  # [..., W, 32]
    bits = bits.reshape(words.shape[:-1] + (32 * words.shape[-1],))  # [..., 32W]
    if bits.shape[-1] >= vocab:
        bits = bits[..., :vocab]
    else:
        bits = jnp.pad(bits, [(0, 0)] * (bits.ndim - 1) + [(0, vocab - bits.shape[-1])])
    return jnp.where(bits.astype(bool), logits, jnp.asarray(-jnp.inf, logits.dtype))


def apply_token_mask(logits: jax.Array, mask) -> jax.Array:
    """logits [B, ..., V] under a step's grammar masks: None (no constrained row), RowMasks (the
    listed rows only) or a dense bitmask [B, ..., W] (every row)."""
    if mask is None:
        return logits
    if not isinstance(mask, RowMasks):
        return apply_bitmask(logits, mask)
    B = logits.shape[0]
    picked = logits[jnp.minimum(mask.rows, B - 1)]  # [R, ..., V]
    return logits.at[mask.rows].set(apply_bitmask(picked, mask.bits), mode="drop")
