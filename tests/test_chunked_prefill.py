"""Chunked prefill: a prompt longer than max_prefill_tokens is prefilled in chunks, one per engine
step, while the running requests keep decoding between the chunks. Greedy float32 outputs equal
the unchunked ones (plain decoding, an EAGLE-1 chain, the n-gram drafter, a draft model tree under
tensor parallelism; with penalties, whose prompt set covers the whole prompt; together with the
prefix cache), and so does speculative acceptance (the draft's state across chunks is its own). The budget is a host
setting: the tests switch it on one engine (Scheduler.max_prefill_tokens)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IdTokenizer, prefill_kv, tiny_config, tiny_model
from test_spec_eagle import random_head

from specjax import sharding
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 192
EOS = 96
CHUNK = 32
_rng = np.random.default_rng(3)
LONG = [int(t) for t in _rng.integers(0, 96, size=150)]
SHORT = [[int(t) for t in _rng.integers(0, 96, size=n)] for n in (5, 20, 11)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
STREAM = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
STREAM_NG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config()
    return cfg, tiny_model(cfg, seed=1)


def _engine(world, draft=None, page_size=4, budget=8192, max_batch=4, mesh=None, target=None):
    cfg, model = world
    return Engine(target or model, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ),
                  BatchOptions(max_batch=max_batch, max_prefill_tokens=budget), jnp.float32, draft=draft, mesh=mesh)


def _requests(prompts, params, first_id=0):
    ps = params if isinstance(params, list) else [params] * len(prompts)
    return [Request(first_id + i, None, p, sp, IdTokenizer(), (EOS,), MAX_SEQ, 0)
            for i, (p, sp) in enumerate(zip(prompts, ps))]


def _clean(eng):
    a = eng.alloc
    assert all(s is None for s in eng.slots) and not eng.sched.prefilling and not a.refs.any()
    assert a.unused_pages() == list(range(1, a.num_pages))


def run(eng, prompts, params=GREEDY, budget=None, prefix_cache=False):
    """Run to completion with this prefill budget (host-side settings of the same engine)."""
    eng.sched.max_prefill_tokens = budget or eng.batch_opts.max_prefill_tokens
    eng.sched.prefix_caching = prefix_cache
    reqs = _requests(prompts, params)
    eng.run(reqs)
    _clean(eng)
    return reqs


def arriving(eng, budget):
    """SHORT requests decode; once each has tokens, LONG arrives. Returns (requests, a log per step
    from LONG's arrival until its first token: (LONG still prefilling after the step, tokens the
    SHORT requests got in the step))."""
    eng.sched.max_prefill_tokens, eng.sched.prefix_caching = budget, False
    short = _requests(SHORT, STREAM)
    (long,) = _requests([LONG], GREEDY, first_id=len(SHORT))
    for r in short:
        eng.add_request(r)
    while not all(r.token_ids for r in short):
        eng.step()
    eng.add_request(long)
    log = []
    while not long.token_ids:
        got = sum(len(u.token_ids) for u in eng.step() if u.request is not long)
        log.append((long.slot in eng.sched.prefilling, got))
    while eng.has_unfinished():
        eng.step()
    _clean(eng)
    return short + [long], log


@pytest.fixture(scope="module")
def plain_eng(world):
    return _engine(world)


def test_chunks_interleave_with_decode_steps(plain_eng):
    """LONG (150 tokens) arrives while three streams decode. Unchunked, it is prefilled in one call;
    with a budget of 32 it takes 5 calls, and in every step meanwhile the streams get tokens. The
    outputs are the same."""
    ref, log = arriving(plain_eng, 8192)
    assert not any(p for p, _ in log)  # one prefill call: never left half done
    reqs, log = arriving(plain_eng, CHUNK)
    assert [r.token_ids for r in reqs] == [r.token_ids for r in ref]
    prefilling = [got for p, got in log if p]
    assert len(prefilling) == -(-len(LONG) // CHUNK) - 1  # steps that left LONG half prefilled
    assert all(got > 0 for got in prefilling)  # the others' streams kept flowing


def test_prefill_chunk_splits_one_prompt_within_a_large_budget(world, plain_eng):
    """BatchOptions.prefill_chunk caps one prompt's piece per prefill call while the call's token
    budget stays large (several short prompts still share a call): LONG arrives in 5 pieces of <= 32
    tokens, the streams keep flowing, the outputs are the unchunked ones."""
    ref, _ = arriving(plain_eng, 8192)
    cfg, model = world
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=4, max_prefill_tokens=8192, prefill_chunk=CHUNK), jnp.float32)
    assert eng.sched.chunk == CHUNK and eng.sched.max_prefill_tokens == 8192
    reqs, log = arriving(eng, 8192)
    assert [r.token_ids for r in reqs] == [r.token_ids for r in ref]
    prefilling = [got for p, got in log if p]
    assert len(prefilling) == -(-len(LONG) // CHUNK) - 1 and all(got > 0 for got in prefilling)
    with pytest.raises(ValueError, match="prefill_chunk"):
        BatchOptions(prefill_chunk=0)


def test_short_prompts_batch_and_long_prompts_chunk_alike(plain_eng):
    """All at once: chunked (with and without the prefix cache) == unchunked."""
    prompts = [LONG] + SHORT + [LONG[:40], LONG[:33] + [7]]
    ref = [r.token_ids for r in run(plain_eng, prompts)]
    assert [r.token_ids for r in run(plain_eng, prompts, budget=CHUNK)] == ref
    assert [r.token_ids for r in run(plain_eng, prompts, budget=CHUNK, prefix_cache=True)] == ref
    cached = run(plain_eng, prompts, budget=CHUNK, prefix_cache=True)
    assert [r.token_ids for r in cached] == ref and cached[0].num_cached_tokens == 148


def test_penalties_see_the_whole_prompt(plain_eng):
    """The repetition penalty covers every prompt token, also those of earlier chunks and of a
    cached prefix."""
    pen = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                         frequency_penalty=0.3)
    prompts = [LONG, SHORT[1], LONG[:120] + [9]]
    ref = [r.token_ids for r in run(plain_eng, prompts, pen)]
    assert [r.token_ids for r in run(plain_eng, prompts, pen, budget=CHUNK)] == ref
    assert [r.token_ids for r in run(plain_eng, prompts, pen, budget=CHUNK, prefix_cache=True)] == ref
    assert run(plain_eng, prompts[:1])[0].token_ids != ref[0]  # the penalties did change the output


def test_speculative_chunked_equals_unchunked(world, plain_eng):
    """An EAGLE-1 chain (page size 16) with chunks of 16 tokens: the tokens of plain unchunked
    decoding, and the acceptance of its own unchunked run (each chunk's last draft entry reads the
    next prompt token); then with the prefix cache (a cached prefix, then chunks)."""
    cfg, _ = world
    head, ecfg = random_head(cfg, "eagle")
    draft = Draft(head, ecfg.layer, DraftInfo("eagle", ecfg.aux_layers), SpecConfig(method="eagle", num_steps=3))
    eng = _engine(world, draft, page_size=16, budget=16, max_batch=2)
    prompts = [LONG, SHORT[1]]
    plain = [r.token_ids for r in run(plain_eng, prompts + [LONG[:70] + [3, 4]])]
    ref = run(eng, prompts, budget=8192)
    assert [r.token_ids for r in ref] == plain[:2]
    chunked = run(eng, prompts)
    assert [r.token_ids for r in chunked] == plain[:2]
    assert [r.accept_lens for r in chunked] == [r.accept_lens for r in ref]
    # the K/V of every prompt entry, target and draft, right after the prefill: chunked == unchunked
    kv = []
    for budget in (8192, 16):
        eng.sched.max_prefill_tokens = budget
        kv.append(prefill_kv(eng, _requests([LONG], GREEDY)[0]))
        _clean(eng)
    for a, b in zip(*kv):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    for _ in range(2):  # the second time with all pages cached
        cached = run(eng, prompts + [LONG[:70] + [3, 4]], prefix_cache=True)
        assert [r.token_ids for r in cached] == plain
        assert [r.accept_lens for r in cached[:2]] == [r.accept_lens for r in ref]
    assert [r.num_cached_tokens for r in cached] == [144, 16, 64]


def test_ngram_drafter_sees_the_whole_prompt(world, plain_eng):
    """The n-gram drafter looks its drafts up in the slot's token history, which an admission writes
    whole (a piece holds part of it only; a cached prefix is in no piece): chunked and cached runs
    accept exactly what the unchunked, uncached run accepts, and give plain decoding's tokens."""
    motif = LONG[:12]
    prompts = [motif * 8 + SHORT[0], motif * 5 + SHORT[1], (motif * 6)[:61]]  # repetitive: drafts hit
    plain = [r.token_ids for r in run(plain_eng, prompts, STREAM_NG)]
    eng = _engine(world, Draft(None, None, DraftInfo("ngram"), SpecConfig(method="ngram", num_steps=4)),
                  page_size=8, max_batch=2)
    assert eng.sched.key_shift == 0  # no draft KV in the pages
    ref = run(eng, prompts, STREAM_NG)
    assert [r.token_ids for r in ref] == plain and max(np.mean(r.accept_lens) for r in ref) > 1.2
    for budget, cached in ((16, False), (16, True), (8192, True)):
        reqs = run(eng, prompts, STREAM_NG, budget=budget, prefix_cache=cached)
        assert [r.token_ids for r in reqs] == plain
        assert [r.accept_lens for r in reqs] == [r.accept_lens for r in ref]
    assert min(r.num_cached_tokens for r in reqs) >= 56


def test_tensor_parallel_with_prefix_cache_and_chunks(world, plain_eng):
    """TP 2 (CPU mesh), a draft model tree, chunks of 16 and the prefix cache: the tokens of plain
    unchunked decoding on one device."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    cfg, _ = world
    dcfg = tiny_config(num_hidden_layers=1)
    draft = Draft(tiny_model(dcfg, seed=5), dcfg, DraftInfo("draft"),
                  SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=5))
    # the target's own copy of the weights: the engine places it on the mesh
    eng = _engine(world, draft, page_size=8, budget=16, max_batch=2, mesh=sharding.make_mesh(2),
                  target=tiny_model(cfg, seed=1))
    assert eng.state.cache.kv[0].sharding.spec[3] == sharding.AXIS  # KV pages split by kv heads
    prompts = [LONG, SHORT[2], LONG[:100] + [5]]
    ref = [r.token_ids for r in run(plain_eng, prompts)]
    for _ in range(2):
        reqs = run(eng, prompts, prefix_cache=True)
        assert [r.token_ids for r in reqs] == ref
    assert [r.num_cached_tokens for r in reqs] == [144, 8, 96]
