"""EAGLE-1 / EAGLE-3 draft heads against a torch reference written from the public definitions.

The reference runs each row causally over all its tokens at once; the JAX head runs over a paged
cache with scattered pages (page_size 4) in two calls: a prefill of 5 tokens, then 3 more."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import tiny_config, tiny_model

from specjax.config import ConfigError
from specjax.convert.draft import map_draft_tensors
from specjax.kv_cache import init_cache, meta_at
from specjax.models import eagle
from specjax.models.eagle import EagleConfig, EagleHead

E, V, VD, EPS = 32, 97, 40, 1e-5
PAGE, PREFILL, EXTEND = 4, 5, 3
LENS = (PREFILL, PREFILL - 1)  # ragged prefill: row 1 is padded
POS0 = 3  # first position (rope must matter)


def head_config(method: str, **kw) -> dict:
    d = dict(architectures=["LlamaForCausalLM"], hidden_size=E, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=1, vocab_size=V, rms_norm_eps=EPS, rope_theta=10000.0,
             hidden_act="silu")
    if method == "eagle3":
        d.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    d.update(kw)
    return d


def target_config(layers: int = 4):
    return tiny_config(num_hidden_layers=layers)


def head_state_dict(method: str, hc: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random head weights in the public (EAGLE repo / SpecForge) key layout."""
    g = torch.Generator().manual_seed(seed)
    H, K = hc["num_attention_heads"], hc["num_key_value_heads"]
    D, F = E // H, hc["intermediate_size"]
    w = lambda *s: 0.2 * torch.randn(*s, generator=g)
    norm = lambda: 1.0 + 0.2 * torch.randn(E, generator=g)
    e3 = method == "eagle3"
    p = "midlayer." if e3 else "layers.0."
    Ei = 2 * E if e3 else E
    sd = {"fc.weight": w(E, (3 if e3 else 2) * E)}
    if not e3:
        sd["fc.bias"] = w(E)
    sd.update({p + "self_attn.q_proj.weight": w(H * D, Ei), p + "self_attn.k_proj.weight": w(K * D, Ei),
               p + "self_attn.v_proj.weight": w(K * D, Ei), p + "self_attn.o_proj.weight": w(E, H * D),
               p + "post_attention_layernorm.weight": norm(), p + "mlp.gate_proj.weight": w(F, E),
               p + "mlp.up_proj.weight": w(F, E), p + "mlp.down_proj.weight": w(E, F)})
    if hc.get("attention_bias"):
        for n, size in (("q", H * D), ("k", K * D), ("v", K * D), ("o", E)):
            sd[p + f"self_attn.{n}_proj.bias"] = w(size)
    if e3:
        sd.update({p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
                   "norm.weight": norm(), "lm_head.weight": w(VD, E)})
        kept = torch.sort(torch.randperm(V, generator=g)[:VD]).values  # target ids of the draft vocab
        sd["d2t"] = kept - torch.arange(VD)  # int64 offsets
        sd["t2d"] = torch.zeros(V, dtype=torch.bool)
        sd["t2d"][kept] = True
    return sd


# ---- torch reference ----

def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, pos, theta=10000.0):  # x [T, N, D], rotate-half layout
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = (pos.double()[:, None] * inv).float()  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _linear(sd, name, x):
    y = x @ sd[name + ".weight"].T
    return y + sd[name + ".bias"] if name + ".bias" in sd else y


def _attention(sd, p, x, pos, H, K):  # x [T, Ei] -> [T, E], causal
    T = x.shape[0]
    q = _linear(sd, p + "q_proj", x).view(T, H, -1)
    k = _linear(sd, p + "k_proj", x).view(T, K, -1)
    v = _linear(sd, p + "v_proj", x).view(T, K, -1)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
    s = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1)
    return _linear(sd, p + "o_proj", o)


def _mlp(sd, p, x):
    return _linear(sd, p + "down_proj", torch.nn.functional.silu(_linear(sd, p + "gate_proj", x))
                   * _linear(sd, p + "up_proj", x))


def ref_features(method, sd, aux):
    """aux: list of [T, E] target hidden states -> head input feature [T, E]."""
    return aux[0] if method == "eagle" else torch.cat(aux, -1) @ sd["fc.weight"].T


def ref_head(method, sd, hc, tokens, pos, feats, embed, lm_head):
    """One row: tokens/pos [T], feats [T, E], embed [V, E], lm_head [E, V] -> (hidden, logits, target ids of argmax)."""
    H, K = hc["num_attention_heads"], hc["num_key_value_heads"]
    e = embed[tokens]
    if method == "eagle":
        p = "layers.0."
        x = _linear(sd, "fc", torch.cat([e, feats], -1))
        x = x + _attention(sd, p + "self_attn.", x, pos, H, K)  # layer 0: no input norm
    else:
        p = "midlayer."
        a = torch.cat([_rms(e, sd[p + "input_layernorm.weight"]), _rms(feats, sd[p + "hidden_norm.weight"])], -1)
        x = feats + _attention(sd, p + "self_attn.", a, pos, H, K)
    x = x + _mlp(sd, p + "mlp.", _rms(x, sd[p + "post_attention_layernorm.weight"]))
    if method == "eagle":
        logits = x @ lm_head
        ids = logits.argmax(-1)
    else:
        logits = _rms(x, sd["norm.weight"]) @ sd["lm_head.weight"].T
        ids = logits.argmax(-1)
        ids = ids + sd["d2t"][ids]
    return x, logits, ids


# ---- JAX side ----

def scattered_head_cache(cfg, max_seq=16, seed=0):
    """2 slots over interleaved, non-contiguous pages holding garbage (page 0 = trash)."""
    pps = -(-max_seq // PAGE)
    num_pages = 2 * pps + 3
    cache = eagle.init_head_cache(cfg, num_pages=num_pages, page_size=PAGE, max_slots=2, max_seq_len=max_seq,
                                  dtype=jnp.float32)
    assert len(cache.kv) == 1
    rng = np.random.default_rng(seed)
    table = rng.permutation(np.arange(1, num_pages))[: 2 * pps].reshape(2, pps).astype(np.int32)
    kv = [jnp.asarray(rng.normal(0, 50.0, a.shape), jnp.float32) for a in cache.kv]
    return dataclasses.replace(cache, kv=kv, page_table=jnp.asarray(table))


@nnx.jit
def head_step(head, tokens, positions, feats, cache, meta, embed, lm_head):
    h, cache = head(tokens, positions, feats, cache, meta, embed)
    logits = head.logits(h, lm_head)
    return h, logits, head.to_target_ids(jnp.argmax(logits, -1).astype(jnp.int32)), cache


def run_head(head, cfg, tokens, feats, embed, lm_head):
    """tokens [2, T] (T = PREFILL + EXTEND), feats [2, T, E]: prefill LENS, then the rest of each row
    (EXTEND or EXTEND + 1 tokens, padded to EXTEND + 1). Returns per row (hidden, logits, ids) over
    its real tokens."""
    cache = scattered_head_cache(cfg)
    outs = [[], []]
    start = np.zeros(2, np.int32)
    total = tokens.shape[1]
    for lens in (np.array(LENS, np.int32), total - np.array(LENS, np.int32)):
        Tc = int(lens.max())
        idx = np.minimum(start[:, None] + np.arange(Tc), total - 1)  # [2, Tc] (padding repeats junk)
        tk = np.take_along_axis(tokens, idx, 1)
        ft = np.take_along_axis(feats, idx[..., None], 1)
        meta = meta_at(cache.page_table, jnp.asarray(start), jnp.asarray(lens), Tc, PAGE)
        h, lg, ids, cache = head_step(head, jnp.asarray(tk), jnp.asarray(POS0 + idx, jnp.int32), jnp.asarray(ft),
                                      cache, meta, embed, lm_head)
        for b in range(2):
            outs[b].append(tuple(np.asarray(a[b, : lens[b]]) for a in (h, lg, ids)))
        start = start + lens
        cache = dataclasses.replace(cache, seq_lens=jnp.asarray(start))
    return [tuple(np.concatenate([o[i] for o in outs[b]]) for i in range(3)) for b in range(2)]


def assert_close(got, want, rel=1e-5, what=""):
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert err <= rel * scale, f"{what}: max abs err {err:.3g} > {rel:g} * scale {scale:.3g}"


def build_head(method, hc, sd, target_cfg):
    cfg = EagleConfig.from_hf_dict(hc, target_cfg)
    head = EagleHead(cfg, jnp.float32, nnx.Rngs(0))
    eagle.load_flat(head, map_draft_tensors(cfg, {k: v.numpy() for k, v in sd.items()}, "test", "float32"))
    return cfg, head


AUX = (1, 2, 3)  # head_config's eagle3 aux layers (public ids [0, 1, 2] + 1) on the 4-layer target


@nnx.jit(static_argnames=("aux_layers",))
def target_forward(model, tokens, positions, cache, meta, aux_layers):
    h, _, aux = model(tokens, positions, cache, meta, aux_layers=aux_layers)
    return h, aux


@pytest.fixture(scope="session")  # shared with test_convert_draft
def target():
    """(tiny 4-layer target, tokens [2, T], its final-normed hidden [2, T, E], hidden states of AUX)."""
    tcfg = target_config()
    model = tiny_model(tcfg, seed=3)
    T = PREFILL + EXTEND
    tokens = np.random.default_rng(1).integers(0, V, size=(2, T)).astype(np.int32)
    cache = init_cache(tcfg, num_pages=16, page_size=PAGE, max_slots=2, max_seq_len=16, dtype=jnp.float32)
    table = jnp.arange(1, 9, dtype=jnp.int32).reshape(2, 4)
    meta = meta_at(table, jnp.zeros(2, jnp.int32), jnp.full((2,), T, jnp.int32), T, PAGE)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    h, aux = target_forward(model, jnp.asarray(tokens), pos, dataclasses.replace(cache, page_table=table),
                            meta, aux_layers=AUX)
    return tcfg, model, tokens, h, aux


def check_against_reference(method, hc, sd, cfg, head, target):
    """Turn the target's outputs into features, run the head; compare with the torch reference row by row."""
    _, model, tokens, h, aux = target
    assert cfg.aux_layers == (AUX if method == "eagle3" else ())
    feats = np.asarray(head.features((h,) if method == "eagle" else aux))  # [2, T, E]
    embed = model.embed[...]
    lm_head = model.lm_head[...]
    got = run_head(head, cfg, tokens, feats, embed, lm_head)
    for b in range(2):
        n = got[b][0].shape[0]
        tt = lambda a, b=b, n=n: torch.from_numpy(np.array(a[b, :n]))  # row b's real tokens
        want_f = ref_features(method, sd, [tt(h)] if method == "eagle" else [tt(a) for a in aux])
        assert_close(feats[b, :n], want_f, what=f"{method} row {b} features")
        x, logits, ids = ref_head(method, sd, hc, tt(tokens).long(), POS0 + torch.arange(n), want_f,
                                  torch.from_numpy(np.array(embed)), torch.from_numpy(np.array(lm_head)))
        assert float(logits.std()) > 0.3, "reference logits too flat to be a meaningful check"
        assert_close(got[b][0], x, what=f"{method} row {b} hidden")
        assert_close(got[b][1], logits, what=f"{method} row {b} logits")
        assert got[b][1].shape[-1] == (VD if method == "eagle3" else V)
        np.testing.assert_array_equal(got[b][2], ids.numpy(), err_msg=f"{method} row {b} target ids")


@pytest.mark.parametrize("method,extra", [("eagle", {}), ("eagle", {"attention_bias": True}), ("eagle3", {})],
                         ids=["eagle", "eagle_bias", "eagle3"])
def test_head_matches_torch_reference(method, extra, target):
    hc = head_config(method, **extra)
    sd = head_state_dict(method, hc)
    cfg, head = build_head(method, hc, sd, target[0])
    assert cfg.method == method and cfg.layer.qkv_bias == bool(extra)
    if method == "eagle3":
        assert cfg.draft_vocab_size == VD and not cfg.fc_bias
    check_against_reference(method, hc, sd, cfg, head, target)


def test_param_specs_match_module_and_flat_round_trip():
    tcfg = target_config()
    for method in ("eagle", "eagle3"):
        hc = head_config(method)
        sd = head_state_dict(method, hc)
        cfg, head = build_head(method, hc, sd, tcfg)
        specs = eagle.param_specs(cfg)
        flat = eagle.flat_state(head)
        assert {k: tuple(v.shape) for k, v in flat.items()} == {k: s for k, (s, _) in specs.items()}
        if method == "eagle3":
            assert flat["d2t"].dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(flat["d2t"]), sd["d2t"].numpy())
            assert not isinstance(head.d2t, nnx.Param)
        # d2t survives split/merge; a fresh head loaded from the flat dict is identical
        gd, state = nnx.split(head)
        again = nnx.merge(gd, state)
        other = EagleHead(cfg, jnp.float32, nnx.Rngs(5))
        eagle.load_flat(other, flat)
        for k, v in eagle.flat_state(again).items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(eagle.flat_state(other)[k]), err_msg=k)
        with pytest.raises(ValueError, match="missing"):
            eagle.load_flat(other, {k: v for k, v in flat.items() if k != "mlp.w_up"})


def test_to_target_ids_identity_for_eagle1():
    _, head = build_head("eagle", head_config("eagle"), head_state_dict("eagle", head_config("eagle")),
                           target_config())
    ids = jnp.arange(10, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(head.to_target_ids(ids)), np.arange(10))


def test_config_aux_layers_and_errors():
    t8, t2 = target_config(8), target_config(2)
    # public ids are OUTPUT-of-layer: +1; order is increasing layer order
    ids = {"eagle_aux_hidden_state_layer_ids": [5, 1, 3]}
    assert EagleConfig.from_hf_dict(head_config("eagle3", eagle_config=ids), t8).aux_layers == (2, 4, 6)
    cfg = EagleConfig.from_hf_dict(head_config("eagle3", eagle_config={}), t8)
    assert cfg.aux_layers == (2, 4, 5)  # default (2, L//2, L-3)
    assert EagleConfig.from_hf_dict(head_config("eagle3", eagle_config={}), None).aux_layers == ()
    cfg1 = EagleConfig.from_hf_dict(head_config("eagle"), t8)
    assert (cfg1.method, cfg1.draft_vocab_size, cfg1.aux_layers, cfg1.fc_bias) == ("eagle", V, (), True)
    with pytest.raises(ConfigError, match="out of range"):
        EagleConfig.from_hf_dict(head_config("eagle3", eagle_config=ids), target_config(4))
    with pytest.raises(ConfigError, match="out of range"):  # default (2, 1, -1)
        EagleConfig.from_hf_dict(head_config("eagle3", eagle_config={}), t2)
    with pytest.raises(ConfigError, match="distinct aux layers"):  # default (2, 2, 1)
        EagleConfig.from_hf_dict(head_config("eagle3", eagle_config={}), target_config(4))
    with pytest.raises(ConfigError, match="hidden_size=64 != target hidden_size=32"):
        EagleConfig.from_hf_dict(head_config("eagle", hidden_size=64), t8)
    with pytest.raises(ConfigError, match="vocab_size=50 != target vocab_size=97"):
        EagleConfig.from_hf_dict(head_config("eagle", vocab_size=50), t8)
    with pytest.raises(ConfigError, match="draft_vocab_size=200 exceeds"):
        EagleConfig.from_hf_dict(head_config("eagle3", draft_vocab_size=200), t8)
    with pytest.raises(ConfigError, match="only 1-layer heads"):
        EagleConfig.from_hf_dict(head_config("eagle", num_hidden_layers=2), t8)
