"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2) as flax.nnx modules.

Weights are einsum-shaped with named dims and carry logical axes in their metadata:
  embed [V, E] (vocab, embed)    wq [E, H, D] (embed, heads, -)   wk/wv [E, K, D] (embed, kv_heads, -)
  wo [H, D, E] (heads, -, embed) w_gate/w_up [E, F] (embed, mlp)  w_down [F, E] (mlp, embed)
  lm_head [E, V] (embed, vocab), absent with tied embeddings.
Flat parameter names (checkpoints, conversion) come from `param_specs`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import attention
from specjax.config import ModelConfig
from specjax.kv_cache import AttnMeta, KVCache
from specjax.models.layers import RMSNorm, apply_rope, rope_inv_freq


def _einsum(spec, a, b, **kw):
    """einsum that keeps float32 exact on GPU (TF32 would be the default there)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=prec, **kw)


def param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Flat name -> (shape, logical axes) of every parameter of the model."""
    E, H, K, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
    specs = {"embed": ((V, E), ("vocab", "embed"))}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        specs[p + "attn_norm.scale"] = ((E,), ("embed",))
        specs[p + "attn.wq"] = ((E, H, D), ("embed", "heads", None))
        specs[p + "attn.wk"] = ((E, K, D), ("embed", "kv_heads", None))
        specs[p + "attn.wv"] = ((E, K, D), ("embed", "kv_heads", None))
        specs[p + "attn.wo"] = ((H, D, E), ("heads", None, "embed"))
        if cfg.qkv_bias:
            specs[p + "attn.bq"] = ((H, D), ("heads", None))
            specs[p + "attn.bk"] = ((K, D), ("kv_heads", None))
            specs[p + "attn.bv"] = ((K, D), ("kv_heads", None))
        if cfg.o_bias:
            specs[p + "attn.bo"] = ((E,), ("embed",))
        if cfg.qk_norm:
            specs[p + "attn.q_norm.scale"] = ((D,), (None,))
            specs[p + "attn.k_norm.scale"] = ((D,), (None,))
        specs[p + "mlp_norm.scale"] = ((E,), ("embed",))
        specs[p + "mlp.w_gate"] = ((E, F), ("embed", "mlp"))
        specs[p + "mlp.w_up"] = ((E, F), ("embed", "mlp"))
        specs[p + "mlp.w_down"] = ((F, E), ("mlp", "embed"))
    specs["norm.scale"] = ((E,), ("embed",))
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((E, V), ("embed", "vocab"))
    return specs


def _param(rngs, shape, axes, dtype, std=0.02):
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype),
                     logical_axes=axes)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, in_features: int | None = None):
        # in_features: width of the input x (default hidden_size; EAGLE-3 heads attend over 2E)
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        Ei = in_features or E
        self.wq = _param(rngs, (Ei, H, D), ("embed", "heads", None), dtype)
        self.wk = _param(rngs, (Ei, K, D), ("embed", "kv_heads", None), dtype)
        self.wv = _param(rngs, (Ei, K, D), ("embed", "kv_heads", None), dtype)
        self.wo = _param(rngs, (H, D, E), ("heads", None, "embed"), dtype)
        if cfg.qkv_bias:
            self.bq = _param(rngs, (H, D), ("heads", None), dtype)
            self.bk = _param(rngs, (K, D), ("kv_heads", None), dtype)
            self.bv = _param(rngs, (K, D), ("kv_heads", None), dtype)
        if cfg.o_bias:
            self.bo = _param(rngs, (E,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype, axis_name=None)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype, axis_name=None)
        self.qkv_bias, self.o_bias, self.qk_norm = cfg.qkv_bias, cfg.o_bias, cfg.qk_norm
        self.sliding_window = cfg.sliding_window
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(D, cfg.rope))
        self.attn_impl = attention.REFERENCE  # static; set at engine start (attention.configure)

    def __call__(self, x, positions, kv_pages, meta: AttnMeta):
        # x: [B, T, E]
        q = _einsum("bte,ehd->bthd", x, self.wq[...])  # [B, T, H, D]
        k = _einsum("bte,ekd->btkd", x, self.wk[...])  # [B, T, K, D]
        v = _einsum("bte,ekd->btkd", x, self.wv[...])  # [B, T, K, D]
        if self.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.inv_freq)
        k = apply_rope(k, positions, self.inv_freq)
        o, kv_pages = attention.write_and_attend(q, k, v, kv_pages, meta, self.attn_impl,
                                                 sliding_window=self.sliding_window)
        out = _einsum("bthd,hde->bte", o, self.wo[...])  # [B, T, E]
        if self.o_bias:
            out = out + self.bo[...]
        return out, kv_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        E, F = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = _param(rngs, (E, F), ("embed", "mlp"), dtype)
        self.w_up = _param(rngs, (E, F), ("embed", "mlp"), dtype)
        self.w_down = _param(rngs, (F, E), ("mlp", "embed"), dtype)

    def __call__(self, x):  # [B, T, E]
        gate = _einsum("bte,ef->btf", x, self.w_gate[...])
        up = _einsum("bte,ef->btf", x, self.w_up[...])
        return _einsum("btf,fe->bte", jax.nn.silu(gate) * up, self.w_down[...])


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, kv_pages, meta):
        with jax.named_scope("attn"):
            h, kv_pages = self.attn(self.attn_norm(x), positions, kv_pages, meta)
        x = x + h
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.mlp_norm(x))
        return x, kv_pages


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.tied = cfg.tie_word_embeddings
        if not self.tied:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def __call__(self, tokens, positions, cache: KVCache, meta: AttnMeta, aux_layers: tuple[int, ...] = ()):
        """tokens, positions: [B, T] int32. Returns (final-normed hidden [B, T, E], cache,
        aux hidden states: input of layer i for i in aux_layers, i == num_layers: pre-norm output)."""
        x = self.embed[...][tokens]  # [B, T, E]
        kvs, aux = list(cache.kv), {}
        for i, layer in enumerate(self.layers):  # unrolled: streams weights faster than lax.scan
            if i in aux_layers:
                aux[i] = x
            with jax.named_scope(f"layer{i}"):
                x, kvs[i] = layer(x, positions, kvs[i], meta)
        if len(self.layers) in aux_layers:
            aux[len(self.layers)] = x
        cache = KVCache(kv=kvs, page_table=cache.page_table, seq_lens=cache.seq_lens)
        return self.norm(x), cache, tuple(aux[i] for i in aux_layers)

    def logits(self, h):  # [B, T, E] -> [B, T, V] float32
        w = self.embed[...].T if self.tied else self.lm_head[...]
        return _einsum("bte,ev->btv", h, w, preferred_element_type=jnp.float32)


def flat_state(model: nnx.Module) -> dict[str, jax.Array]:
    """Flat 'a.b.c' -> array view of the model's parameters."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            name = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, name + ".")
            else:
                out[name] = v
    walk(pure, "")
    return out


def load_flat(model: nnx.Module, flat: dict) -> None:
    """Replace the model's parameters by a flat dict with exactly the names of param_specs."""
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    current = flat_state(model)
    missing = sorted(set(current) - set(flat))
    extra = sorted(set(flat) - set(current))
    if missing or extra:
        raise ValueError(f"parameter names differ: missing {missing[:5]}, unexpected {extra[:5]}")

    def fill(d, prefix):
        for k in d:
            name = f"{prefix}{k}"
            if isinstance(d[k], dict):
                fill(d[k], name + ".")
            else:
                arr = flat[name]
                if tuple(arr.shape) != tuple(d[k].shape):
                    raise ValueError(f"{name}: shape {tuple(arr.shape)} != expected {tuple(d[k].shape)}")
                d[k] = jnp.asarray(arr, dtype=d[k].dtype)
    fill(pure, "")
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
