"""Fused speculative step (draft model, chain and tree, greedy) against plain greedy decoding.

The reference is specjax.decode (prefill + decode_many, greedy) of the target alone; the
speculative stream must equal it exactly (lossless), whatever the draft."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config, tiny_model

from specjax import decode
from specjax.drafter import DraftInfo
from specjax.kv_cache import init_cache
from specjax.programs import compile_spec_steps
from specjax.step import init_spec_state
from specjax.tree import SpecConfig

MAX_SEQ = 96
MAX_SLOTS = 4
K = 3  # num_steps (draft tokens per step)
SPEC_STEPS = 5
REF_TOKENS = 1 + SPEC_STEPS * 5  # enough for num_steps <= 4
PROMPT_LENS = (7, 1, 13, 20)  # slots 0..3 (slot 3 stays inactive in the steps)
PAD_T = 24


def _cache(cfg, page_size):
    pps = MAX_SEQ // page_size
    cache = init_cache(cfg, num_pages=1 + MAX_SLOTS * pps, page_size=page_size, max_slots=MAX_SLOTS,
                       max_seq_len=MAX_SEQ, dtype=jnp.float32)
    # slot s owns pages 1 + s * pps .. (page 0 = trash), in reverse order so slots are not contiguous
    table = 1 + np.arange(MAX_SLOTS)[:, None] * pps + np.arange(pps)[::-1][None, :]
    return dataclasses.replace(cache, page_table=jnp.asarray(table, jnp.int32))


def _prompt_batch(prompts, slots):
    toks = np.zeros((len(slots), PAD_T), np.int32)
    lens = np.zeros((len(slots),), np.int32)
    for r, s in enumerate(slots):
        if s < len(prompts):
            toks[r, : len(prompts[s])] = prompts[s]
            lens[r] = len(prompts[s])
    return jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(slots, jnp.int32)


@pytest.fixture(scope="module")
def setup():
    return _make_setup(0.3)


@pytest.fixture(scope="module")
def peaked():
    """A target with sharp next-token distributions: a draft = target tree keeps its greedy path."""
    return _make_setup(1.5)


def _make_setup(std):
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0, std=std)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in PROMPT_LENS]
    # reference: plain greedy decode of the target, all 4 prompts in one batch
    gd, params = nnx.split(target)
    steps, w = decode.compile_steps(gd, params)
    state = decode.DecodeState(_cache(cfg, 16), jnp.zeros((MAX_SLOTS,), jnp.int32))
    toks, lens, slots = _prompt_batch(prompts, list(range(MAX_SLOTS)))
    out, state = steps.prefill(w, state, toks, lens, slots, None, stochastic=False)
    outs, state = steps.decode_many(w, state, slots, jnp.ones((MAX_SLOTS,), bool), None,
                                    num_steps=REF_TOKENS - 1, stochastic=False)
    ref = np.concatenate([np.asarray(out.tokens)[None], np.asarray(outs.tokens)], 0).T  # [slots, REF_TOKENS]
    return cfg, target, prompts, ref


def _draft(kind, cfg, target):
    if kind == "same":
        return cfg, target
    if kind == "random":  # a different random model (1 layer, other head layout), same vocab
        dcfg = tiny_config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        return dcfg, tiny_model(dcfg, seed=1)
    # "noisy": the target's weights plus noise -> a mix of full and partial acceptances
    d = tiny_model(cfg, seed=0)
    key = jax.random.key(7)
    for _, p in nnx.iter_graph(d):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            key, sub = jax.random.split(key)
            p[...] = p[...] + 0.02 * jax.random.normal(sub, p[...].shape)
    return cfg, d


def _run_spec(setup, draft_kind, page_size, k=K, topk=1, m=None):
    cfg, target, prompts, ref = setup
    dcfg, draft = _draft(draft_kind, cfg, target)
    tgd, tp = nnx.split(target)
    dgd, dp = nnx.split(draft)
    spec = SpecConfig(method="draft", num_steps=k, topk=topk, num_draft_tokens=m)
    steps, tw, dw = compile_spec_steps(DraftInfo("draft"), spec, tgd, tp, dgd, dp)
    dkv = _cache(dcfg, page_size).kv
    state = init_spec_state(_cache(cfg, page_size), dkv, spec, cfg.vocab_size)
    # batch rows: slots 2, 0, padding (slot 6 >= MAX_SLOTS), 1, 3 (prefilled, then inactive)
    row_slots = [2, 0, 6, 1, 3]
    active = np.array([True, True, False, True, False])
    toks, lens, slots = _prompt_batch(prompts, row_slots)
    first, state = steps.prefill(tw, dw, state, toks, lens, slots, None, stochastic=False)
    first = np.asarray(first.tokens)
    streams = {s: [int(first[r])] for r, s in enumerate(row_slots) if s < MAX_SLOTS}
    frozen = (int(state.cache.seq_lens[3]), int(state.tree_tokens[3, 0]))
    pps = MAX_SEQ // page_size
    own3 = slice(1 + 3 * pps, 1 + 4 * pps)  # pages of the inactive slot 3
    kv3 = [np.asarray(a[own3]) for a in state.cache.kv + state.draft_kv]
    counts = []
    for _ in range(SPEC_STEPS):
        out, state = steps.step(tw, dw, state, slots, jnp.asarray(active), None, stochastic=False)
        tok, n, hist = np.asarray(out.tokens), np.asarray(out.num_accepted), np.asarray(out.accept_hist)
        assert tok.shape == (len(row_slots), k + 1) and hist.shape == (k + 2,)
        # (c) histogram over active rows
        assert hist.sum() == active.sum()
        np.testing.assert_array_equal(hist, np.bincount(n[active], minlength=k + 2))
        for r, s in enumerate(row_slots):
            if active[r]:
                assert 1 <= n[r] <= k + 1
                assert (tok[r, : n[r]] >= 0).all() and (tok[r, n[r]:] == -1).all()
                streams[s] += [int(t) for t in tok[r, : n[r]]]
            else:
                assert n[r] == 0 and (tok[r] == -1).all()
        counts.append(n[active])
        # seq_len bookkeeping: target L = prompt + emitted - 1 (the last token is not in the cache)
        for s in (0, 1, 2):
            assert int(state.cache.seq_lens[s]) == len(prompts[s]) + len(streams[s]) - 1
            assert int(state.tree_tokens[s, 0]) == streams[s][-1]  # the next tree's root
            assert int(state.draft_seq_lens[s]) == int(state.cache.seq_lens[s]) + 1
    # the inactive, prefilled slot 3 did not move
    assert (int(state.cache.seq_lens[3]), int(state.tree_tokens[3, 0])) == frozen
    # the inactive slot's pages (target and draft) were not written
    for a, b in zip(kv3, state.cache.kv + state.draft_kv):
        np.testing.assert_array_equal(a, np.asarray(b[own3]))
    return streams, np.stack(counts), ref, prompts


@pytest.mark.parametrize("page_size,topk,m", [(4, 1, None), (16, 1, None), (1, 2, 6), (4, 3, 8)])
def test_draft_equals_target_accepts_everything(peaked, page_size, topk, m):
    """(a) draft = target: every draft accepted (tau = num_steps + 1), stream == plain greedy.
    Proves acceptance and, for trees, compaction. A tree keeps the greedy path only if EAGLE-2's
    pruning does not cut it, which the sharp distributions of this target ensure."""
    streams, counts, ref, _ = _run_spec(peaked, "same", page_size, K, topk, m)
    assert (counts == K + 1).all()
    assert counts.shape == (SPEC_STEPS, 3)
    for s, got in streams.items():
        want = list(ref[s][: 1 + SPEC_STEPS * (K + 1)]) if s != 3 else [ref[3][0]]  # slot 3: inactive
        assert got == want, s


@pytest.mark.parametrize("draft_kind,page_size,k,topk,m", [
    ("random", 4, K, 1, None), ("noisy", 16, K, 1, None), ("noisy", 4, 1, 1, None),
    ("random", 1, K, 3, 8), ("noisy", 4, K, 2, 6), ("noisy", 16, 4, 4, 16)])
def test_other_draft_is_lossless(setup, draft_kind, page_size, k, topk, m):
    """(b) a different draft model: the emitted stream equals plain greedy exactly, for 3 ragged
    prompts with an inactive padding row and an inactive real slot in the batch."""
    streams, counts, ref, _ = _run_spec(setup, draft_kind, page_size, k, topk, m)
    for s, got in streams.items():
        if s == 3:
            assert len(got) == 1 and got[0] == ref[3][0]
            continue
        assert len(got) >= 1 + SPEC_STEPS
        assert got == list(ref[s][: len(got)]), (s, got, list(ref[s]))
    if draft_kind == "noisy" and topk == 1:  # full and partial acceptances both happen
        assert (counts == k + 1).any() and (counts < k + 1).any(), counts


def test_reference_is_not_degenerate(setup):
    ref = setup[3]
    assert len({tuple(r) for r in ref}) == len(ref)
    assert all(len(set(r)) >= 4 for r in ref)
