"""The target's features for EAGLE-3 training, computed on the fly inside the training step.

Storing the three aux hidden states of every training token costs 3E bfloat16 values per token
(3.4 KB for SmolLM2: 100 GB for 30 M tokens), so large runs store token ids only and the training
step recomputes the target over the packed batch first (no gradient flows into it):

  ids, seg, pos [B, T]  (packed rows: segment ids 1.., 0 = padding; positions restart per segment)
    -> target layers with a dense causal, segment-blocked attention
    -> aux [B, T, 3E] (inputs of the aux layers, concatenated), next ids [B, T] (target argmax)

The arithmetic is the model's own (specjax.models.llama: the same einsums, RMSNorm, rope, float32
softmax), so the features equal those of a paged prefill of each sequence alone
(tests/test_train.py checks this against specjax.train.features.FeatureExtractor).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.models.layers import apply_rope, rope_inv_freq
from specjax.models.llama import _einsum
from specjax.train.forward import rms_norm

NEG = -1e30


@dataclasses.dataclass(frozen=True)
class TargetDims:
    """Static facts of the target (hashable: a jit static argument)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def of(cls, cfg: ModelConfig) -> TargetDims:
        if cfg.sliding_window:
            raise ValueError("on-the-fly training features do not support sliding-window targets; "
                             "store features (train_eagle.py data --features) instead")
        return cls(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, float(cfg.rms_norm_eps),
                   tuple(float(f) for f in rope_inv_freq(cfg.head_dim, cfg.rope)), cfg.tie_word_embeddings,
                   cfg.qkv_bias, cfg.o_bias, cfg.qk_norm)


def _attention(q, k, v, mask):
    """q [B,T,H,D], k/v [B,T,K,D], mask [B,T,T] -> [B,T,H,D]; float32 softmax like the paged
    reference attention."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=prec, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s * D ** -0.5, NEG)  # [B, K, G, T, T]
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=prec, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)


def target_features(tp: dict, dims: TargetDims, ids, seg, pos, aux_layers: tuple[int, ...]):
    """tp: the target's flat parameters (specjax.models.llama.param_specs names) in the compute
    dtype. ids/seg/pos [B, T] int32 -> (aux [B, T, len(aux_layers) * E], next ids [B, T] int32)."""
    T = ids.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    mask = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)  # [B, T, T]
    mask = mask | jnp.eye(T, dtype=bool)[None]  # padding rows attend to themselves (no NaN)
    x = tp["embed"][ids]  # [B, T, E]
    aux = {}
    for i in range(dims.num_layers):
        if i in aux_layers:
            aux[i] = x
        p = f"layers.{i}."
        h = rms_norm(x, tp[p + "attn_norm.scale"], dims.eps)
        q = _einsum("bte,ehd->bthd", h, tp[p + "attn.wq"])
        k = _einsum("bte,ekd->btkd", h, tp[p + "attn.wk"])
        v = _einsum("bte,ekd->btkd", h, tp[p + "attn.wv"])
        if dims.qkv_bias:
            q, k, v = q + tp[p + "attn.bq"], k + tp[p + "attn.bk"], v + tp[p + "attn.bv"]
        if dims.qk_norm:
            q = rms_norm(q, tp[p + "attn.q_norm.scale"], dims.eps)
            k = rms_norm(k, tp[p + "attn.k_norm.scale"], dims.eps)
        q, k = apply_rope(q, pos, dims.inv_freq), apply_rope(k, pos, dims.inv_freq)
        o = _einsum("bthd,hde->bte", _attention(q, k, v, mask), tp[p + "attn.wo"])
        if dims.o_bias:
            o = o + tp[p + "attn.bo"]
        x = x + o
        m = rms_norm(x, tp[p + "mlp_norm.scale"], dims.eps)
        gate = _einsum("bte,ef->btf", m, tp[p + "mlp.w_gate"])
        up = _einsum("bte,ef->btf", m, tp[p + "mlp.w_up"])
        x = x + _einsum("btf,fe->bte", jax.nn.silu(gate) * up, tp[p + "mlp.w_down"])
    if dims.num_layers in aux_layers:
        aux[dims.num_layers] = x
    h = rms_norm(x, tp["norm.scale"], dims.eps)
    w = tp["embed"].T if dims.tied else tp["lm_head"]
    nxt = jnp.argmax(_einsum("bte,ev->btv", h, w, preferred_element_type=jnp.float32), axis=-1)
    return jnp.concatenate([aux[i] for i in aux_layers], axis=-1), nxt.astype(jnp.int32)
