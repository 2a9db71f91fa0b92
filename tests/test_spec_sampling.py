"""Speculative sampling through the fused step is lossless: on a tiny-vocabulary random model the
joint law of the first three generated tokens equals the exact law of plain sampling (computed
by enumerating every prefix with the target), by a chi-square test; for a chain with a sampled
draft (min(1, p/q) acceptance), for EAGLE-2 trees (point-mass proposals) and for an EAGLE-3 chain
(proposals over a reduced draft vocabulary, mapped to target ids through d2t)."""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config, tiny_model

from specjax.drafter import DraftInfo
from specjax.kv_cache import init_cache, meta_at
from specjax.sampling import SamplingArrays
from specjax.programs import compile_spec_steps
from specjax.step import init_spec_state
from specjax.tree import SpecConfig

V = 6
PROMPT = [1, 4, 2]
ROWS = 6000
PAGE = 4
MAX_SEQ = 32


def _cfg():
    return tiny_config(vocab_size=V, eos_token_id=V - 1)


@pytest.fixture(scope="module")
def models():
    cfg = _cfg()
    return cfg, tiny_model(cfg, seed=0, std=0.25), tiny_model(cfg, seed=11, std=0.25)


def _filtered_np(logits, temperature, top_p):
    """Exact sampling law of plain decoding (temperature, then top-p), numpy."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros(V, bool)
    keep[order[(before < top_p) | (np.arange(V) == 0)]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _exact_law(cfg, model, temperature, top_p, prompt=PROMPT):
    """P(t1, t2, t3) for every triple, by running the target on every prefix."""
    seqs = [prompt + list(pre) for n in range(3) for pre in itertools.product(range(V), repeat=n)]
    T = len(prompt) + 2
    toks = np.zeros((len(seqs), T), np.int32)
    lens = np.array([len(s) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    cache = init_cache(cfg, num_pages=1 + len(seqs) * 2, page_size=8, max_slots=len(seqs), max_seq_len=16,
                       dtype=jnp.float32)
    table = 1 + np.arange(len(seqs) * 2, dtype=np.int32).reshape(len(seqs), 2)
    meta = meta_at(jnp.asarray(table), jnp.zeros(len(seqs), jnp.int32), jnp.asarray(lens), T, 8)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (len(seqs), T))
    h, _, _ = model(jnp.asarray(toks), pos, cache, meta)
    logits = np.asarray(model.logits(h))  # [n, T, V]
    law = {tuple(s[len(prompt):]): _filtered_np(logits[i, len(s) - 1].astype(np.float64), temperature, top_p)
           for i, s in enumerate(seqs)}
    probs = np.zeros((V, V, V))
    for a, b, c in itertools.product(range(V), repeat=3):
        probs[a, b, c] = law[()][a] * law[(a,)][b] * law[(a, b)][c]
    return probs.reshape(-1)


def _chi2_pvalue(counts, probs):
    """Pearson chi-square p-value with cells of expected count < 5 merged into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs_c = np.append(counts[~small], counts[small].sum())
    exp_c = np.append(exp[~small], exp[small].sum())
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: (X/k)^(1/3) is approximately normal
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2)), stat, dof


def _spec_samples(cfg, target, draft, spec, temperature, top_p, rows=ROWS, info=None, draft_cfg=None,
                  prompt=PROMPT):
    """First three tokens of `rows` independent requests (seeds 0..rows-1) under speculation.
    info: the draft's DraftInfo (default: DraftInfo(spec.method)); draft_cfg: the config of the
    draft's KV layout (default: the target's); draft None: the n-gram drafter."""
    tgd, tp = nnx.split(target)
    dgd, dp = nnx.split(draft) if draft is not None else (None, None)
    steps, tw, dw = compile_spec_steps(info or DraftInfo(spec.method), spec, tgd, tp, dgd, dp)
    pps = MAX_SEQ // PAGE
    cache = init_cache(cfg, num_pages=1 + rows * pps, page_size=PAGE, max_slots=rows, max_seq_len=MAX_SEQ,
                       dtype=jnp.float32)
    table = jnp.asarray(1 + np.arange(rows * pps, dtype=np.int32).reshape(rows, pps))
    cache.page_table = table
    dkv = [] if draft is None else init_cache(draft_cfg or cfg, num_pages=1 + rows * pps, page_size=PAGE,
                                              max_slots=rows, max_seq_len=MAX_SEQ, dtype=jnp.float32).kv
    state = init_spec_state(cache, dkv, spec, V)
    samp = SamplingArrays(temperature=jnp.full((rows,), temperature, jnp.float32),
                          top_p=jnp.full((rows,), top_p, jnp.float32), top_k=jnp.zeros((rows,), jnp.int32),
                          seed=jnp.arange(rows, dtype=jnp.uint32) * 7919 + 13)
    toks = jnp.asarray(np.tile(np.array(prompt, np.int32), (rows, 1)))
    lens = jnp.full((rows,), len(prompt), jnp.int32)
    slots = jnp.arange(rows, dtype=jnp.int32)
    out, state = steps.prefill(tw, dw, state, toks, lens, slots, samp, stochastic=True)
    streams = [np.asarray(out.tokens)[:, None]]
    counts = []
    for _ in range(2):  # each step emits >= 1 token: 1 + 2 >= 3
        o, state = steps.step(tw, dw, state, slots, jnp.ones((rows,), bool), samp, stochastic=True)
        n = np.asarray(o.num_accepted)
        t = np.asarray(o.tokens)
        assert ((t >= 0) == (np.arange(t.shape[1])[None] < n[:, None])).all()
        streams.append(np.where(t >= 0, t, -1))
        counts.append(n)
    seqs = [row[row >= 0][:3] for row in np.concatenate(streams, axis=1)]
    assert all(len(s) == 3 for s in seqs)
    first3 = np.stack(seqs)
    return first3, np.stack(counts)


def _counts(first3):
    idx = first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]
    return np.bincount(idx, minlength=V ** 3)


@pytest.mark.parametrize("which,spec,temperature,top_p", [
    ("other", SpecConfig(method="draft", num_steps=2, topk=1), 0.9, 0.9),
    ("other", SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=4), 1.0, 0.85),
    ("self", SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=5), 0.8, 1.0),
])
def test_speculative_sampling_matches_plain_law(models, which, spec, temperature, top_p):
    cfg, target, other = models
    draft = target if which == "self" else other
    probs = _exact_law(cfg, target, temperature, top_p)
    first3, n_acc = _spec_samples(cfg, target, draft, spec, temperature, top_p)
    pval, stat, dof = _chi2_pvalue(_counts(first3), probs)
    assert pval > 1e-3, (pval, stat, dof)
    assert (n_acc >= 1).all() and (n_acc <= spec.num_steps + 1).all()
    assert n_acc.mean() > 1.05  # speculation does accept drafts


def test_chain_self_draft_accepts_everything(models):
    """A chain whose draft is the target samples from q = p: min(1, p/q) = 1, every draft accepted."""
    cfg, target, _ = models
    spec = SpecConfig(method="draft", num_steps=3, topk=1)
    _, n_acc = _spec_samples(cfg, target, target, spec, 0.9, 0.95, rows=256)
    assert (n_acc == spec.num_steps + 1).all()


def test_chi2_has_power(models):
    """The same check rejects a biased sampler (temperature 0.9 law vs samples at 1.3)."""
    cfg, target, other = models
    spec = SpecConfig(method="draft", num_steps=2, topk=1)
    first3, _ = _spec_samples(cfg, target, other, spec, 1.3, 1.0)
    pval, _, _ = _chi2_pvalue(_counts(first3), _exact_law(cfg, target, 0.9, 1.0))
    assert pval < 1e-6


def _eagle3(cfg):
    from test_spec_eagle import random_head
    head, ecfg = random_head(cfg, "eagle3", seed=3, draft_vocab=V - 2, aux_layers=(0, 1, 2))
    return head, ecfg, DraftInfo("eagle3", ecfg.aux_layers)


def test_eagle3_sampled_chain_matches_plain_law(models):
    """EAGLE-3 drafts from its own vocabulary (V - 2 of the V target tokens): q is mapped to target
    ids through d2t; two target tokens have q = 0 and come only from the residual max(p - q, 0)."""
    cfg, target, _ = models
    head, ecfg, info = _eagle3(cfg)
    d2t_ids = np.asarray(head.to_target_ids(jnp.arange(V - 2)))
    assert sorted(set(d2t_ids)) != list(range(V - 2))  # the mapping is not the identity
    spec = SpecConfig(method="eagle3", num_steps=2, topk=1)
    first3, n_acc = _spec_samples(cfg, target, head, spec, 0.9, 0.9, info=info, draft_cfg=ecfg.layer)
    pval, stat, dof = _chi2_pvalue(_counts(first3), _exact_law(cfg, target, 0.9, 0.9))
    assert pval > 1e-3, (pval, stat, dof)
    assert n_acc.mean() > 1.05  # drafts are accepted
    assert set(np.unique(first3)) - set(d2t_ids)  # tokens outside the draft vocabulary are emitted


def test_eagle3_chi2_has_power(models, monkeypatch):
    """The same check rejects proposals scattered without d2t (draft id d taken as target id d)."""
    from specjax import drafter
    cfg, target, _ = models
    head, ecfg, info = _eagle3(cfg)

    def unmapped(info_, draft, q, vocab_size):
        return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., : q.shape[-1]].set(q)
    monkeypatch.setattr(drafter, "probs_to_target", unmapped)
    spec = SpecConfig(method="eagle3", num_steps=2, topk=1)
    first3, _ = _spec_samples(cfg, target, head, spec, 0.9, 0.9, info=info, draft_cfg=ecfg.layer)
    pval, _, _ = _chi2_pvalue(_counts(first3), _exact_law(cfg, target, 0.9, 0.9))
    assert pval < 1e-6
