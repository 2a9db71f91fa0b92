"""Small building blocks shared by the model families: RMSNorm and rotary embeddings."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import RopeConfig


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, axis_name: str = "embed"):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=(axis_name,))

    def __call__(self, x):  # [..., dim]
        dtype = x.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * xf.astype(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64 on the host, baked into the program)."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """x: [B, T, N, D]; positions: [B, T] int32. Rotate-half convention (HF layout)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
