"""Repetition / frequency / presence penalties (specjax.penalties), alone and wired into the steps.

* the pure functions against a numpy reference (state updates, dense and path-token penalties,
  the tree path lists);
* plain greedy decoding with penalties equals a brute-force loop that recomputes the whole
  sequence's logits for every token and penalises them in numpy;
* speculative greedy decoding (draft model, chains and trees, page sizes 4 / 16) with penalties
  equals plain decoding with penalties token for token; a penalty state whose penalties are all
  off changes nothing;
* speculative sampling with penalties follows the exact penalised law (chi-square on a 6-token
  vocabulary; every sample inside the support).
The steps are driven directly, as in tests/test_step.py."""
from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import chi2_pvalue, tiny_config, tiny_model

from specjax import decode
from specjax import penalties as P
from specjax.drafter import DraftInfo
from specjax.kv_cache import init_cache, meta_at
from specjax.sampling import SamplingArrays
from specjax.sampling_params import SamplingParams, SamplingParamsError
from specjax.programs import compile_spec_steps
from specjax.step import init_spec_state
from specjax.tree import SpecConfig, chain_tree, make_tree

MAX_SEQ = 96
SLOTS = 4
PROMPT_LENS = (7, 1, 13, 20)
PAD_T = 24
GEN = 24  # plain reference length
SPEC_STEPS = 5
# one parameter set per slot: repetition only, frequency + presence, all off, all three
PARAMS = [SamplingParams(temperature=0, repetition_penalty=1.6),
          SamplingParams(temperature=0, frequency_penalty=0.8, presence_penalty=0.6),
          SamplingParams(temperature=0),
          SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=-0.4, presence_penalty=1.5)]


# ----------------------------------------------------------------------------- numpy reference

def np_penalize(logits, prompt, output, rep, freq, pres):
    """Reference: logits [V] float32 of the next token after prompt + output."""
    x = np.asarray(logits, np.float32)
    V = x.shape[-1]
    c = np.bincount(np.asarray(output, np.int64), minlength=V)[:V]
    seen = c > 0
    seen[np.asarray(prompt, np.int64)] = True
    r = np.where(seen, np.float32(rep), np.float32(1.0))
    x = np.where(x > 0, x / r, x * r)
    return x - np.float32(freq) * c.astype(np.float32) - np.float32(pres) * (c > 0).astype(np.float32)


# ----------------------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", True), ("repetition_penalty", "1.2"), ("frequency_penalty", 2.01),
    ("frequency_penalty", -3), ("frequency_penalty", math.nan), ("presence_penalty", 2.5),
    ("presence_penalty", None)])
def test_params_refused(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value)


def test_params_defaults_and_flag():
    p = SamplingParams()
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.has_penalties) == (1.0, 0.0, 0.0, False)
    q = SamplingParams(repetition_penalty=2, frequency_penalty=-2, presence_penalty=2)
    assert q.has_penalties and isinstance(q.repetition_penalty, float)
    assert SamplingParams(presence_penalty=0.1).has_penalties
    arr = P.penalty_params([q, None])
    np.testing.assert_array_equal(np.asarray(arr.repetition), [2.0, 1.0])
    np.testing.assert_array_equal(np.asarray(arr.frequency), [-2.0, 0.0])


# ----------------------------------------------------------------------------- pure functions

def test_state_updates_match_numpy():
    S, V = 5, 11
    st = P.init_penalty_state(S, V)
    toks = jnp.asarray([[3, 3, 9, 0], [1, 2, 0, 0], [4, 4, 4, 4]], jnp.int32)
    lens = jnp.asarray([3, 1, 4], jnp.int32)
    slots = jnp.asarray([3, 0, 7], jnp.int32)  # row 2 is padding (slot >= S)
    prm = P.PenaltyParams(*(jnp.asarray(v, jnp.float32) for v in ([1.5, 0.5, 9.0], [0.1, 0.2, 9.0], [0.3, 0.4, 9.0])))
    st = P.set_slots(st, slots, toks, lens, prm)
    mask = np.zeros((S, V), bool)
    mask[3, [3, 9]] = True
    mask[0, 1] = True
    np.testing.assert_array_equal(np.asarray(st.prompt_mask), mask)
    np.testing.assert_array_equal(np.asarray(st.rep), [0.5, 1, 1, 1.5, 1])
    np.testing.assert_array_equal(np.asarray(st.pres), np.float32([0.4, 0, 0, 0.3, 0]))
    # add: first counts[b] tokens; -1 ignored; padding slot dropped
    st = P.add_tokens(st, jnp.asarray([3, 0, 9], jnp.int32), jnp.asarray([[5, 5, -1, 7], [2, 8, 8, 8], [1, 1, 1, 1]]),
                      jnp.asarray([4, 2, 4], jnp.int32))
    want = np.zeros((S, V), np.int32)
    want[3, 5], want[3, 7], want[0, 2], want[0, 8] = 2, 1, 1, 1
    np.testing.assert_array_equal(np.asarray(st.out_counts), want)
    # a new prefill of slot 3 resets it, params None = off; slot 0 untouched
    st = P.set_slots(st, jnp.asarray([3], jnp.int32), jnp.asarray([[6]], jnp.int32), jnp.asarray([1], jnp.int32))
    assert np.asarray(st.out_counts)[3].sum() == 0 and np.asarray(st.prompt_mask)[3].tolist() == [i == 6 for i in range(V)]
    assert (float(st.rep[3]), float(st.freq[3]), float(st.pres[3])) == (1.0, 0.0, 0.0)
    np.testing.assert_array_equal(np.asarray(st.out_counts)[0], want[0])


def _random_state(rng, B, V):
    prompts = [rng.integers(0, V, size=rng.integers(0, 6)) for _ in range(B)]
    outs = [rng.integers(0, V, size=rng.integers(0, 8)) for _ in range(B)]
    rep = rng.uniform(0.5, 2.0, B).astype(np.float32)
    freq = rng.uniform(-2, 2, B).astype(np.float32)
    pres = rng.uniform(-2, 2, B).astype(np.float32)
    mask = np.zeros((B, V), bool)
    cnt = np.zeros((B, V), np.int32)
    for b in range(B):
        mask[b, prompts[b]] = True
        cnt[b] = np.bincount(outs[b], minlength=V)
    rows = P.PenaltyState(jnp.asarray(mask), jnp.asarray(cnt), jnp.asarray(rep), jnp.asarray(freq), jnp.asarray(pres))
    return rows, prompts, outs, rep, freq, pres


def test_apply_matches_numpy_and_off_is_identity():
    rng = np.random.default_rng(1)
    B, V = 6, 13
    rows, prompts, outs, rep, freq, pres = _random_state(rng, B, V)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    got = np.asarray(P.apply(jnp.asarray(logits), rows))
    for b in range(B):
        np.testing.assert_allclose(got[b], np_penalize(logits[b], prompts[b], outs[b], rep[b], freq[b], pres[b]),
                                   rtol=1e-6, atol=1e-6)
    # penalties off: bit for bit, even with counts and prompt tokens present (also -inf logits)
    off = dataclasses.replace(rows, rep=jnp.ones(B), freq=jnp.zeros(B), pres=jnp.zeros(B))
    logits[0, 2] = -np.inf
    np.testing.assert_array_equal(np.asarray(P.apply(jnp.asarray(logits), off)), logits)


def test_apply_with_path_tokens_matches_numpy():
    """[B, N, V] logits, per-node path tokens with duplicates (also of already counted tokens) and
    -1 padding: equals the numpy reference with the path appended to the output."""
    rng = np.random.default_rng(2)
    B, N, D, V = 3, 7, 4, 9
    rows, prompts, outs, rep, freq, pres = _random_state(rng, B, V)
    logits = rng.normal(size=(B, N, V)).astype(np.float32) * 3
    path = rng.integers(0, V, size=(B, N, D)).astype(np.int32)
    path[:, :, 1] = path[:, :, 0]  # duplicates
    depth = rng.integers(0, D + 1, size=(B, N))
    path = np.where(np.arange(D)[None, None] < depth[:, :, None], path, -1)
    got = np.asarray(P.apply(jnp.asarray(logits), rows, jnp.asarray(path)))
    for b, i in itertools.product(range(B), range(N)):
        extra = path[b, i][path[b, i] >= 0]
        want = np_penalize(logits[b, i], prompts[b], np.concatenate([outs[b], extra]), rep[b], freq[b], pres[b])
        np.testing.assert_allclose(got[b, i], want, rtol=1e-6, atol=1e-6)
    # [B, V] logits with [B, D] path tokens
    got2 = np.asarray(P.apply(jnp.asarray(logits[:, 0]), rows, jnp.asarray(path[:, 0])))
    np.testing.assert_allclose(got2, got[:, 0], rtol=1e-6, atol=1e-6)


def test_tree_path_tokens():
    rng = np.random.default_rng(3)
    B, N, D = 4, 9, 4
    parents = np.full((B, N), -1, np.int32)
    depth = np.zeros((B, N), np.int32)
    for b in range(B):  # random trees, nodes ordered by depth
        for i in range(1, N):
            cands = [j for j in range(i) if depth[b, j] < D and depth[b, j] >= depth[b, i - 1] - 1]
            parents[b, i] = rng.choice(cands)
            depth[b, i] = depth[b, parents[b, i]] + 1
    tokens = rng.integers(0, 50, size=(B, N)).astype(np.int32)
    tree = make_tree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(depth), D)
    got = np.asarray(P.tree_path_tokens(tree))
    assert got.shape == (B, N, D)
    for b, i in itertools.product(range(B), range(N)):
        path, j = [], i
        while j > 0:
            path.append(tokens[b, j])
            j = parents[b, j]
        want = path[::-1] + [-1] * (D - len(path))
        assert got[b, i].tolist() == want, (b, i)
    ch = chain_tree(jnp.asarray([5, 6]), jnp.asarray([[1, 2, 3], [4, 4, 0]]))
    np.testing.assert_array_equal(np.asarray(P.tree_path_tokens(ch))[1],
                                  [[-1, -1, -1], [4, -1, -1], [4, 4, -1], [4, 4, 0]])


# ----------------------------------------------------------------------------- models and drivers

def _cache(cfg, page_size):
    pps = MAX_SEQ // page_size
    cache = init_cache(cfg, num_pages=1 + SLOTS * pps, page_size=page_size, max_slots=SLOTS,
                       max_seq_len=MAX_SEQ, dtype=jnp.float32)
    table = 1 + np.arange(SLOTS)[:, None] * pps + np.arange(pps)[::-1][None, :]  # non-contiguous pages
    return dataclasses.replace(cache, page_table=jnp.asarray(table, jnp.int32))


def _batch(prompts, row_slots):
    toks = np.zeros((len(row_slots), PAD_T), np.int32)
    lens = np.zeros((len(row_slots),), np.int32)
    for r, s in enumerate(row_slots):
        if s < len(prompts):
            toks[r, : len(prompts[s])] = prompts[s]
            lens[r] = len(prompts[s])
    return jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(row_slots, jnp.int32)


def _row_params(params, row_slots):
    return P.penalty_params([params[s] if s < len(params) else None for s in row_slots])


def brute_force(cfg, model, prompts, params, n):
    """Greedy tokens of every prompt: full-sequence logits per token, numpy penalties."""
    B = len(prompts)
    T = max(len(p) for p in prompts) + n
    gd, st = nnx.split(model)

    @jax.jit
    def last_logits(st, toks, lens):
        m = nnx.merge(gd, st)
        pp = -(-T // 8)
        cache = init_cache(cfg, num_pages=1 + B * pp, page_size=8, max_slots=B, max_seq_len=T, dtype=jnp.float32)
        table = jnp.asarray(1 + np.arange(B * pp, dtype=np.int32).reshape(B, pp))
        meta = meta_at(table, jnp.zeros((B,), jnp.int32), lens, T, 8)
        h, _, _ = m(toks, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), cache, meta)
        h_last = jnp.take_along_axis(h, (lens - 1)[:, None, None], axis=1)
        return m.logits(h_last)[:, 0]

    outs = [[] for _ in prompts]
    for _ in range(n):
        seqs = [list(p) + o for p, o in zip(prompts, outs)]
        toks = np.zeros((B, T), np.int32)
        for b, s in enumerate(seqs):
            toks[b, : len(s)] = s
        lg = np.asarray(last_logits(st, jnp.asarray(toks), jnp.asarray([len(s) for s in seqs], jnp.int32)))
        for b in range(B):
            p = params[b]
            x = np_penalize(lg[b], prompts[b], outs[b], p.repetition_penalty, p.frequency_penalty,
                            p.presence_penalty)
            outs[b].append(int(np.argmax(x)))
    return np.asarray(outs)


def plain(cfg, model, prompts, params, n, with_state=True):
    """prefill + decode_many (greedy). params None: no penalty arguments at all. -> ([slots, n], state)."""
    steps, w = decode.compile_steps(*nnx.split(model))
    pen = P.init_penalty_state(SLOTS, cfg.vocab_size) if with_state else None
    state = decode.DecodeState(_cache(cfg, 16), jnp.zeros((SLOTS,), jnp.int32), pen)
    row_slots = [2, 0, 6, 1, 3]  # 6: padding
    toks, lens, slots = _batch(prompts, row_slots)
    kw = {} if params is None else {"penalty_params": _row_params(params, row_slots)}
    first, state = steps.prefill(w, state, toks, lens, slots, None, stochastic=False, **kw)
    first = np.asarray(first.tokens)
    outs, state = steps.decode_many(w, state, slots, jnp.asarray([True, True, False, True, True]), None,
                                    num_steps=n - 1, stochastic=False)
    rest = np.asarray(outs.tokens)  # [n - 1, rows]
    stream = np.zeros((SLOTS, n), np.int64)
    for r, s in enumerate(row_slots):
        if s < SLOTS:
            stream[s] = [first[r]] + rest[:, r].tolist()
    return stream, state


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0, std=0.3)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in PROMPT_LENS]
    ref, state = plain(cfg, target, prompts, PARAMS, GEN)
    return cfg, target, prompts, ref, state


def test_plain_greedy_equals_brute_force(setup):
    cfg, target, prompts, ref, state = setup
    want = brute_force(cfg, target, prompts, PARAMS, GEN)
    np.testing.assert_array_equal(ref, want)
    # the counts hold every emitted token
    for s in range(SLOTS):
        np.testing.assert_array_equal(np.asarray(state.penalties.out_counts[s]), np.bincount(ref[s], minlength=97))
    # the penalties matter: without them the penalised slots decode differently
    off = brute_force(cfg, target, prompts, [SamplingParams(temperature=0)] * SLOTS, GEN)
    for s, p in enumerate(PARAMS):
        assert (off[s] != ref[s]).any() == p.has_penalties, s
    assert max(np.bincount(off[0]).max(), np.bincount(off[1]).max()) >= 3  # unpenalised output repeats


def test_plain_penalties_off_unchanged(setup):
    """No penalty state, or a penalty state with every penalty off (params None / neutral): the
    unpenalised stream; the off slot of the penalised run agrees too."""
    cfg, target, prompts, ref, _ = setup
    none, st = plain(cfg, target, prompts, None, GEN, with_state=False)
    assert st.penalties is None
    neutral, _ = plain(cfg, target, prompts, None, GEN, with_state=True)
    np.testing.assert_array_equal(none, neutral)
    np.testing.assert_array_equal(none[2], ref[2])
    with pytest.raises(ValueError, match="penalty"):
        steps, w = decode.compile_steps(*nnx.split(target))
        state = decode.DecodeState(_cache(cfg, 16), jnp.zeros((SLOTS,), jnp.int32))
        toks, lens, slots = _batch(prompts, [0, 1])
        steps.prefill(w, state, toks, lens, slots, None, stochastic=False,
                      penalty_params=_row_params(PARAMS, [0, 1]))


def _draft(kind, cfg, target):
    if kind == "same":
        return cfg, target
    if kind == "random":  # another random model with another layout, same vocabulary
        dcfg = tiny_config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        return dcfg, tiny_model(dcfg, seed=1)
    d = tiny_model(cfg, seed=0)  # "noisy": the target plus noise
    key = jax.random.key(7)
    for _, p in nnx.iter_graph(d):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            key, sub = jax.random.split(key)
            p[...] = p[...] + 0.02 * jax.random.normal(sub, p[...].shape)
    return cfg, d


_COMPILED = {}  # jitted steps shared by the tests (drafts of one layout share the programs)


def _steps(target, draft, sc, layout):
    key = (id(target), layout, sc)
    if key not in _COMPILED:
        _COMPILED[key] = compile_spec_steps(DraftInfo("draft"), sc, *nnx.split(target), *nnx.split(draft))[:2]
    steps, tw = _COMPILED[key]
    return steps, tw, jax.tree.leaves(nnx.split(draft)[1])


def spec(setup, kind, page_size, k, topk=1, m=None, params=PARAMS, with_state=True):
    """Greedy speculative streams per slot (slot 3 prefilled, then inactive). -> (streams, accept counts, state)."""
    cfg, target, prompts = setup[:3]
    dcfg, draft = _draft(kind, cfg, target)
    sc = SpecConfig(method="draft", num_steps=k, topk=topk, num_draft_tokens=m)
    steps, tw, dw = _steps(target, draft, sc, kind == "random")
    pen = P.init_penalty_state(SLOTS, cfg.vocab_size) if with_state else None
    state = init_spec_state(_cache(cfg, page_size), _cache(dcfg, page_size).kv, sc, cfg.vocab_size, penalties=pen)
    row_slots = [2, 0, 6, 1, 3]
    active = jnp.asarray([True, True, False, True, False])
    toks, lens, slots = _batch(prompts, row_slots)
    kw = {} if params is None else {"penalty_params": _row_params(params, row_slots)}
    first, state = steps.prefill(tw, dw, state, toks, lens, slots, None, stochastic=False, **kw)
    streams = {s: [int(t)] for s, t in zip(row_slots, np.asarray(first.tokens)) if s < SLOTS}
    counts = []
    for _ in range(SPEC_STEPS):
        out, state = steps.step(tw, dw, state, slots, active, None, stochastic=False)
        tok, n = np.asarray(out.tokens), np.asarray(out.num_accepted)
        for r, s in enumerate(row_slots):
            if bool(active[r]):
                streams[s] += tok[r, : n[r]].tolist()
        counts.append(n[np.asarray(active)])
    return streams, np.stack(counts), state


@pytest.mark.parametrize("kind,page_size,k,topk,m", [
    ("same", 4, 3, 1, None), ("noisy", 16, 4, 1, None), ("noisy", 4, 3, 2, 6), ("random", 16, 3, 3, 8)])
def test_spec_greedy_equals_plain(setup, kind, page_size, k, topk, m):
    streams, counts, state = spec(setup, kind, page_size, k, topk, m)
    ref = setup[3]
    for s, got in streams.items():
        assert len(got) >= (1 if s == 3 else 1 + SPEC_STEPS)
        assert got == ref[s][: len(got)].tolist(), (s, got, ref[s].tolist())
        # counts: every emitted token (the inactive slot 3: its first token only)
        np.testing.assert_array_equal(np.asarray(state.penalties.out_counts[s]), np.bincount(got, minlength=97))
    if kind == "same" and topk == 1:  # the draft is penalised like the target: every draft accepted
        assert (counts == k + 1).all(), counts
    else:
        assert (counts >= 1).all() and (counts <= k + 1).all()


def test_spec_penalties_off_unchanged(setup):
    """A spec state carrying a penalty state whose penalties are off (no params at prefill) emits
    the unpenalised stream (a state without one: tests/test_step.py)."""
    cfg, target, prompts = setup[:3]
    want, _ = plain(cfg, target, prompts, None, GEN, with_state=False)
    streams, _, _ = spec(setup, "noisy", 4, 3, 2, 6, params=None)
    for s, got in streams.items():
        assert got == want[s][: len(got)].tolist(), s


# ----------------------------------------------------------------------------- sampling law

V6 = 6
PROMPT6 = [1, 4, 2, 1]
ROWS = 3000
PEN6 = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.5, frequency_penalty=0.7,
                      presence_penalty=0.5)


@pytest.fixture(scope="module")
def small():
    cfg = tiny_config(vocab_size=V6, eos_token_id=V6 - 1)
    return cfg, tiny_model(cfg, seed=0, std=0.25), tiny_model(cfg, seed=11, std=0.25)


def _law(logits, temperature, top_p):
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    cut = np.cumsum(p[order]) - p[order] >= top_p
    cut[0] = False
    p[order[cut]] = 0.0
    return p / p.sum()


_LAWS = {}


def exact_law(cfg, model, params, penalised=True):
    """P(t1, t2, t3) of plain sampling, enumerating every prefix of up to two tokens."""
    key = (id(model), penalised)
    if key not in _LAWS:
        _LAWS[key] = _exact_law(cfg, model, params, penalised)
    return _LAWS[key]


def _exact_law(cfg, model, params, penalised):
    prefixes = [()] + [(a,) for a in range(V6)] + list(itertools.product(range(V6), repeat=2))
    seqs = [PROMPT6 + list(q) for q in prefixes]
    T = len(PROMPT6) + 2
    toks = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    lens = np.array([len(s) for s in seqs], np.int32)
    cache = init_cache(cfg, num_pages=1 + len(seqs), page_size=8, max_slots=len(seqs), max_seq_len=8,
                       dtype=jnp.float32)
    meta = meta_at(jnp.asarray(1 + np.arange(len(seqs), dtype=np.int32)[:, None]), jnp.zeros(len(seqs), jnp.int32),
                   jnp.asarray(lens), T, 8)
    h, _, _ = model(jnp.asarray(toks), jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (len(seqs), T)), cache, meta)
    lg = np.asarray(model.logits(h))
    law = {}
    for i, q in enumerate(prefixes):
        x = lg[i, lens[i] - 1]
        if penalised:
            x = np_penalize(x, PROMPT6, list(q), params.repetition_penalty, params.frequency_penalty,
                            params.presence_penalty)
        law[q] = _law(x, params.temperature, params.top_p)
    probs = np.zeros((V6,) * 3)
    for a, b, c in itertools.product(range(V6), repeat=3):
        probs[a, b, c] = law[()][a] * law[(a,)][b] * law[(a, b)][c]
    return probs.reshape(-1)


def spec_samples(cfg, target, draft, sc, params, rows=ROWS):
    """First three tokens of `rows` requests (seeds differ) under speculative sampling with penalties."""
    steps, tw, dw = _steps(target, draft, sc, "small")
    pps = 4
    def cache():
        c = init_cache(cfg, num_pages=1 + rows * pps, page_size=4, max_slots=rows, max_seq_len=16, dtype=jnp.float32)
        return dataclasses.replace(c, page_table=jnp.asarray(1 + np.arange(rows * pps, dtype=np.int32).reshape(rows, pps)))
    state = init_spec_state(cache(), cache().kv, sc, V6, penalties=P.init_penalty_state(rows, V6))
    samp = SamplingArrays(temperature=jnp.full((rows,), params.temperature, jnp.float32),
                          top_p=jnp.full((rows,), params.top_p, jnp.float32), top_k=jnp.zeros((rows,), jnp.int32),
                          seed=jnp.arange(rows, dtype=jnp.uint32) * 7919 + 13)
    slots = jnp.arange(rows, dtype=jnp.int32)
    out, state = steps.prefill(tw, dw, state, jnp.asarray(np.tile(np.int32(PROMPT6), (rows, 1))),
                               jnp.full((rows,), len(PROMPT6), jnp.int32), slots, samp, stochastic=True,
                               penalty_params=P.penalty_params([params] * rows))
    cols, n_acc = [np.asarray(out.tokens)[:, None]], []
    for _ in range(2):
        o, state = steps.step(tw, dw, state, slots, jnp.ones((rows,), bool), samp, stochastic=True)
        cols.append(np.asarray(o.tokens))
        n_acc.append(np.asarray(o.num_accepted))
    allt = np.concatenate(cols, axis=1)
    first3 = np.stack([r[r >= 0][:3] for r in allt])
    idx = first3[:, 0] * V6 * V6 + first3[:, 1] * V6 + first3[:, 2]
    return np.bincount(idx, minlength=V6 ** 3), np.stack(n_acc)


@pytest.mark.parametrize("which,sc", [
    ("other", SpecConfig(method="draft", num_steps=2, topk=1)),  # sampled chain drafts: min(1, p/q)
    ("other", SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=4)),  # tree: point masses
])
def test_spec_sampling_follows_penalised_law(small, which, sc):
    cfg, target, other = small
    counts, n_acc = spec_samples(cfg, target, other, sc, PEN6)
    probs = exact_law(cfg, target, PEN6)
    assert counts[probs == 0].sum() == 0  # every sample inside the support (top-p cuts some triples)
    assert (probs == 0).any()
    assert chi2_pvalue(counts, probs) > 1e-3
    assert chi2_pvalue(counts, exact_law(cfg, target, PEN6, penalised=False)) < 1e-6  # the check has power
    assert n_acc.mean() > 1.05


def test_spec_sampling_self_draft_accepts_everything(small):
    """Chain drafts of the target itself, penalised alike: q = p, every draft accepted."""
    cfg, target, _ = small
    _, n_acc = spec_samples(cfg, target, target, SpecConfig(method="draft", num_steps=2, topk=1), PEN6)
    assert (n_acc == 3).all()
