"""The EAGLE-3 head as pure functions of its flat parameter dict, for training.

The inference head (specjax.models.eagle.EagleHead) runs one decoder layer over a paged KV cache.
Training unrolls it K times over whole packed sequences ("training-time test"), with a dense
attention instead of the cache:

  step 0, index t: token x_{t+1}, feature fc(aux_t), position t; it attends causally to the step-0
          entries 0..t of its own sequence (what the committed draft cache holds at inference);
  step j, index t: token x_{t+1+j}, feature = the head's step j-1 output at t, position t + j; it
          attends to the step-0 entries 0..t plus the step 1..j entries at index t (its own chain of
          predictions: the scratch ancestors of a drafted node at inference, see specjax.draft_tree.grow).

So step j at index t is the depth-j drafted node of a chain rooted at x_{t+1}, fed at the same
position, with the same visible keys, as in the engine. tests/test_train.py checks steps 0..2
against EagleHead.__call__ over a paged cache.

Parameter names are those of specjax.models.eagle.param_specs ("d2t" is not a parameter here).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.models import eagle
from specjax.models.layers import apply_rope, rope_inv_freq
from specjax.models.llama import _einsum

NEG = -1e30


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L//2, L-3): inputs of these target layers are fused (EagleConfig's default)."""
    aux = (2, num_layers // 2, num_layers - 3)
    if len(set(aux)) != 3 or min(aux) < 0 or sorted(aux) != list(aux):
        raise ValueError(f"a {num_layers}-layer target has no distinct default aux layers {aux}; "
                         "pass aux_layers explicitly (three increasing target layer indices)")
    return aux


def head_hf_config(target_hf: dict, draft_vocab_size: int, aux_layers, intermediate_size: int | None = None) -> dict:
    """config.json of an EAGLE-3 head whose decoder layer has the target's dimensions (its MLP
    `intermediate_size` wide when given, else as wide as the target's)."""
    tcfg = ModelConfig.from_hf_dict(target_hf)
    d = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
         "hidden_size": tcfg.hidden_size, "intermediate_size": int(intermediate_size or tcfg.intermediate_size),
         "num_attention_heads": tcfg.num_heads, "num_key_value_heads": tcfg.num_kv_heads,
         "head_dim": tcfg.head_dim, "num_hidden_layers": 1, "vocab_size": tcfg.vocab_size,
         "draft_vocab_size": int(draft_vocab_size), "rms_norm_eps": tcfg.rms_norm_eps,
         "max_position_embeddings": tcfg.max_position_embeddings, "tie_word_embeddings": False,
         "attention_bias": False,
         "specjax_draft": {"method": "eagle3", "aux_layers": [int(i) for i in aux_layers], "fc_bias": False,
                           "qkv_bias": False, "o_bias": False}}
    for k in ("rope_theta", "rope_scaling", "rope_parameters"):
        if target_hf.get(k) is not None:
            d[k] = target_hf[k]
    return d


def head_config(hf: dict, target_cfg: ModelConfig) -> eagle.EagleConfig:
    return eagle.EagleConfig.from_hf_dict(hf, target_cfg)


def read_hf_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def init_params(ecfg: eagle.EagleConfig, seed: int = 0, std: float = 0.02) -> dict[str, jax.Array]:
    """Fresh float32 parameters (no d2t): weights ~ N(0, std), norm scales 1, biases 0. Drawn with
    numpy: one host draw instead of a compiled random op per parameter shape."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in eagle.param_specs(ecfg).items():
        if name == "d2t":
            continue
        if name.endswith(".scale"):
            arr = np.ones(shape, np.float32)
        elif len(shape) == 1 or name.startswith("attn.b"):
            arr = np.zeros(shape, np.float32)
        else:
            arr = (rng.standard_normal(shape, np.float32) * std).astype(np.float32)
        out[name] = jnp.asarray(arr)
    return out


def target_init(target_flat: dict, d2t) -> dict[str, jax.Array]:
    """Warm start of the output side from the target: norm.scale = the target's final norm,
    lm_head = the target's output projection restricted to the draft vocabulary."""
    ids = np.asarray(d2t) + np.arange(len(d2t))
    w = target_flat["lm_head"] if "lm_head" in target_flat else np.asarray(target_flat["embed"]).T
    return {"norm.scale": jnp.asarray(target_flat["norm.scale"], jnp.float32),
            "lm_head": jnp.asarray(np.asarray(w)[:, ids], jnp.float32)}


@dataclasses.dataclass(frozen=True)
class HeadDims:
    """Static facts of the head the training forward needs (hashable: jit static argument)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: tuple[float, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    fc_bias: bool = False

    @classmethod
    def of(cls, ecfg: eagle.EagleConfig) -> HeadDims:
        lc = ecfg.layer
        return cls(lc.num_heads, lc.num_kv_heads, lc.head_dim, float(lc.rms_norm_eps),
                   tuple(float(f) for f in rope_inv_freq(lc.head_dim, lc.rope)), lc.qkv_bias, lc.o_bias,
                   ecfg.fc_bias)


def rms_norm(x, scale, eps):
    """Same arithmetic as specjax.models.layers.RMSNorm."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def fuse(p, dims: HeadDims, aux):
    """aux [B, T, 3E] (the three target hidden states, concatenated) -> feature [B, T, E]."""
    y = _einsum("bti,io->bto", aux, p["fc.w"])
    return y + p["fc.b"] if dims.fc_bias else y


def qkv(p, dims: HeadDims, tok_emb, feat, positions):
    """The head's attention input and projections: q [B,T,H,D], k/v [B,T,K,D] (rope applied)."""
    x = jnp.concatenate([rms_norm(tok_emb, p["attn_norm.scale"], dims.eps),
                         rms_norm(feat, p["hidden_norm.scale"], dims.eps)], axis=-1)  # [B, T, 2E]
    q = _einsum("bte,ehd->bthd", x, p["attn.wq"])
    k = _einsum("bte,ekd->btkd", x, p["attn.wk"])
    v = _einsum("bte,ekd->btkd", x, p["attn.wv"])
    if dims.qkv_bias:
        q, k, v = q + p["attn.bq"], k + p["attn.bk"], v + p["attn.bv"]
    return apply_rope(q, positions, dims.inv_freq), apply_rope(k, positions, dims.inv_freq), v


def ttt_attention(q, k0, v0, mask0, diag_k=(), diag_v=()):
    """q [B,T,H,D] over the step-0 keys k0/v0 [B,T,K,D] where mask0 [B,T,T] allows, plus, for each
    later step i, its key at the query's own index (diag_k[i] [B,T,K,D]). One softmax over both
    parts (computed piecewise: the [T, T] scores are never copied), float32, with the casts of the
    paged reference attention."""
    B, T, H, D = q.shape
    K = k0.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scale = D ** -0.5
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k0, precision=prec, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask0[:, None, None], s, NEG)  # [B, K, G, T, T]
    d = [jnp.einsum("btkgd,btkd->bkgt", qg, k, precision=prec, preferred_element_type=jnp.float32) * scale
         for k in diag_k]  # each [B, K, G, T]
    m = jnp.max(s, axis=-1)
    for x in d:
        m = jnp.maximum(m, x)
    m = jax.lax.stop_gradient(m)
    e = jnp.exp(s - m[..., None])
    ed = [jnp.exp(x - m) for x in d]
    z = jnp.sum(e, axis=-1) + sum(ed)
    o = jnp.einsum("bkgts,bskd->btkgd", (e / z[..., None]).astype(v0.dtype), v0, precision=prec,
                   preferred_element_type=jnp.float32)
    for x, v in zip(ed, diag_v):
        o = o + jnp.einsum("bkgt,btkd->btkgd", (x / z).astype(v.dtype), v, precision=prec,
                           preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)


def finish_layer(p, dims: HeadDims, feat, o):
    """Attention output o [B,T,H,D] -> the layer's output hidden state (residual from the feature)."""
    h = _einsum("bthd,hde->bte", o, p["attn.wo"])
    if dims.o_bias:
        h = h + p["attn.bo"]
    x = feat + h
    m = rms_norm(x, p["mlp_norm.scale"], dims.eps)
    gate = _einsum("bte,ef->btf", m, p["mlp.w_gate"])
    up = _einsum("bte,ef->btf", m, p["mlp.w_up"])
    return x + _einsum("btf,fe->bte", jax.nn.silu(gate) * up, p["mlp.w_down"])


def draft_logits(p, dims: HeadDims, hidden):
    """[B, T, E] -> draft-vocabulary logits [B, T, Vd] float32."""
    return _einsum("bte,ev->btv", rms_norm(hidden, p["norm.scale"], dims.eps), p["lm_head"],
                   preferred_element_type=jnp.float32)


def shift_left(x, n: int, fill):
    """x[:, t + n] at t (fill past the end)."""
    if n == 0:
        return x
    pad = jnp.full(x.shape[:1] + (n,) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def unrolled(p, dims: HeadDims, embed, ids, seg, pos, aux, num_steps: int):
    """The K-step training-time-test forward over packed rows.
    ids/seg/pos [B, T] int32 (seg 0 = padding, positions restart per sequence); aux [B, T, 3E].
    Yields (j, hidden [B, T, E], valid [B, T] bool): hidden at index t is the step-j prediction
    made after token x_{t+1+j}; valid where x_{t+1+j} exists in the same sequence."""
    T = ids.shape[1]
    dtype = aux.dtype
    feat = fuse(p, dims, aux)
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    mask0 = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)  # [B, T, T]
    k0 = v0 = None
    dk, dv = [], []
    for j in range(num_steps):
        tok = shift_left(ids, j + 1, 0)
        valid = (shift_left(seg, j + 1, 0) == seg) & (seg > 0)
        q, k, v = qkv(p, dims, embed[tok].astype(dtype), feat, pos + j)
        if j == 0:
            k0, v0 = k, v
        else:
            dk.append(k)
            dv.append(v)
        feat = finish_layer(p, dims, feat, ttt_attention(q, k0, v0, mask0, dk, dv))
        yield j, feat, valid
