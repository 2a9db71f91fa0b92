"""The n-gram drafter in the fused step and the engine is lossless: greedy speculative output equals
plain greedy output token for token (float32), for chains and tries, page sizes 1 and 16, ragged
rows with inactive and padding rows, up to the end of the context; the on-device history holds
each slot's prompt and output. A target whose text repeats (a "cyclic" model: the next token is
mostly a fixed function of the current one, with cycles of 5) makes the drafts pay (tau > 1)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import IdTokenizer, tiny_config, tiny_model
from test_step import MAX_SLOTS, _cache, _prompt_batch

from specjax import decode
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.programs import compile_spec_steps
from specjax.step import init_spec_state
from specjax.tree import SpecConfig

PROMPT_LENS = (7, 1, 13, 20)  # slots 0..3 (slot 3 stays inactive in the steps)
SPEC_STEPS = 6
REF_TOKENS = 1 + SPEC_STEPS * 5


def cyclic_model(cfg, damp=0.05):
    """A random model whose residual stream is dominated by the current token's embedding and whose
    lm_head maps token t to f(t), f a permutation made of 5-cycles: its greedy text cycles."""
    m = tiny_model(cfg, seed=0, std=0.3)
    for path, p in nnx.iter_graph(m):
        if isinstance(p, nnx.Param) and path[-1] in ("wo", "w_down"):
            p[...] = p[...] * damp  # attention and MLP still contribute, a little
    V = cfg.vocab_size
    order = np.random.default_rng(1).permutation(V)
    f = np.empty(V, np.int64)
    for i in range(V):
        lo = i - i % 5 if i < V - V % 5 else V - V % 5
        size = 5 if i < V - V % 5 else V % 5
        f[order[i]] = order[lo + (i - lo + 1) % size]
    emb = np.asarray(m.embed[...])
    emb = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros((cfg.hidden_size, V), np.float32)
    head[:, f] = 8.0 * emb.T  # column f(t) = embedding of t
    m.lm_head[...] = jnp.asarray(head)
    return m


def _setup(kind):
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0, std=0.3) if kind == "random" else cyclic_model(cfg)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in PROMPT_LENS]
    gd, params = nnx.split(target)
    steps, w = decode.compile_steps(gd, params)
    state = decode.DecodeState(_cache(cfg, 16), jnp.zeros((MAX_SLOTS,), jnp.int32))
    toks, lens, slots = _prompt_batch(prompts, list(range(MAX_SLOTS)))
    out, state = steps.prefill(w, state, toks, lens, slots, None, stochastic=False)
    outs, state = steps.decode_many(w, state, slots, jnp.ones((MAX_SLOTS,), bool), None,
                                    num_steps=REF_TOKENS - 1, stochastic=False)
    ref = np.concatenate([np.asarray(out.tokens)[None], np.asarray(outs.tokens)], 0).T  # [slots, REF_TOKENS]
    return cfg, target, prompts, ref


SETUPS = {}


def setup_of(kind):
    if kind not in SETUPS:
        SETUPS[kind] = _setup(kind)
    return SETUPS[kind]


ROW_SLOTS = [2, 0, 6, 1, 3]  # slot 6: padding; slot 3: prefilled, then inactive
ACTIVE = np.array([True, True, False, True, False])


def _steps_run(steps, tw, dw, state, prompts, ref, max_accept: int):
    """Prefill + SPEC_STEPS fused steps over ROW_SLOTS -> ({slot: emitted tokens}, tokens per step of
    the active rows, final state). Checked on the way: each step's accepted count (1 .. max_accept,
    -1 after it; 0 for inactive rows), the next tree's root, the token history where the state keeps
    one (x_0 .. x_L: the prompt and every emitted token; the inactive slot's unchanged), and greedy
    equality of every stream with plain decoding's `ref`."""
    toks, lens, slots = _prompt_batch(prompts, ROW_SLOTS)
    first, state = steps.prefill(tw, dw, state, toks, lens, slots, None, stochastic=False)
    streams = {s: [int(np.asarray(first.tokens)[r])] for r, s in enumerate(ROW_SLOTS) if s < MAX_SLOTS}
    frozen = None if state.history is None else np.asarray(state.history[3]).copy()
    counts = []
    for _ in range(SPEC_STEPS):
        out, state = steps.step(tw, dw, state, slots, jnp.asarray(ACTIVE), None, stochastic=False)
        tok, n = np.asarray(out.tokens), np.asarray(out.num_accepted)
        for r, s in enumerate(ROW_SLOTS):
            if ACTIVE[r]:
                assert 1 <= n[r] <= max_accept and (tok[r, n[r]:] == -1).all()
                streams[s] += tok[r, : n[r]].tolist()
            else:
                assert n[r] == 0
        counts.append(n[ACTIVE])
        for s in (0, 1, 2):
            L = int(state.cache.seq_lens[s])
            assert L == len(prompts[s]) + len(streams[s]) - 1
            assert int(state.tree_tokens[s, 0]) == streams[s][-1]
            if frozen is not None:
                assert np.asarray(state.history[s, : L + 1]).tolist() == prompts[s] + streams[s]
    if frozen is not None:
        np.testing.assert_array_equal(np.asarray(state.history[3]), frozen)
    for s in (0, 1, 2):
        assert streams[s] == ref[s, : len(streams[s])].tolist(), s
    return streams, np.concatenate(counts), state


@pytest.mark.parametrize("kind,page_size,k,topk,m", [("random", 1, 3, 1, None), ("random", 16, 3, 3, 7),
                                                      ("cyclic", 16, 4, 1, None), ("cyclic", 1, 3, 2, None)])
def test_fused_step_equals_plain_greedy(kind, page_size, k, topk, m):
    cfg, target, prompts, ref = setup_of(kind)
    spec = SpecConfig(method="ngram", num_steps=k, topk=topk, num_draft_tokens=m)
    steps, tw, dw = compile_spec_steps(DraftInfo("ngram"), spec, *nnx.split(target), None, None)
    state = init_spec_state(_cache(cfg, page_size), [], spec, cfg.vocab_size)
    assert state.draft_probs is None and state.history.shape == (MAX_SLOTS, 96)
    _, counts, _ = _steps_run(steps, tw, dw, state, prompts, ref, k + 1)
    if kind == "cyclic":
        assert counts.mean() > 1.5, counts.mean()  # the cycle is found in the history and accepted
    else:
        assert counts.mean() >= 1.0


def _branch_run(kind, branch, page_size=4):
    """A random one-layer draft model's tree (3 levels, topk 2, 4 nodes) with `branch` n-gram nodes,
    through _steps_run -> its (streams, tokens per step, state)."""
    from test_step import _draft
    cfg, target, prompts, ref = setup_of(kind)
    dcfg, draft = _draft("random", cfg, target)
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=4, ngram_branch=branch)
    steps, tw, dw = compile_spec_steps(DraftInfo("draft"), spec, *nnx.split(target), *nnx.split(draft))
    state = init_spec_state(_cache(cfg, page_size), _cache(dcfg, page_size).kv, spec, cfg.vocab_size)
    assert state.tree_tokens.shape == (MAX_SLOTS, 5 + branch)
    assert (state.history is not None) == (branch > 0)
    return _steps_run(steps, tw, dw, state, prompts, ref, 4)


def test_a_tier_without_a_branch_keeps_the_history():
    """Tree shapes by batch (specjax.spec_tiers) where only another tier has an n-gram branch: the
    state keeps the history and this tier's prefill and steps append to it (_steps_run checks it holds
    the prompt and every emitted token), so the branch finds the sequence when its tier runs again."""
    from test_step import _draft
    cfg, target, prompts, ref = setup_of("cyclic")
    dcfg, draft = _draft("random", cfg, target)
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=4)
    other = SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=2, ngram_branch=1)
    steps, tw, dw = compile_spec_steps(DraftInfo("draft"), spec, *nnx.split(target), *nnx.split(draft))
    state = init_spec_state(_cache(cfg, 4), _cache(dcfg, 4).kv, spec, cfg.vocab_size, tiers=(spec, other))
    assert state.history is not None and state.tree_tokens.shape == (MAX_SLOTS, 5)
    _steps_run(steps, tw, dw, state, prompts, ref, 4)


@pytest.mark.parametrize("kind", ["random", "cyclic"])
def test_model_draft_tree_with_an_ngram_branch_equals_plain_greedy(kind):
    """SpecConfig.ngram_branch: a draft model's tree plus 3 n-gram nodes under the root gives plain
    greedy decoding's tokens (float32, ragged rows, an inactive and a padding row); on the cyclic
    target, where a random draft model rarely guesses right, the branch lifts the tokens per step."""
    _, with_branch, _ = _branch_run(kind, 3)
    if kind == "cyclic":
        _, without, _ = _branch_run(kind, 0)
        assert with_branch.mean() > without.mean() + 0.5, (with_branch.mean(), without.mean())


def _engine(cfg, target, draft, max_seq, page_size=4):
    return Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=max_seq), BatchOptions(max_batch=2),
                  jnp.float32, draft=draft)


def _run(eng, prompts, max_seq, params):
    reqs = [Request(i, None, p, params, IdTokenizer(), (96,), max_seq, 0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert all(s is None for s in eng.slots)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
    return [r.output() for r in reqs]


def test_engine_to_the_end_of_the_context():
    """Through the engine (async loop, continuous batching over 4 prompts in 2 slots), every
    request generating until the context (32 tokens) is full: the same tokens as plain decoding."""
    cfg, target, _, _ = setup_of("cyclic")
    max_seq = 32
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (3, 17, 29, 9)]
    prompts[3] = prompts[0] * 3  # repeats inside the prompt
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    plain = _run(_engine(cfg, target, None, max_seq), prompts, max_seq, params)
    spec = SpecConfig(method="ngram", num_steps=4, topk=2, num_draft_tokens=6)
    outs = _run(_engine(cfg, target, Draft(None, None, DraftInfo("ngram"), spec), max_seq), prompts, max_seq, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [len(o.token_ids) for o in outs] == [max_seq - len(p) for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)
    assert np.mean([o.accept_len_mean for o in outs[:2]]) > 1.5
