"""Regex / choice constraints on the device (specjax.device_dfa, specjax.engine_dfa), on the tiny
random model of tests/test_grammar_engine.py (97 single-character tokens that xgrammar reads):

* the device ops against the token DFA on the host: masks, steps, the states along a draft tree;
* masked sampling draws from the renormalised masked distribution (chi-square), plain and through
  tree verification (the node states mask the target), never a forbidden token;
* through the engine: greedy outputs with the device DFA equal the xgrammar host path's, token for
  token (plain, chain and tree speculation, in batches mixing DFA, host-grammar (EBNF) and
  unconstrained rows), and so do sampled ones; DFA-only batches run several steps per dispatch; the
  outputs match re.fullmatch; slots reused after DFA requests decode as before (no leak); a DFA over
  the static limits, or an unsupported pattern, takes the host path (counted), an invalid one fails
  its request alone; different regexes compile no new program;
* JSON schemas through the engine (tests/test_json_schema_dfa.py has the converter): greedy outputs
  with the device DFA equal the host path's token for token, plain and tree-speculative, in a batch
  with an unconstrained row; the schema rows are counted as device-DFA requests, every token is one
  the DFA allows and the finished outputs parse and validate (jsonschema); unsupported schemas take
  the host path (counted, with the reason) with the same outputs, an invalid one fails alone with the
  host path's error.
"""
from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import chi2_pvalue, tiny_config, tiny_model
from specjax import device_dfa as dfa_lib
from specjax import sampling
from specjax.dfa_routing import DeviceDFA
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.grammar import GrammarCompiler
from specjax.regex_dfa import compile_regex
from specjax.request import Request
from specjax.sampling import SamplingArrays
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions
from specjax.token_dfa import build_token_dfa, vocab_token_bytes
from specjax.tree import SpecConfig, make_tree
from specjax.verify import verify_tree
from test_compile_once import CompileCounter
from test_grammar_engine import CHARS, EOS, MAX_SEQ, VOCAB, CharTokenizer

xgrammar = pytest.importorskip("xgrammar")

REGEXES = [r"[a-f]{2,5}(-[0-9]{1,3})?", r"(yes|no)!", r"\d{1,3}(\.\d+)?", r"[A-Z][a-z]*( [A-Z][a-z]*){0,3}"]
MIXED = [dict(regex=REGEXES[0]), dict(choice=["red", "green", "blue"]), {}, dict(regex=REGEXES[1]),
         dict(grammar='root ::= "[" ("true" | "false") (", " ("true" | "false"))? "]"'), dict(regex=REGEXES[2]),
         dict(regex=REGEXES[3]), {}]
DRAFTS = {"plain": None, "tree": ("other", 3, 2, 5), "self": ("self", 3, 1, 3),
          "tree-ngram-branch": ("other", 3, 2, 5, 3),  # + 3 n-gram nodes (SpecConfig.ngram_branch)
          "eagle3": ("eagle3", 3, 2, 5)}  # a random EAGLE-3 head: lazy steps for large batches
FORCED = r"KEY-fixed-text-then-more-fixed-text;[\s\S]*"  # a long fixed run, then anything


def char_info():
    return xgrammar.TokenizerInfo(VOCAB, vocab_size=97, stop_token_ids=[EOS])


def token_dfa(pattern):
    info = char_info()
    return build_token_dfa(compile_regex(pattern, xgrammar=True), vocab_token_bytes(info), [EOS], 97)


# ----------------------------------------------------------------------------- device ops

def test_device_ops_follow_the_token_dfa():
    """mask_logits / step_states / tree_states on padded per-slot tables equal the host TokenDFA;
    a slot with state -1 is unmasked and does not move."""
    td = token_dfa(REGEXES[0])
    dev = DeviceDFA(td, (EOS,))
    cls, nxt = dev.padded(16, 32)
    a, b = (VOCAB.index(c) for c in "a-")
    s0 = td.step(td.step(0, a), a)  # after "aa": a-f, "-" or the end
    tables = dfa_lib.init_tables(4, 97, 16, 32)
    slots = jnp.array([2, 0], jnp.int32)
    tables = dfa_lib.admit(tables, slots, jnp.asarray(np.stack([cls] * 2)), jnp.asarray(np.stack([nxt] * 2)),
                           jnp.array([s0, -1], jnp.int32))
    v = dfa_lib.view(tables, slots)
    assert v.state.tolist() == [s0, -1]
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 97)), jnp.float32)
    masked = np.asarray(dfa_lib.mask_logits(logits, v))
    np.testing.assert_array_equal(np.isfinite(masked[0]), td.allowed(s0))
    np.testing.assert_array_equal(masked[1], np.asarray(logits[1]))
    assert dfa_lib.advance(v, jnp.array([b, b]), jnp.array([True, True])).tolist() == [td.step(s0, b), -1]
    # a tree below s0: node states follow the paths, -1 below a forbidden token ("a-" then "-")
    tokens = jnp.array([[0, a, b, a, VOCAB.index("5")]], jnp.int32)
    parents = jnp.array([[-1, 0, 0, 1, 2]], jnp.int32)
    one = dfa_lib.view(tables, slots[:1])
    st = np.asarray(dfa_lib.tree_states(one, tokens, parents))[0]
    s1, s2 = td.step(s0, a), td.step(s0, b)
    want = [s0, s1, s2, td.step(s1, a), td.step(s2, VOCAB.index("5"))]
    assert st.tolist() == want
    bad = np.asarray(dfa_lib.tree_states(one, tokens.at[0, 2].set(VOCAB.index("z")), parents))[0]
    assert bad.tolist() == [s0, s1, -1, want[3], -1]
    per_node = np.asarray(dfa_lib.mask_logits(jnp.tile(logits[:1, None], (1, 5, 1)), one, jnp.asarray(st[None])))[0]
    for i, s in enumerate(want):
        np.testing.assert_array_equal(np.isfinite(per_node[i]), td.allowed(s) if s >= 0 else np.ones(97, bool))


def _random_tables(rng, M, V, S, C):
    """Tables of M slots with random class maps and transitions (about one move in S forbidden), and
    random start states (some -1: no DFA)."""
    t = dfa_lib.init_tables(M, V, S, C)
    return dfa_lib.admit(t, jnp.arange(M, dtype=jnp.int32), jnp.asarray(rng.integers(0, C, (M, V))),
                         jnp.asarray(rng.integers(-1, S, (M, S, C)), jnp.int32),
                         jnp.asarray(rng.integers(-1, S, M), jnp.int32))


@pytest.mark.parametrize("mid", [(), (1,), (5,), (2, 3), (32,), (33,), (70,)])
def test_packed_mask_equals_the_gather(mid):
    """mask_logits (the nodes' allowed classes packed 32 to a word) equals mask_logits_reference (one
    gather per row, node and token) bit for bit: per-row states [B] and per-node states [B, ...] of
    any count (one word, several, a partial last one), states -1 unmasked, float32 and bfloat16."""
    rng = np.random.default_rng(len(mid) * 100 + sum(mid))
    M, V, S, C, B = 5, 300, 12, 40, 4
    t = _random_tables(rng, M, V, S, C)
    v = dfa_lib.view(t, jnp.asarray([3, 0, 3, 4], jnp.int32))
    states = None if not mid else jnp.asarray(rng.integers(-1, S, (B,) + mid), jnp.int32)
    for dt in (jnp.float32, jnp.bfloat16):
        logits = jnp.asarray(rng.normal(size=(B,) + mid + (V,)), dt)
        got, want = dfa_lib.mask_logits(logits, v, states), dfa_lib.mask_logits_reference(logits, v, states)
        assert got.dtype == dt and got.shape == logits.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        frac = float(jnp.mean(jnp.isinf(got.astype(jnp.float32))))
        assert 0.05 < frac < 0.95  # both allowed and forbidden tokens
    if states is not None:  # state -1: nothing masked
        neg = jnp.full_like(states, -1)
        np.testing.assert_array_equal(np.asarray(dfa_lib.mask_logits(logits, v, neg)), np.asarray(logits))
    assert dfa_lib.mask_logits(logits, None) is logits


@pytest.mark.parametrize("N", [1, 2, 5, 17, 40])
def test_unrolled_tree_states_equal_the_loop(N):
    """tree_states (max_depth relaxation rounds, unrolled) equals tree_states_reference (node by node
    in a device loop) on chains and random trees, with the trees' depth bound and without (N - 1);
    -1 below forbidden tokens and for rows without a DFA."""
    rng = np.random.default_rng(N)
    M, V, S, C, B = 4, 200, 10, 30, 6
    t = _random_tables(rng, M, V, S, C)
    v = dfa_lib.view(t, jnp.asarray(rng.integers(0, M, B), jnp.int32))
    tokens = jnp.asarray(rng.integers(0, V, (B, N)), jnp.int32)
    chain = np.tile(np.arange(-1, N - 1), (B, 1))
    tree = np.full((B, N), -1)
    depth = np.zeros((B, N), int)
    for i in range(1, N):
        tree[:, i] = rng.integers(max(0, i - 3), i, B)
        depth[:, i] = depth[np.arange(B), tree[:, i]] + 1
    for parents, max_depth in ((chain, N - 1), (tree, int(depth.max()))):
        parents = jnp.asarray(parents, jnp.int32)
        want = np.asarray(dfa_lib.tree_states_reference(v, tokens, parents))
        assert want[:, 0].tolist() == np.asarray(v.state).tolist()
        if N > 2:
            assert (want[:, 1:] == -1).any() and (want[:, 1:] >= 0).any()
        np.testing.assert_array_equal(np.asarray(dfa_lib.tree_states(v, tokens, parents)), want)
        np.testing.assert_array_equal(np.asarray(dfa_lib.tree_states(v, tokens, parents, max_depth=max_depth)), want)


def _masked_law(logits, allowed, temperature):
    z = np.where(allowed, logits / temperature, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.parametrize("how", ["sample", "tree", "chain"])
def test_masked_sampling_is_the_renormalised_law(how):
    """N rows in one DFA state (11 allowed tokens of 97): plain sampling from the masked logits; tree
    verification of a point-mass tree whose root children are one allowed and one forbidden token
    (node states from tree_states); and of a chain whose child is drawn from a draft law masked by
    the same state (the proposal draft_probs): each emits the renormalised masked distribution
    (chi-square), never a forbidden token."""
    N, temp = 20000, 0.8
    td = token_dfa(r"[0-9]+")
    cls, nxt = DeviceDFA(td, (EOS,)).padded(8, 8)
    s = td.step(0, VOCAB.index("7"))  # digits or EOS allowed
    allowed = td.allowed(s)
    assert allowed.sum() == 11
    rng = np.random.default_rng(1)
    logits = rng.normal(size=97).astype(np.float32) * 2
    law = _masked_law(logits, allowed, temp)
    tables = dfa_lib.admit(dfa_lib.init_tables(1, 97, 8, 8), jnp.zeros(1, jnp.int32), jnp.asarray(cls[None]),
                           jnp.asarray(nxt[None]), jnp.array([s], jnp.int32))
    v = dfa_lib.view(tables, jnp.zeros(N, jnp.int32))
    samp = SamplingArrays(jnp.full(N, temp, jnp.float32), jnp.ones(N, jnp.float32), jnp.zeros(N, jnp.int32),
                          jnp.asarray(np.arange(N) // 100, jnp.uint32))
    pos = jnp.asarray(np.arange(N) % 100, jnp.int32)
    if how == "sample":
        got = sampling.sample(dfa_lib.mask_logits(jnp.tile(jnp.asarray(logits), (N, 1)), v), samp, pos, True)
    elif how == "tree":
        d7, x = VOCAB.index("3"), VOCAB.index("x")  # an allowed and a forbidden draft token
        tokens = jnp.tile(jnp.array([[0, x, d7]], jnp.int32), (N, 1))
        parents = jnp.tile(jnp.array([[-1, 0, 0]], jnp.int32), (N, 1))
        states = dfa_lib.tree_states(v, tokens, parents)
        tgt = dfa_lib.mask_logits(jnp.tile(jnp.asarray(logits), (N, 3, 1)), v, states)
        tree = make_tree(tokens, parents, jnp.tile(jnp.array([[0, 1, 1]], jnp.int32), (N, 1)), 1)
        idx, n, bonus = verify_tree(tree, tgt, samp, pos)
        first = jnp.where(n > 1, tokens[jnp.arange(N), idx[:, 1]], bonus)
        got = first
        assert not np.any(np.asarray(idx[:, 1]) == 1), "the forbidden draft token was accepted"
    if how == "chain":
        q = _masked_law(rng.normal(size=97).astype(np.float32) * 2, allowed, 1.0)  # the masked draft law
        child = rng.choice(97, size=N, p=q)
        tokens = jnp.asarray(np.stack([np.zeros(N, np.int64), child], 1), jnp.int32)
        parents = jnp.tile(jnp.array([[-1, 0]], jnp.int32), (N, 1))
        states = dfa_lib.tree_states(v, tokens, parents)
        tgt = dfa_lib.mask_logits(jnp.tile(jnp.asarray(logits), (N, 2, 1)), v, states)
        tree = make_tree(tokens, parents, jnp.tile(jnp.array([[0, 1]], jnp.int32), (N, 1)), 1)
        probs = jnp.tile(jnp.asarray(np.stack([np.zeros(97), q]), jnp.float32)[None], (N, 1, 1))
        idx, n, bonus = verify_tree(tree, tgt, samp, pos, draft_probs=probs)
        got = jnp.where(n > 1, tokens[:, 1], bonus)
        assert 0.2 < float(jnp.mean(n > 1)) < 1.0  # the rule ran: some drafts accepted, some not
    counts = np.bincount(np.asarray(got), minlength=97)
    assert counts[~allowed].sum() == 0
    assert chi2_pvalue(counts, law) > 1e-3


# ----------------------------------------------------------------------------- engine

@pytest.fixture(scope="module")
def world():
    cfg = tiny_config(vocab_size=97, eos_token_id=EOS)
    target = tiny_model(cfg, seed=2)
    dcfg = tiny_config(num_hidden_layers=1)
    other = tiny_model(dcfg, seed=6)
    compiler = GrammarCompiler(char_info(), 97)
    rng = np.random.default_rng(4)
    prompts = [CharTokenizer().encode("".join(rng.choice(list(CHARS[:62]), size=int(n))))
               for n in rng.integers(3, 20, 8)]
    return cfg, target, dcfg, other, compiler, prompts, {}


def engine(world, which, sched):
    cfg, target, dcfg, other, compiler, _, cache = world
    draft = DRAFTS[which]
    if which not in cache:
        d = None
        if draft is not None:
            who, k, topk, m, *branch = draft
            if who == "eagle3":
                from test_spec_eagle import random_head
                head, ecfg = random_head(cfg, "eagle3", seed=3, draft_vocab=80, aux_layers=(0, 1, 2))
                d = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers),
                          SpecConfig(method="eagle3", num_steps=k, topk=topk, num_draft_tokens=m))
            else:
                model, mcfg = (target, cfg) if who == "self" else (other, dcfg)
                d = Draft(model, mcfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=k, topk=topk,
                                                                      num_draft_tokens=m, ngram_branch=sum(branch)))
        cache[which] = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                              BatchOptions(max_batch=4, steps_per_call=4), jnp.float32, draft=d, grammar=compiler)
    eng = cache[which]
    eng.opts = sched
    return eng


def run(eng, prompts, constraints, max_tokens=40, **kw):
    kw.setdefault("temperature", 0.0)
    reqs = [Request(i, None, p, SamplingParams(max_tokens=max_tokens, **c, **kw), CharTokenizer(), (EOS,), MAX_SEQ, 3)
            for i, (p, c) in enumerate(zip(prompts, constraints))]
    eng.run(reqs)
    assert all(s is None for s in eng.slots)
    return reqs


def outputs(reqs):
    return [(r.token_ids, r.finish_reason) for r in reqs]


def check_regex_outputs(reqs, constraints):
    """Every finished DFA output is a full match (choices: one of them); every token was allowed."""
    for r, c in zip(reqs, constraints):
        pattern = c.get("regex") or ("|".join(map(re.escape, c["choice"])) if "choice" in c else None)
        if pattern is None:
            continue
        assert r.constraint_path == "device_dfa"
        td = r.dfa.token_dfa
        s = 0
        for t in r.token_ids:
            s = td.step(s, t)  # raises on a forbidden token
        if r.finish_reason == "stop":
            assert r.token_ids[-1] == EOS and td.accept[s]
            assert re.fullmatch(pattern, r.output().text), r.output().text


@pytest.mark.parametrize("which,temperature", [("plain", 0.0), ("plain", 0.9), ("tree", 0.0),
                                               ("tree-ngram-branch", 0.0)],
                         ids=["plain-greedy", "plain-sampled", "tree-greedy", "tree-ngram-branch-greedy"])
def test_device_dfa_equals_host_path(world, which, temperature):
    """A batch mixing DFA, EBNF-grammar (host) and unconstrained rows: the device DFA's outputs are
    the host path's, token for token, greedy, and sampled in plain decoding (same keys, same masked
    distributions; speculative sampling drafts under the DFA masks, other proposals, so other draws
    of the same law: test_drafts_follow_the_dfa). The regex rows go to the device (counted), the
    grammar row to the host (JSON schemas: tests/test_json_schema_dfa.py)."""
    prompts = world[5]
    kw = dict(temperature=temperature, top_p=0.9 if temperature else 1.0)
    eng = engine(world, which, SchedulerOptions(device_dfa=False))
    host = run(eng, prompts, MIXED, **kw)
    assert all(r.constraint_path in ("host_grammar", None) for r in host)
    before = eng.stats()
    eng.opts = SchedulerOptions()
    dev = run(eng, prompts, MIXED, **kw)
    assert outputs(dev) == outputs(host)
    after = eng.stats()
    assert after["dfa_requests"] - before["dfa_requests"] == 5
    assert after["host_grammar_requests"] - before["host_grammar_requests"] == 1
    assert after["dfa_fallbacks"] == before["dfa_fallbacks"]
    check_regex_outputs(dev, MIXED)
    if temperature == 0.0:
        assert sum(r.finish_reason == "stop" for r in dev if r.dfa is not None) >= 3


@pytest.mark.parametrize("which", ["plain", "tree", "eagle3"])
def test_dfa_batches_run_several_steps_per_dispatch(world, which):
    """Without host-grammar rows a DFA batch runs the multi-step programs (no host work per token)
    and gives the host path's tokens; so do lite steps (a draft model's, synced) and lazy ones (an
    EAGLE-3 head's: plain decoding's program on the speculative state, specjax.lazy_draft)."""
    prompts = world[5][:4]
    cons = [dict(regex=REGEXES[3]), {}, dict(regex=r"[a-z ]{10,30}"), dict(regex=REGEXES[2])]
    eng = engine(world, which, SchedulerOptions(device_dfa=False))
    host = run(eng, prompts, cons, max_tokens=24)
    eng.opts = SchedulerOptions()
    kind = "decode" if which == "plain" else "spec"
    before = eng.stats()
    dev = run(eng, prompts, cons, max_tokens=24)
    after = eng.stats()
    assert outputs(dev) == outputs(host)
    check_regex_outputs(dev, cons)
    dispatches = after[f"{kind}_dispatches"] - before[f"{kind}_dispatches"]
    steps = after[f"{kind}_dispatch_steps"] - before[f"{kind}_dispatch_steps"]
    assert steps > dispatches, (steps, dispatches)
    assert after["host_masks_s"] == before["host_masks_s"]  # no host mask work at all
    if which != "plain":  # lite / lazy steps follow the DFA too
        opts = eng.batch_opts
        eng.batch_opts = dataclasses.replace(opts, speculate_below=2)
        try:
            lite = run(eng, prompts, cons, max_tokens=24)
        finally:
            eng.batch_opts = opts
        lite_kind = "lazy" if which == "eagle3" else "lite"
        assert outputs(lite) == outputs(host) and eng.stats()[f"{lite_kind}_dispatches"] > after[f"{lite_kind}_dispatches"]


def test_drafts_follow_the_dfa(world):
    """The target as its own draft (a chain), drafting under the DFA masks: where the regex fixes the
    text the masked draft proposes it, and in the free tail it is the target: every step of the
    FORCED row accepts num_steps + 1 tokens (the host path needs grammar drafts for that); the
    tokens are plain decoding's under the same regex. Sampled, the chain drafts from the masked draft
    law (its proposal): the outputs are valid."""
    prompts = world[5][:2]
    cons = [dict(regex=FORCED), dict(choice=["xabcd-first", "xabce-second", "yz"])]
    plain = run(engine(world, "plain", SchedulerOptions()), prompts, cons, max_tokens=40)
    eng = engine(world, "self", SchedulerOptions())
    spec = run(eng, prompts, cons, max_tokens=40)
    assert outputs(spec) == outputs(plain)
    assert all(r.constraint_path == "device_dfa" for r in spec)
    assert spec[0].output().accept_len_mean == 4 and spec[1].output().accept_len_mean == 4
    mixed = [dict(regex=REGEXES[3]), {}, dict(regex=r"[a-z ]{10,30}"), dict(choice=["red", "green", "blue"])]
    prompts = world[5][:4]
    dev = run(eng, prompts, mixed, max_tokens=24, temperature=0.9)
    check_regex_outputs(dev, mixed)
    assert sum(r.finish_reason == "stop" for r in dev) >= 2


def test_preemption_resumes_the_dfa_state(world):
    """39 pages of 4 tokens only: DFA requests are retracted and prefilled again with their generated
    tokens; their DFA state is the walk of those tokens (written at re-admission): the tokens are the
    host path's."""
    prompts = world[5][:4]
    cons = [dict(regex=r"[a-z ]{20,60}"), dict(regex=r"[A-Z0-9]{10,50}"), dict(regex=r"[a-f]{30,60}"), {}]
    eng = engine(world, "plain", SchedulerOptions(device_dfa=False))
    host = run(eng, prompts, cons, max_tokens=60)
    eng.opts = SchedulerOptions()
    alloc, before = eng.alloc, eng.num_preempted
    alloc.evict_all()  # the prefix cache forgets its pages: all are on the free list
    kept, alloc.free = alloc.free[:-39], alloc.free[-39:]
    try:
        dev = run(eng, prompts, cons, max_tokens=60)
    finally:
        alloc.free = kept + alloc.free
    assert eng.num_preempted > before
    assert outputs(dev) == outputs(host)
    check_regex_outputs(dev, cons)


def test_slots_reused_after_dfa_requests(world):
    """Unconstrained requests decode the same before and after DFA requests held their slots."""
    prompts = world[5][:4]
    eng = engine(world, "plain", SchedulerOptions())
    free = [{}] * 4
    first = outputs(run(eng, prompts, free))
    run(eng, prompts, [dict(regex=REGEXES[i]) for i in range(4)])
    assert outputs(run(eng, prompts, free)) == first
    assert (np.asarray(eng.state.dfa.state) == -1).all()  # every slot was re-admitted without a DFA


def test_limits_unsupported_and_invalid(world):
    """Over dfa_max_states / dfa_max_classes, or an unsupported pattern (\\A): the host path, with
    the reason on the request and the fallback counted, the same outputs; an invalid pattern fails
    only its request."""
    prompts = world[5][:4]
    cons = [dict(regex=REGEXES[0]), dict(regex=r"\Aab+"), dict(regex="[a-"), dict(choice=["red", "green"])]
    eng = engine(world, "plain", SchedulerOptions(device_dfa=False))
    host = run(eng, prompts, cons)
    assert host[2].finish_reason == "error" and "regex" in host[2].output().error
    states = compile_regex("red|green").num_states  # the choice fits, REGEXES[0] does not
    assert compile_regex(REGEXES[0]).num_states > states
    for opts, n_dfa in ((SchedulerOptions(dfa_max_states=states), 1), (SchedulerOptions(dfa_max_classes=2), 0)):
        eng.opts = opts
        before = eng.stats()["dfa_fallbacks"]
        reqs = run(eng, prompts, cons)
        assert outputs(reqs) == outputs(host)
        assert eng.stats()["dfa_fallbacks"] - before == 4 - n_dfa
        assert reqs[1].constraint_path == "host_grammar" and "not supported" in reqs[1].dfa_fallback
        out = reqs[1].output()  # what the caller sees
        assert out.constraint_path == "host_grammar" and out.dfa_fallback == reqs[1].dfa_fallback
        assert "dfa_max" in reqs[0].dfa_fallback
        assert sum(r.constraint_path == "device_dfa" for r in reqs) == n_dfa
        assert reqs[2].finish_reason == "error" and reqs[2].output().error == host[2].output().error
    # a matcher attached by the caller (AsyncLLM validates constraints in its bounded worker) is
    # replaced by the device DFA where the constraint fits, kept where it does not
    eng.opts = SchedulerOptions(dfa_max_states=states)
    reqs = [Request(i, None, p, SamplingParams(max_tokens=40, temperature=0.0, **c), CharTokenizer(), (EOS,), MAX_SEQ, 3)
            for i, (p, c) in enumerate(zip(prompts, cons)) if i != 2]
    for r in reqs:
        r.grammar = world[4].matcher(r.params.constraint, [EOS])
    eng.run(reqs)
    assert [r.constraint_path for r in reqs] == ["host_grammar", "host_grammar", "device_dfa"]
    assert reqs[2].grammar is None and reqs[0].grammar is not None
    assert outputs(reqs) == [o for i, o in enumerate(outputs(host)) if i != 2]


@pytest.mark.parametrize("which", ["plain", "tree"])
def test_other_regexes_compile_nothing(world, which):
    """After one batch under one set of regexes, batches of the same shape under other regexes (other
    tables, same static limits) compile nothing."""
    prompts = [p[:6] for p in world[5][:3]]
    eng = engine(world, which, SchedulerOptions())
    sets = [[r"[a-z]{40}", r"[0-9]{40}", r"(ab|cd)+[xyz]{40}"], [r"[A-Z]{40}", r"(a|bb)[0-9a-c]{40}", r"[ -~]{40}"],
            [r"\w{40}", r"x{40}", r"[+*/]{40}"]]
    run(eng, prompts, [dict(regex=r) for r in sets[0]], max_tokens=8)
    compiled = eng.num_compiled()
    for rs in sets[1:]:
        with CompileCounter() as c:
            reqs = run(eng, prompts, [dict(regex=r) for r in rs], max_tokens=8)
        assert all(r.constraint_path == "device_dfa" and r.finish_reason == "length" for r in reqs)
        assert eng.num_compiled() == compiled and c.n == 0, f"compiled {c.n} executables"
        check_regex_outputs(reqs, [dict(regex=r) for r in rs])


# ----------------------------------------------------------------------------- JSON schemas

# (from tests/test_json_schema_dfa.py: here they run on this file's engines, compiled once)
ENGINE_SCHEMAS = [  # bounded: greedy decoding must finish within max_tokens
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "maxItems": 2}},
     "required": ["id", "kind", "tags"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"enum": [None, True, 1.5, "a\"b"]}},
        "required": ["x"]}, "when": {"type": "string", "format": "date"}}, "required": ["p", "when"]},
    {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 2, "maxLength": 4}]},
]


def check_schema_outputs(reqs, constraints):
    """Every token of a device-DFA row was allowed; a finished one ends with EOS in an accepting
    state and its text parses and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    done = 0
    for r, c in zip(reqs, constraints):
        if "json_schema" not in c:
            continue
        assert r.constraint_path == "device_dfa"
        s = 0
        for t in r.token_ids:
            s = r.dfa.token_dfa.step(s, t)  # raises on a forbidden token
        assert r.finish_reason == "stop", r.output().text
        assert r.token_ids[-1] == EOS and r.dfa.token_dfa.accept[s]
        jsonschema.validate(json.loads(r.output().text), c["json_schema"])
        done += 1
    return done


@pytest.mark.parametrize("which", ["plain", "tree"])
def test_engine_device_dfa_equals_host_path(world, which):
    prompts = world[5][:5]
    cons = [dict(json_schema=s) for s in ENGINE_SCHEMAS[:2]] + [{}] + [dict(json_schema=s) for s in ENGINE_SCHEMAS[2:]]
    eng = engine(world, which, SchedulerOptions(device_dfa=False))
    host = run(eng, prompts, cons, max_tokens=70)
    assert all(r.constraint_path in ("host_grammar", None) for r in host)
    eng.opts = SchedulerOptions()
    before = eng.stats()
    dev = run(eng, prompts, cons, max_tokens=70)
    after = eng.stats()
    assert outputs(dev) == outputs(host)
    assert after["dfa_requests"] - before["dfa_requests"] == 4
    assert after["dfa_fallbacks"] == before["dfa_fallbacks"]
    assert after["host_grammar_requests"] == before["host_grammar_requests"]
    assert after["host_masks_s"] == before["host_masks_s"]  # no host mask work at all
    assert check_schema_outputs(dev, cons) == 4


def test_engine_unsupported_and_invalid_schemas(world):
    """Unsupported schemas (number bounds, a recursive $ref, any object) take the host path, with
    the reason, counted, with the host path's outputs; an invalid schema fails alone, as on the host
    path, and a supported one beside them runs on the device."""
    prompts = world[5][:5]
    rec = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "boolean"}, "next": {"$ref": "#/$defs/n"}},
                           "required": ["v"]}}, "$ref": "#/$defs/n"}
    cons = [dict(json_schema={"type": "number", "minimum": 0, "maximum": 9}), dict(json_schema=rec),
            dict(json_schema={"type": "object"}), dict(json_schema={"type": "bogus"}),
            dict(json_schema=ENGINE_SCHEMAS[1])]
    eng = engine(world, "plain", SchedulerOptions(device_dfa=False))
    host = run(eng, prompts, cons, max_tokens=30)
    assert host[3].finish_reason == "error" and "json_schema" in host[3].output().error
    eng.opts = SchedulerOptions()
    before = eng.stats()
    dev = run(eng, prompts, cons, max_tokens=30)
    after = eng.stats()
    assert outputs(dev) == outputs(host)
    assert after["dfa_fallbacks"] - before["dfa_fallbacks"] == 4 and after["dfa_requests"] - before["dfa_requests"] == 1
    for r, words in zip(dev[:3], (["not supported", "minimum"], ["not supported", "recursive"],
                                  ["not supported", "any object"])):
        assert r.constraint_path == "host_grammar" and all(w in r.dfa_fallback for w in words), r.dfa_fallback
        assert r.output().dfa_fallback == r.dfa_fallback
    assert dev[3].finish_reason == "error" and dev[3].output().error == host[3].output().error
    assert "bogus" in dev[3].dfa_fallback
    assert dev[4].constraint_path == "device_dfa"


# ----------------------------------------------------------------------------- EAGLE-3 drafts

def test_eagle3_drafts_masked_in_the_draft_vocabulary():
    """An EAGLE-3 head's logits over its reduced vocabulary are masked by the state's allowed target
    tokens read through its draft -> target id map; a node whose state allows none of the head's
    tokens keeps its unmasked law (no all -inf row), and a shared-vocabulary draft is masked as is."""
    import types

    from specjax import draft_tree
    td = token_dfa(REGEXES[1])  # (yes|no)!
    dev = DeviceDFA(td, (EOS,))
    cls, nxt = dev.padded(16, 32)
    s_y = td.step(0, VOCAB.index("y"))  # after "y": only "e"
    tables = dfa_lib.admit(dfa_lib.init_tables(2, 97, 16, 32), jnp.array([0, 1], jnp.int32),
                           jnp.asarray(np.stack([cls] * 2)), jnp.asarray(np.stack([nxt] * 2)),
                           jnp.array([0, s_y], jnp.int32))
    v = dfa_lib.view(tables, jnp.array([0, 1], jnp.int32))
    keep = [VOCAB.index(c) for c in "ynabc!"]  # the head's vocabulary: no "e"
    to_target = np.array(keep, np.int32)
    head = types.SimpleNamespace(to_target_ids=lambda ids: jnp.asarray(to_target)[ids])
    info = DraftInfo("eagle3", (1, 2, 3))
    mv = draft_tree.draft_vocab_view(info, head, v, len(keep))
    lp = jnp.asarray(np.random.default_rng(0).normal(size=(2, 1, len(keep))), jnp.float32)
    got = np.asarray(draft_tree.mask_draft(info, lp, mv, v.state[:, None]))
    allowed0 = td.allowed(0)[to_target]  # at the start: "y" or "n"
    np.testing.assert_array_equal(np.isfinite(got[0, 0]), allowed0)
    assert allowed0.sum() == 2
    np.testing.assert_array_equal(got[1, 0], np.asarray(lp[1, 0]))  # nothing allowed in the head's vocabulary
    shared = DraftInfo("draft")
    assert draft_tree.draft_vocab_view(shared, None, v, 97) is v
    full = jnp.asarray(np.random.default_rng(1).normal(size=(2, 1, 97)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(draft_tree.mask_draft(shared, full, v, v.state[:, None])),
                                  np.asarray(dfa_lib.mask_logits(full, v, v.state[:, None])))


@pytest.mark.parametrize("topk,steps,m,temperature", [(1, 3, None, 0.0), (2, 3, 6, 0.0), (1, 3, None, 0.9)],
                         ids=["chain-greedy", "tree-greedy", "chain-sampled"])
def test_eagle3_head_under_the_dfa(world, topk, steps, m, temperature):
    """A random EAGLE-3 head (reduced vocabulary) drafting under the device DFA: greedy outputs are plain
    decoding's under the same constraints, token for token; sampled outputs follow the regexes. With
    the forced regex the masked head proposes the fixed text wherever its vocabulary holds it."""
    from test_spec_eagle import random_head
    cfg, target, _, _, compiler, prompts, _ = world
    head, ecfg = random_head(cfg, "eagle3", draft_vocab=70, aux_layers=(0, 1, 1))
    spec = SpecConfig(method="eagle3", num_steps=steps, topk=topk, num_draft_tokens=m)
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=4),
                 jnp.float32, draft=Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers), spec),
                 grammar=compiler)
    cons = [dict(regex=REGEXES[0]), {}, dict(regex=FORCED), dict(choice=["red", "green", "blue"])]
    got = run(eng, prompts[:4], cons, max_tokens=30, temperature=temperature, top_p=0.9 if temperature else 1.0)
    check_regex_outputs(got, cons)
    assert all(r.constraint_path == "device_dfa" for r, c in zip(got, cons) if c)
    if temperature == 0.0:
        plain = run(engine(world, "plain", SchedulerOptions()), prompts[:4], cons, max_tokens=30)
        assert outputs(got) == outputs(plain)


def test_handover_with_constrained_rows(world):
    """Row hand-over (specjax.engine_handover) in a batch of DFA, host-grammar and unconstrained rows:
    constrained requests are never successors (DFA rows still run multi-step dispatches with them);
    greedy outputs equal the engine's without hand-over, nothing leaks."""
    cfg, target, _, _, compiler, prompts, _ = world
    prompts = prompts + prompts[:4]
    constraints = MIXED + [{}] * 4
    want = outputs(run(engine(world, "tree", SchedulerOptions()), prompts, constraints))
    d = engine(world, "tree", SchedulerOptions()).draft
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=2),
                 jnp.float32, draft=d, grammar=compiler, sched=SchedulerOptions(handover=True))
    got = run(eng, prompts, constraints)
    assert outputs(got) == want
    check_regex_outputs(got, constraints)
    assert eng.handed_over > 0
    assert not eng.sched.queue and eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1


def test_one_row_without_handover_under_constraints(world):
    """A speculative engine of one row without hand-over (one scheduler slot, two device slots:
    engine_handover.device_slots) runs DFA, host-grammar and unconstrained requests one after another:
    the DFA tables have the device's slot count, outputs equal the batch-4 engine's (greedy), every
    regex output is allowed, nothing leaks."""
    cfg, target, _, _, compiler, prompts, _ = world
    want = outputs(run(engine(world, "tree", SchedulerOptions()), prompts, MIXED))
    d = engine(world, "tree", SchedulerOptions()).draft
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=1),
                 jnp.float32, draft=d, grammar=compiler, sched=SchedulerOptions(handover=False))
    assert (eng.num_slots, eng.device_slots) == (1, 2)
    got = run(eng, prompts, MIXED)
    assert outputs(got) == want
    check_regex_outputs(got, MIXED)
    assert eng.state.dfa is not None and eng.state.dfa.next.shape[0] == 2
    assert not eng.sched.queue and eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1
