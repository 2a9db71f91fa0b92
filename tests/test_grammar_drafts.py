"""Grammar drafts (specjax.grammar_drafts): the grammar's continuations drafted into the next tree.

* host: the continuations after every node of random trees equal a brute-force walk (fresh matcher,
  full mask unpacked, jump-forward string spelled by the longest allowed token), and leave the matcher
  where it was;
* sampling: the joint law of the first tokens under a grammar whose fixed text has two tokenizations
  (so grammar drafts are sometimes rejected) equals the masked target's law (chi-square), for a chain
  of sampled drafts (one-hot proposals for grammar tokens), with the grammar's token checked in place
  in the next trees; the same check rejects a law off by a temperature change, and the sampler whose
  grammar tokens keep the draft's proposal (power). EAGLE-2 trees propose point masses only, grammar
  tokens included, so their sampling is the existing tree case (tests/test_spec_sampling.py).

Through the engine (greedy, float32, outputs == plain constrained decoding, every step accepted with
the target as its own draft, acceptance with and without grammar drafts): tests/test_grammar_engine.py.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_config, tiny_model
from test_grammar_engine import CHOICE, EOS, FORCED, SCHEMA, VOCAB, CharTokenizer
from specjax.drafter import DraftInfo
from specjax.grammar import GrammarCompiler, unpack_bitmask
from specjax.grammar_drafts import continuation, tree_drafts
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

xgrammar = pytest.importorskip("xgrammar")



@pytest.fixture(scope="module")
def compiler():
    info = xgrammar.TokenizerInfo(VOCAB, vocab_size=97, stop_token_ids=[EOS])
    return GrammarCompiler(info, 97)


# ----------------------------------------------------------------------------- host

def _reference(compiler, key, prefix, max_len):
    """Brute force: a fresh matcher after prefix; per token the full mask decides (one allowed token),
    else the longest allowed token spelling a prefix of the jump-forward string; None if prefix is illegal."""
    g = compiler.matcher(key, [EOS])
    for t in prefix:
        if g.is_terminated or not g.matcher.accept_token(int(t)):
            return None
    out = []
    while len(out) < max_len and not g.is_terminated:
        allowed = np.flatnonzero(unpack_bitmask(g.next_mask(), 97))
        jump = g.matcher.find_jump_forward_string().encode()
        spell = [t for t in allowed if VOCAB[t] and jump.startswith(VOCAB[t].encode())]
        if spell:
            t = max(spell, key=lambda t: (len(VOCAB[t]), -t))
        elif len(allowed) == 1:
            t = int(allowed[0])
        else:
            break
        out.append(int(t))
        if t == EOS:
            break
        g.matcher.accept_token(int(t))
    return out + [-1] * (max_len - len(out))


@pytest.mark.parametrize("constraint", [dict(json_schema=SCHEMA), dict(choice=CHOICE), dict(regex=FORCED)],
                         ids=["json", "choice", "regex"])
def test_tree_drafts_match_brute_force(compiler, constraint):
    key = SamplingParams(**constraint).constraint
    tok = CharTokenizer()
    start = {"json_schema": '{"id": 7, "kind": "c', "choice": "", "regex": "KEY-fi"}[key[0]]
    rng = np.random.default_rng(0)
    g = compiler.matcher(key, [EOS])
    for t in tok.encode(start):
        g.accept([t])
    seen_jump = seen_single = 0
    for trial in range(6):
        prefix = tok.encode(start)
        root = prefix[-1] if prefix else 0
        n = 9
        tokens, parents = np.zeros(n, np.int32), np.full(n, -1, np.int32)
        tokens[0] = root
        for i in range(1, n):
            parents[i] = rng.integers(0, i)
            allowed = _allowed(compiler, key, prefix + [int(tokens[j]) for j in _path(parents, parents[i])])
            legal = len(allowed) > 0 and rng.random() < 0.85
            tokens[i] = rng.choice(allowed) if legal else rng.integers(0, 97)
        before = g.next_mask().copy()
        masks = g.tree_masks(tokens, parents)
        got = tree_drafts(g, tokens, parents, 4, masks=masks if trial % 2 else None)
        assert (g.next_mask() == before).all()  # the matcher is where it was
        for i in range(n):
            ref = _reference(compiler, key, prefix + [int(tokens[j]) for j in _path(parents, i)], 4)
            assert got[i].tolist() == (ref or [-1] * 4), (i, tokens.tolist(), parents.tolist())
            seen_jump += any(VOCAB[t] == "ab" for t in got[i] if t >= 0)
            seen_single += got[i][0] >= 0
    assert seen_single > 0
    if key[0] == "choice":
        assert seen_jump > 0  # the likely (jump-forward) tokens were exercised


def _allowed(compiler, key, prefix):
    """The tokens allowed after prefix (none if prefix is illegal)."""
    g = compiler.matcher(key, [EOS])
    for t in prefix:
        if g.is_terminated or not g.matcher.accept_token(int(t)):
            return np.zeros(0, np.int64)
    return np.flatnonzero(unpack_bitmask(g.next_mask(), 97))


def _path(parents, i):
    """Nodes from below the root down to i."""
    out = []
    while i > 0:
        out.append(int(i))
        i = parents[i]
    return out[::-1]


def test_continuation_ends_at_stop_and_free_choice(compiler):
    g = compiler.matcher(SamplingParams(regex="xy[0-9]").constraint, [EOS])
    assert [VOCAB[t] for t in continuation(g, 5) if t >= 0] == ["x", "y"]
    g.accept(CharTokenizer().encode("xy4"))
    assert continuation(g, 5).tolist() == [EOS, -1, -1, -1, -1]
    g.accept([EOS])
    assert continuation(g, 5).tolist() == [-1] * 5  # terminated: nothing


# ----------------------------------------------------------------------------- sampling

SV = ["a", "b", "c", "d", "cd", ""]  # 6 tokens; the last one is EOS
S_EOS = 5
S_REGEX = "([ab]cdcd)+"  # "cdcd" spelled cd|c d: the grammar drafts cd, the target may take c
K = 5  # tokens whose joint law is tested
S_PROMPT = [1, 4, 2]


@pytest.fixture(scope="module")
def small():
    cfg = tiny_config(vocab_size=6, eos_token_id=S_EOS, num_hidden_layers=1)
    info = xgrammar.TokenizerInfo(SV, vocab_size=6, stop_token_ids=[S_EOS])
    return cfg, tiny_model(cfg, seed=0, std=0.25), tiny_model(cfg, seed=11, std=0.25), GrammarCompiler(info, 6)


@pytest.fixture(scope="module")
def masked_logits(small):
    """The target's logits after every legal prefix of fewer than K tokens, masked by the grammar."""
    from specjax.kv_cache import init_cache, meta_at
    cfg, model, _, compiler = small
    key = SamplingParams(regex=S_REGEX).constraint
    prefixes, frontier = [()], [()]
    for _ in range(K - 1):
        nxt = []
        for pre in frontier:
            g = compiler.matcher(key, [S_EOS])
            g.accept(pre)
            nxt += [pre + (int(t),) for t in np.flatnonzero(unpack_bitmask(g.next_mask(), 6))]
        prefixes += nxt
        frontier = nxt
    T = len(S_PROMPT) + K - 1
    toks = np.zeros((len(prefixes), T), np.int32)
    for i, pre in enumerate(prefixes):
        toks[i, : len(S_PROMPT) + len(pre)] = S_PROMPT + list(pre)
    lens = np.array([len(S_PROMPT) + len(p) for p in prefixes], np.int32)
    n = len(prefixes)
    gd, params = nnx.split(model)

    @jax.jit
    def forward(params, toks, lens):
        m = nnx.merge(gd, params)
        cache = init_cache(cfg, num_pages=1 + 2 * n, page_size=8, max_slots=n, max_seq_len=16, dtype=jnp.float32)
        meta = meta_at(jnp.asarray(1 + np.arange(2 * n, dtype=np.int32).reshape(n, 2)), jnp.zeros(n, jnp.int32),
                       lens, T, 8)
        h, _, _ = m(toks, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (n, T)), cache, meta)
        return m.logits(h)

    logits = np.asarray(forward(params, jnp.asarray(toks), jnp.asarray(lens))).astype(np.float64)
    out = {}
    for i, pre in enumerate(prefixes):
        g = compiler.matcher(key, [S_EOS])
        g.accept(pre)
        out[pre] = np.where(unpack_bitmask(g.next_mask(), 6), logits[i, lens[i] - 1], -np.inf)
    return out


def _masked_law(masked_logits, temperature):
    """P(t_1 .. t_K) of plain constrained sampling at a temperature: {token tuple: probability > 0}."""
    from test_spec_sampling import _filtered_np
    law = {pre: _filtered_np(z, temperature, 1.0) for pre, z in masked_logits.items()}
    joint = {}
    for seq in itertools.product(range(6), repeat=K):
        p = 1.0
        for j in range(K):
            p *= law[seq[:j]][seq[j]] if seq[:j] in law else 0.0
            if p == 0.0:
                break
        if p > 0:
            joint[seq] = p
    return joint


def _grammar_samples(small, spec, temperature, rows):
    """First K tokens of `rows` requests (seeds 0..rows-1) under speculation with grammar masks and
    grammar drafts computed on the host per step, as the engine does. Also returns how many next
    trees took a grammar draft at node 1 (checked against the host's drafts)."""
    from specjax.kv_cache import init_cache
    from specjax.sampling import SamplingArrays
    from specjax.programs import compile_spec_steps
    from specjax.step import init_spec_state
    cfg, target, draft, compiler = small
    key = SamplingParams(regex=S_REGEX).constraint
    S = spec.num_steps
    steps, tw, dw = compile_spec_steps(DraftInfo("draft"), spec, *nnx.split(target), *nnx.split(draft))
    page, max_seq = 4, 32
    pps = max_seq // page
    cache = init_cache(cfg, num_pages=1 + rows * pps, page_size=page, max_slots=rows, max_seq_len=max_seq,
                       dtype=jnp.float32)
    cache.page_table = jnp.asarray(1 + np.arange(rows * pps, dtype=np.int32).reshape(rows, pps))
    dkv = init_cache(cfg, num_pages=1 + rows * pps, page_size=page, max_slots=rows, max_seq_len=max_seq,
                     dtype=jnp.float32).kv
    state = init_spec_state(cache, dkv, spec, 6)
    samp = SamplingArrays(temperature=jnp.full((rows,), temperature, jnp.float32), top_p=jnp.ones((rows,), jnp.float32),
                          top_k=jnp.zeros((rows,), jnp.int32), seed=jnp.arange(rows, dtype=jnp.uint32) * 7919 + 13)
    g0 = compiler.matcher(key, [S_EOS])
    mask0 = np.tile(g0.next_mask(), (rows, 1))
    gd0 = np.tile(continuation(g0, S + 1), (rows, 1, 1))
    toks = jnp.asarray(np.tile(np.array(S_PROMPT, np.int32), (rows, 1)))
    slots = jnp.arange(rows, dtype=jnp.int32)
    out, state = steps.prefill(tw, dw, state, toks, jnp.full((rows,), len(S_PROMPT), jnp.int32), slots, samp,
                               stochastic=True, token_mask=jnp.asarray(mask0), grammar_drafts=jnp.asarray(gd0))
    emitted = [[int(t)] for t in np.asarray(out.tokens)]
    memo, placed, accepted_steps = {}, 0, []
    while min(len(e) for e in emitted) < K:
        tt, pp = np.asarray(state.tree_tokens), np.asarray(state.tree_parents)
        masks = np.zeros((rows, spec.num_nodes, 1), np.int32)
        gds = np.zeros((rows, spec.num_nodes, S + 1), np.int32)
        for r in range(rows):
            k = (tuple(emitted[r]), tt[r].tobytes(), pp[r].tobytes())
            if k not in memo:
                g = compiler.matcher(key, [S_EOS])
                g.accept(emitted[r])
                m = g.tree_masks(tt[r], pp[r])
                memo[k] = (m, tree_drafts(g, tt[r], pp[r], S + 1, masks=m))
            masks[r], gds[r] = memo[k]
        o, state = steps.step(tw, dw, state, slots, jnp.ones((rows,), bool), samp, stochastic=True,
                              token_mask=jnp.asarray(masks), grammar_drafts=jnp.asarray(gds))
        n, t = np.asarray(o.num_accepted), np.asarray(o.tokens)
        accepted_steps.append(n)
        nxt = np.asarray(state.tree_tokens)
        for r in range(rows):
            node = 0  # the accepted path: the lowest-index child with each emitted token
            for tok in t[r, : n[r] - 1]:
                node = next(c for c in range(1, spec.num_nodes) if pp[r, c] == node and tt[r, c] == tok)
            g = gds[r, node]
            if g[0] == t[r, n[r] - 1] and g[1] >= 0:
                assert nxt[r, 1] == g[1], (r, g, nxt[r])  # the grammar's token is the next tree's node 1
                placed += 1
            emitted[r] += t[r, : n[r]].tolist()
    return np.array([e[:K] for e in emitted]), placed, np.concatenate(accepted_steps)


CHAIN = SpecConfig(method="draft", num_steps=2, topk=1)  # sampled drafts: proposals q kept per node


def _chi2(samples, law):
    from test_spec_sampling import _chi2_pvalue
    cells = {seq: i for i, seq in enumerate(law)}
    assert all(tuple(s) in cells for s in samples.tolist())  # nothing the grammar forbids
    counts = np.bincount([cells[tuple(s)] for s in samples.tolist()], minlength=len(cells))
    return _chi2_pvalue(counts, np.array(list(law.values())))


def test_sampling_with_grammar_drafts_matches_masked_law(small, masked_logits):
    """A chain of sampled drafts whose grammar tokens have one-hot proposals: the law of the first K
    tokens is the masked target's; the same samples reject the law at temperature 1.4 (power)."""
    samples, placed, n_acc = _grammar_samples(small, CHAIN, 1.0, 4000)
    law = _masked_law(masked_logits, 1.0)
    pval, stat, dof = _chi2(samples, law)
    assert pval > 1e-3, (pval, stat, dof)
    assert placed > 500  # grammar drafts went into the trees
    assert n_acc.mean() > 1.2
    other = _masked_law(masked_logits, 1.4)
    off, _, _ = _chi2(samples, {seq: other.get(seq, 0.0) for seq in law})
    assert off < 1e-6, off


def test_chi2_rejects_grammar_tokens_with_the_drafts_proposal(small, masked_logits, monkeypatch):
    """Power against the bug this path could have: a grammar token keeping the draft's proposal q
    (acceptance min(1, p / q) with q(token) < 1 favours the likely tokenization "cd" over "c")."""
    from specjax import draft_tree
    force = draft_tree.force_level

    def keep_q(spec, s, forced, tok, sc, q):
        tok, sc, _ = force(spec, s, forced, tok, sc, q)
        return tok, sc, q
    monkeypatch.setattr(draft_tree, "force_level", keep_q)
    samples, placed, _ = _grammar_samples(small, CHAIN, 1.0, 2000)
    pval, _, _ = _chi2(samples, _masked_law(masked_logits, 1.0))
    assert placed > 200 and pval < 1e-6, pval


def test_engine_drafts_skip_a_grammar_that_raises(small, caplog):
    """A row whose grammar walk raises gets no drafts (a warning says so); the other rows keep theirs;
    grammar drafts off: all -1; the n-gram drafter: none."""
    import dataclasses
    import logging
    from types import SimpleNamespace
    from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
    from specjax.scheduler import SchedulerOptions
    cfg, target, _, compiler = small
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=32), BatchOptions(max_batch=2), jnp.float32,
                 draft=Draft(target, cfg, DraftInfo("draft"), CHAIN), grammar=compiler)
    key = SamplingParams(regex="abcd").constraint

    class Broken:
        is_terminated = False

        def __getattr__(self, name):
            raise RuntimeError("matcher state lost")

    ok = SimpleNamespace(id=0, grammar=compiler.matcher(key, [S_EOS]), finished=False)
    bad = SimpleNamespace(id=1, grammar=Broken(), finished=False)
    with caplog.at_level(logging.WARNING, logger="specjax"):
        got = eng._grammar_drafts([(0, ok), (1, bad)], 2, tree=False)
    assert got[:, 0].tolist() == [[0, 1, 4], [-1, -1, -1]]  # a, b, cd (num_steps + 1 = 3 tokens)
    assert "request 1" in caplog.text and "matcher state lost" in caplog.text
    eng.opts = SchedulerOptions(grammar_drafts=False)
    assert (eng._grammar_drafts([(0, ok)], 2, tree=False) == -1).all()
    eng.draft = dataclasses.replace(eng.draft, info=DraftInfo("ngram"))
    assert eng._grammar_drafts([(0, ok)], 2, tree=False) is None


def test_drafts_pause_for_a_grammar_that_fixes_nothing(small, monkeypatch):
    """Tree drafts cost the host per node: a request whose drafts found nothing for IDLE_STEPS steps
    skips them for PAUSE_STEPS steps, then probes once (pausing again if that finds nothing); a
    grammar that fixes text keeps its drafts every step."""
    from types import SimpleNamespace
    from specjax import grammar_drafts as gd
    from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
    cfg, target, _, compiler = small
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=32), BatchOptions(max_batch=2), jnp.float32,
                 draft=Draft(target, cfg, DraftInfo("draft"), CHAIN), grammar=compiler)
    tree = (np.array([0, 1, 2], np.int32), np.array([-1, 0, 1], np.int32))  # a chain a -> b -> c
    free = SimpleNamespace(id=0, grammar=compiler.matcher(SamplingParams(regex="[abcd]*").constraint, [S_EOS]),
                           finished=False, tree=tree)
    fixed = SimpleNamespace(id=1, grammar=compiler.matcher(SamplingParams(regex="abcd").constraint, [S_EOS]),
                            finished=False, tree=tree)
    calls = {0: [], 1: []}
    real = gd.tree_drafts
    monkeypatch.setattr(gd, "tree_drafts", lambda g, *a, **k: calls[0 if g is free.grammar else 1].append(1)
                        or real(g, *a, **k))
    steps = gd.IDLE_STEPS + 2 * (gd.PAUSE_STEPS + 1) + 3
    for _ in range(steps):
        got = eng._grammar_drafts([(0, free), (1, fixed)], 2)
        assert (got[0] == -1).all() and got[1, 0].tolist() == [0, 1, 4]  # a b cd after the root
    # free: IDLE_STEPS computed, then one probe after each pause; fixed: every step
    assert len(calls[0]) == gd.IDLE_STEPS + 2 and len(calls[1]) == steps
    p = gd.Pause()  # a token found ends the pause's count at once
    for _ in range(gd.IDLE_STEPS - 1):
        p.record(False)
    p.record(True)
    p.record(False)
    assert p.wanted() and p.idle == 1
