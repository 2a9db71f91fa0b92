"""EAGLE-1 and EAGLE-3 draft heads as flax.nnx modules (one decoder layer on top of the target).

Both heads read the target's token embedding and a feature vector per position, run one Llama
decoder layer over their own 1-layer paged KV cache and predict the next feature:
  EAGLE-1: feature = the target's final-normed hidden state; x = fc([embed(tok), feat]) (with bias);
           layer without input norm; logits through the target's lm_head.
  EAGLE-3: feature = fc([h_low, h_mid, h_high]) of three target hidden states (inputs of
           cfg.aux_layers, increasing layer order); attention over [input_norm(embed(tok)),
           hidden_norm(feat)] (2E wide), residual from feat; own norm + lm_head over a reduced
           draft vocabulary, mapped back to target ids with d2t offsets.
Flat parameter names (checkpoints, conversion) come from `param_specs`; `d2t` is an int32 constant.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config import ConfigError, ModelConfig
from specjax.kv_cache import AttnMeta, KVCache, init_cache
from specjax.models import llama
from specjax.models.layers import RMSNorm
from specjax.models.llama import MLP, Attention, _einsum, _param

METHODS = ("eagle", "eagle3")
NUM_AUX = 3  # EAGLE-3 fuses three target layers (fc: [3E] -> [E] in every public head)


class Const(nnx.Variable):
    """Non-trainable array state (e.g. EAGLE-3's d2t); kept by nnx.split/merge, not a Param."""


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    method: str  # eagle | eagle3
    layer: ModelConfig  # the head's decoder layer (num_layers == 1)
    target_vocab_size: int
    draft_vocab_size: int  # eagle: == target_vocab_size
    aux_layers: tuple[int, ...] = ()  # eagle3: target layers whose INPUT is fused; () = not known yet
    fc_bias: bool = True

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @classmethod
    def from_hf_dict(cls, d: dict, target_cfg: ModelConfig | None, method: str | None = None) -> EagleConfig:
        """Config of a head from its config.json dict. target_cfg None: the head alone (conversion);
        sizes are then not checked against a target and unnamed aux layers stay ()."""
        sj = d.get("specjax_draft") or {}
        method = method or sj.get("method") or _guess_method(d)
        if method not in METHODS:
            raise ConfigError(f"unknown draft method {method!r}; supported: {', '.join(METHODS)}")
        layer_d = {**d, "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False}
        layer_d.setdefault("num_hidden_layers", 1)
        layer = ModelConfig.from_hf_dict(layer_d)
        if layer.num_layers != 1:
            raise ConfigError(f"draft head has num_hidden_layers={layer.num_layers}; only 1-layer heads are supported")
        bias = bool(d.get("attention_bias", False))
        layer = dataclasses.replace(layer, qkv_bias=bool(sj.get("qkv_bias", bias)), o_bias=bool(sj.get("o_bias", bias)))
        vocab = layer.vocab_size
        draft_vocab = int(d.get("draft_vocab_size") or vocab) if method == "eagle3" else vocab
        if target_cfg is not None:
            if layer.hidden_size != target_cfg.hidden_size:
                raise ConfigError(f"draft head hidden_size={layer.hidden_size} != target hidden_size="
                                  f"{target_cfg.hidden_size}: the head was trained for another target")
            if vocab != target_cfg.vocab_size:
                raise ConfigError(f"draft head vocab_size={vocab} != target vocab_size={target_cfg.vocab_size}")
        if draft_vocab > vocab:
            raise ConfigError(f"draft_vocab_size={draft_vocab} exceeds the target vocab_size={vocab}")
        aux: tuple[int, ...] = ()
        if method == "eagle3":
            aux = _aux_layers(d, sj, target_cfg)
        return cls(method=method, layer=layer, target_vocab_size=vocab, draft_vocab_size=draft_vocab,
                   aux_layers=aux, fc_bias=bool(sj.get("fc_bias", method == "eagle")))

    @classmethod
    def from_dir(cls, path: str | Path, target_cfg: ModelConfig | None) -> EagleConfig:
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise ConfigError(f"missing draft config file: {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d, target_cfg)


def _guess_method(d: dict) -> str:
    archs = " ".join(d.get("architectures") or []).lower()
    if "eagle3" in archs or "draft_vocab_size" in d or "eagle_config" in d:
        return "eagle3"
    return "eagle"


def _aux_layers(d: dict, sj: dict, target_cfg: ModelConfig | None) -> tuple[int, ...]:
    """Target layers (input-of-layer convention) fused by an EAGLE-3 head, in increasing order."""
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if sj.get("aux_layers") is not None:  # already in specjax's convention
        aux = [int(i) for i in sj["aux_layers"]]
        where = "specjax_draft.aux_layers"
    elif ids is not None:  # public configs list OUTPUT-of-layer ids: output of j == input of j + 1
        aux = [int(i) + 1 for i in ids]
        where = "eagle_config.eagle_aux_hidden_state_layer_ids (+1)"
    elif target_cfg is None:
        return ()
    else:
        L = target_cfg.num_layers
        aux = [2, L // 2, L - 3]
        where = f"the default (2, L//2, L-3) for an L={L}-layer target"
    aux = sorted(aux)
    if len(aux) != NUM_AUX or len(set(aux)) != NUM_AUX:
        raise ConfigError(f"EAGLE-3 needs {NUM_AUX} distinct aux layers, got {aux} from {where}")
    if target_cfg is not None:
        L = target_cfg.num_layers
        bad = [i for i in aux if not 0 <= i <= L]
        if bad:
            raise ConfigError(f"aux layer(s) {bad} from {where} are out of range (valid: 0..{L}, "
                              "the input of a target layer or the last layer's output)")
    return tuple(aux)


def param_specs(cfg: EagleConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Flat name -> (shape, logical axes) of the head's state ('d2t' is an int32 constant)."""
    lc = cfg.layer
    E, H, K, D, F = lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.intermediate_size
    eagle3 = cfg.method == "eagle3"
    Ei = 2 * E if eagle3 else E  # attention input width
    specs = {"fc.w": (((NUM_AUX if eagle3 else 2) * E, E), (None, "embed"))}
    if cfg.fc_bias:
        specs["fc.b"] = ((E,), ("embed",))
    if eagle3:
        specs["attn_norm.scale"] = ((E,), ("embed",))
        specs["hidden_norm.scale"] = ((E,), ("embed",))
    specs["attn.wq"] = ((Ei, H, D), ("embed", "heads", None))
    specs["attn.wk"] = ((Ei, K, D), ("embed", "kv_heads", None))
    specs["attn.wv"] = ((Ei, K, D), ("embed", "kv_heads", None))
    specs["attn.wo"] = ((H, D, E), ("heads", None, "embed"))
    if lc.qkv_bias:
        specs["attn.bq"] = ((H, D), ("heads", None))
        specs["attn.bk"] = ((K, D), ("kv_heads", None))
        specs["attn.bv"] = ((K, D), ("kv_heads", None))
    if lc.o_bias:
        specs["attn.bo"] = ((E,), ("embed",))
    specs["mlp_norm.scale"] = ((E,), ("embed",))
    specs["mlp.w_gate"] = ((E, F), ("embed", "mlp"))
    specs["mlp.w_up"] = ((E, F), ("embed", "mlp"))
    specs["mlp.w_down"] = ((F, E), ("mlp", "embed"))
    if eagle3:
        specs["norm.scale"] = ((E,), ("embed",))
        specs["lm_head"] = ((E, cfg.draft_vocab_size), ("embed", "vocab"))
        specs["d2t"] = ((cfg.draft_vocab_size,), ("vocab",))
    return specs


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.w = _param(rngs, (d_in, d_out), (None, "embed"), dtype)
        self.has_bias = bias
        if bias:
            self.b = _param(rngs, (d_out,), ("embed",), dtype)

    def __call__(self, x):  # [B, T, I] -> [B, T, O]
        y = _einsum("bti,io->bto", x, self.w[...])
        return y + self.b[...] if self.has_bias else y


class EagleHead(nnx.Module):
    def __init__(self, cfg: EagleConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        lc, E = cfg.layer, cfg.hidden_size
        self.eagle3 = cfg.method == "eagle3"
        self.fc = Dense((NUM_AUX if self.eagle3 else 2) * E, E, cfg.fc_bias, dtype, rngs)
        if self.eagle3:
            self.attn_norm = RMSNorm(E, lc.rms_norm_eps, dtype)  # on the token embedding
            self.hidden_norm = RMSNorm(E, lc.rms_norm_eps, dtype)  # on the feature
        self.attn = Attention(lc, dtype, rngs, in_features=2 * E if self.eagle3 else E)
        self.mlp_norm = RMSNorm(E, lc.rms_norm_eps, dtype)
        self.mlp = MLP(lc, dtype, rngs)
        if self.eagle3:
            self.norm = RMSNorm(E, lc.rms_norm_eps, dtype)
            self.lm_head = _param(rngs, (E, cfg.draft_vocab_size), ("embed", "vocab"), dtype)
            self.d2t = Const(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))  # draft id -> target id offset

    def features(self, aux: tuple[jax.Array, ...]) -> jax.Array:
        """What the target produced -> the head's input feature [B, T, E].
        EAGLE-1: aux = (final-normed hidden,); EAGLE-3: the hidden states of cfg.aux_layers."""
        if not self.eagle3:
            return aux[0]
        with jax.named_scope("eagle_fc"):
            return self.fc(jnp.concatenate(aux, axis=-1))  # [B, T, 3E] -> [B, T, E]

    def __call__(self, tokens, positions, feats, cache: KVCache, meta: AttnMeta, embed):
        """tokens, positions: [B, T] int32; feats: [B, T, E]; embed: the target's [V, E].
        Returns (next feature [B, T, E], cache)."""
        e = embed[tokens].astype(feats.dtype)  # [B, T, E]
        if self.eagle3:
            residual = feats
            with jax.named_scope("eagle3_in"):
                x = jnp.concatenate([self.attn_norm(e), self.hidden_norm(feats)], axis=-1)  # [B, T, 2E]
        else:
            with jax.named_scope("eagle_fc"):
                x = self.fc(jnp.concatenate([e, feats], axis=-1))  # [B, T, 2E] -> [B, T, E]
            residual = x  # EAGLE-1's layer 0 has no input norm
        with jax.named_scope("attn"):
            h, kv = self.attn(x, positions, cache.kv[0], meta)
        x = residual + h  # [B, T, E]
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.mlp_norm(x))
        return x, KVCache(kv=[kv], page_table=cache.page_table, seq_lens=cache.seq_lens)

    def logits(self, hidden, target_lm_head):
        """hidden [B, T, E]; target_lm_head [E, V] -> [B, T, Vd] float32 (EAGLE-3: draft vocab)."""
        if self.eagle3:
            return _einsum("bte,ev->btv", self.norm(hidden), self.lm_head[...], preferred_element_type=jnp.float32)
        return _einsum("bte,ev->btv", hidden, target_lm_head, preferred_element_type=jnp.float32)

    def to_target_ids(self, ids):
        """Draft-vocab ids (any shape, int32) -> target ids."""
        if not self.eagle3:
            return ids
        return ids + self.d2t[...][ids]


def flat_state(head: EagleHead) -> dict[str, jax.Array]:
    """Flat name -> array of the head's parameters and constants (names of param_specs)."""
    flat = llama.flat_state(head)
    if head.eagle3:
        flat["d2t"] = head.d2t[...]
    return flat


def load_flat(head: EagleHead, flat: dict) -> None:
    """Replace the head's state by a flat dict with exactly the names of param_specs."""
    params = {k: v for k, v in flat.items() if k != "d2t"}
    if head.eagle3:
        if "d2t" not in flat:
            raise ValueError("parameter names differ: missing ['d2t']")
        d2t = jnp.asarray(flat["d2t"], jnp.int32)
        if d2t.shape != head.d2t[...].shape:
            raise ValueError(f"d2t: shape {tuple(d2t.shape)} != expected {tuple(head.d2t[...].shape)}")
    elif "d2t" in flat:
        raise ValueError("parameter names differ: unexpected ['d2t'] for an EAGLE-1 head")
    llama.load_flat(head, params)
    if head.eagle3:
        head.d2t[...] = d2t


def init_head_cache(cfg: EagleConfig, *, num_pages: int, page_size: int, max_slots: int, max_seq_len: int,
                    dtype) -> KVCache:
    """The head's paged KV cache: one layer, same layout as kv_cache.init_cache."""
    return init_cache(cfg.layer, num_pages=num_pages, page_size=page_size, max_slots=max_slots,
                      max_seq_len=max_seq_len, dtype=dtype)
