"""Prefix caching: requests that share a prompt prefix share its KV pages (target and draft) and
prefill only the rest. Greedy float32 outputs equal those without the cache (plain decoding, a draft
model tree, an EAGLE-3 head tree; page sizes 1, 4 and 16; the speculative engines prefill in
chunks of 16 tokens, which keeps their programs few), so does speculative acceptance (a shared page
holds the draft's own entries); hits are counted and prefill work is saved, cached pages are
evicted least recently used first under page pressure, preemption and sharing get along, and every
page comes back (reference counts). EAGLE-1 chains: test_chunked_prefill.py."""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IdTokenizer, prefill_kv, tiny_config, tiny_model
from test_spec_eagle import random_head

from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.kv_cache import PageAllocator
from specjax.prefix_cache import max_shared_pages, page_keys
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 96
EOS = 96
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

_rng = np.random.default_rng(7)
SYSTEM = [int(t) for t in _rng.integers(0, 96, size=37)]
OTHER = [int(t) for t in _rng.integers(0, 96, size=21)]
THIRD = [int(t) for t in _rng.integers(0, 96, size=30)]
# SYSTEM + a suffix (one twice: the same pages computed in one call register once), a prefix of
# SYSTEM, a second family, and one that leaves SYSTEM at token 32, a page boundary (an EAGLE head's
# entry 31 holds token 32: that page must not be reused)
PROMPTS = ([SYSTEM + [int(t) for t in _rng.integers(0, 96, size=n)] for n in (1, 6, 19, 0)]
           + [SYSTEM + [5, 6], SYSTEM + [5, 6], SYSTEM[:33], OTHER + [1, 2, 3], OTHER + [4]]
           + [SYSTEM[:32] + [(SYSTEM[32] + 1) % 96] + [int(t) for t in _rng.integers(0, 96, size=5)]])


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hit(p, cached: list, ps: int, shift: int) -> int:
    """Tokens of p that a cache holding the pages of the sequences `cached` lets it reuse: full pages
    that p shares with one of them, with the `shift` tokens after the page, leaving >= 1 token."""
    best = 0
    for q in cached:
        best = max(best, min(common(p, q) - shift, len(q) - shift) // ps)
    return min(best, max_shared_pages(len(p), ps, shift)) * ps


# ----------------------------------------------------------------- host side: keys and allocator

def test_page_keys_chain_the_whole_prefix_and_the_draft_shift():
    a = list(range(40))
    b = [99] + a[1:]  # differs in page 0 only
    ka, kb = page_keys(a, 4), page_keys(b, 4)
    assert len(ka) == 10 and len(set(ka)) == 10
    assert all(x != y for x, y in zip(ka, kb))  # page j's key covers everything before it
    assert page_keys(a[:23], 4) == ka[:5]  # a prefix has the prefix's keys
    # shift 1 (EAGLE): page j also depends on the token after it
    k1 = page_keys(a, 4, shift=1)
    assert len(k1) == 9 and len(page_keys(a[:9], 4, shift=1)) == 2
    c = a[:8] + [77] + a[9:]  # token 8 is the first of page 2, the token after page 1
    kc = page_keys(c, 4, shift=1)
    assert kc[0] == k1[0] and kc[1] != k1[1]
    assert page_keys(c, 4)[1] == ka[1]  # ... which page 1 of a shift-0 cache does not depend on
    # at least one token is always prefilled; shift-1 keys need the token after the page
    assert max_shared_pages(8, 4) == 1 and max_shared_pages(9, 4) == 2
    assert max_shared_pages(9, 4, shift=1) == 2 and max_shared_pages(8, 4, shift=1) == 1


def test_allocator_refcounts_and_lru():
    al = PageAllocator(num_pages=9, page_size=2, pages_per_slot=4, max_slots=3)
    assert al.ensure(0, 6) and al.owned[0] == [1, 2, 3]
    for j, key in enumerate([b"a", b"b", b"c"]):
        al.register(0, j, key)
    assert al.lookup([b"a", b"b", b"x", b"c"]) == [1, 2]  # stops at the first miss
    al.share(1, [1, 2])
    assert al.ensure(1, 8) and al.owned[1] == [1, 2, 4, 5]
    assert list(al.refs[1:6]) == [2, 2, 1, 1, 1]
    al.register(1, 2, b"c")  # the key is held by page 3 already: page 4 stays unregistered
    assert al.key_of.get(4) is None
    al.release(0)
    assert al.num_free == 3 + 1 and list(al.cached) == [3]  # pages 1, 2 still used by slot 1
    al.release(1)
    assert list(al.cached) == [3, 2, 1]  # a slot's last pages first in eviction order
    assert al.num_free == 8 and al.num_in_use == 0 and al.unused_pages() == list(range(1, 9))
    assert al.ensure(2, 8) and al.owned[2] == [4, 5, 6, 7]  # unregistered pages go first
    assert al.num_evicted == 0
    assert al.ensure(0, 4) and al.owned[0] == [8, 3] and al.num_evicted == 1  # then the least recently released
    assert al.lookup([b"a", b"b", b"c"]) == [1, 2] and 3 not in al.key_of
    al2 = PageAllocator(num_pages=5, page_size=2, pages_per_slot=4, max_slots=2)
    al2.ensure(0, 8)
    for j, key in enumerate([b"a", b"b", b"c", b"d"]):
        al2.register(0, j, key)
    al2.release(0)
    assert list(al2.cached) == [4, 3, 2, 1]
    al2.share(1, al2.lookup([b"a", b"b"]))  # reused pages leave the LRU; the rest are evicted oldest first
    assert al2.ensure(1, 6) and al2.owned[1] == [1, 2, 4] and al2.num_evicted == 1
    assert al2.lookup([b"a", b"b", b"c"]) == [1, 2, 3] and al2.lookup([b"d"]) == []
    al2.release(1)
    assert al2.evict_all() == 3 and al2.unused_pages() == [1, 2, 3, 4] and not al2.by_key


# ----------------------------------------------------------------- engine

@pytest.fixture(scope="module")
def world():
    cfg = tiny_config()
    return cfg, tiny_model(cfg, seed=0)


def _engine(world, draft=None, page_size=4, budget=8192, max_batch=3):
    cfg, target = world
    return Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ),
                  BatchOptions(max_batch=max_batch, max_prefill_tokens=budget), jnp.float32, draft=draft)


def _run(eng, prompts, params=GREEDY, pages=None):
    reqs = [Request(i, None, p, params, IdTokenizer(), (EOS,), MAX_SEQ, 0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    assert_clean(eng, pages)
    return reqs


def assert_clean(eng, pages=None):
    """No slot busy and every page (of `pages`, default all) unused: free, or cached with no
    reference left."""
    a = eng.alloc
    pages = list(range(1, a.num_pages)) if pages is None else sorted(pages)
    assert all(s is None for s in eng.slots) and not any(a.owned) and not eng.sched.prefilling
    assert a.unused_pages() == pages and not a.refs.any()
    assert a.num_free == len(pages) and eng.stats()["pages_in_use"] == a.num_pages - 1 - len(pages)
    assert set(a.cached) == set(a.key_of) and len(a.by_key) == len(a.key_of)


@pytest.fixture(scope="module")
def plain_eng(world):
    return _engine(world)


@pytest.fixture(scope="module")
def reference(plain_eng):
    """Greedy plain decoding without the prefix cache."""
    plain_eng.sched.prefix_caching = False
    try:
        return [r.token_ids for r in _run(plain_eng, PROMPTS)]
    finally:
        plain_eng.sched.prefix_caching = True


def _check_cached_runs(eng, reference):
    """Without the cache (the reference of acceptance lengths), then one prompt, the others (they
    share its pages), and all again (all pages cached): outputs equal the reference, speculative
    acceptance equals that without the cache (the shared draft KV is the draft's own), the counters
    add up and the last pass reuses every page it may."""
    ps, shift = eng.alloc.page_size, eng.sched.key_shift
    eng.sched.prefix_caching = False
    uncached = _run(eng, PROMPTS)
    eng.sched.prefix_caching = True
    assert [r.token_ids for r in uncached] == reference
    st0 = eng.stats()
    first = _run(eng, PROMPTS[:1])
    rest = _run(eng, PROMPTS[1:])
    assert [r.token_ids for r in first + rest] == reference
    assert first[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens >= expected_hit(p, PROMPTS[:1], ps, shift) for r, p in zip(rest, PROMPTS[1:]))
    assert sum(r.num_cached_tokens for r in rest) > 0
    st1 = eng.stats()
    again = _run(eng, PROMPTS)
    assert [r.token_ids for r in again] == reference
    want = [expected_hit(p, PROMPTS, ps, shift) for p in PROMPTS]
    assert want == [max_shared_pages(len(p), ps, shift) * ps for p in PROMPTS]
    assert [r.num_cached_tokens for r in again] == want
    for run in (first + rest, again):
        assert [r.accept_lens for r in run] == [r.accept_lens for r in uncached]
    st = eng.stats()
    n = sum(map(len, PROMPTS))
    assert st["prefix_cache_hit_tokens"] - st1["prefix_cache_hit_tokens"] == sum(want)
    assert st["prefill_tokens"] - st1["prefill_tokens"] == n - sum(want)
    assert st["prefix_cache_queried_tokens"] - st0["prefix_cache_queried_tokens"] == 2 * n
    assert st["prefix_cache_queries"] - st0["prefix_cache_queries"] == 2 * len(PROMPTS)
    assert st["prefix_cache_hits"] - st0["prefix_cache_hits"] >= len(PROMPTS) + 6
    assert 0 < st["prefix_cache_hit_rate"] < 1 and st["prefix_cache_evictions"] == 0
    assert st["pages_cached"] > 0


def test_plain_cached_equals_uncached(plain_eng, reference):
    _check_cached_runs(plain_eng, reference)


SPEC_CASES = {  # method, num_steps, topk, num_draft_tokens, page size
    "draft-tree-p1": ("draft", 3, 2, 5, 1),
    "eagle3-tree-p16": ("eagle3", 3, 2, 6, 16),
}
_SPEC_ENGINES: dict = {}


def spec_engine(world, case):
    """One engine per case for the whole module (compiling is what takes the time)."""
    if case not in _SPEC_ENGINES:
        cfg, _ = world
        method, k, topk, m, ps = SPEC_CASES[case]
        spec = SpecConfig(method=method, num_steps=k, topk=topk, num_draft_tokens=m)
        if method == "draft":
            dcfg = tiny_config(num_hidden_layers=1)
            draft = Draft(tiny_model(dcfg, seed=5), dcfg, DraftInfo("draft"), spec)
        else:
            head, ecfg = random_head(cfg, method, draft_vocab=60, aux_layers=(0, 1, 2))
            draft = Draft(head, ecfg.layer, DraftInfo(method, ecfg.aux_layers), spec)
        # prefill calls of one row of 16 tokens and steps of two rows: one program each
        _SPEC_ENGINES[case] = _engine(world, draft, page_size=ps, budget=16, max_batch=2)
    return _SPEC_ENGINES[case]


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_cached_equals_plain(world, reference, case):
    """The draft's KV sits in the target's pages and is shared with them; an EAGLE head's pages are
    keyed by the token after them too (shift 1), so a reused page holds the right draft entries."""
    eng = spec_engine(world, case)
    assert eng.sched.key_shift == (0 if case.startswith("draft") else 1)
    _check_cached_runs(eng, reference)


def kv_of(eng, prompt, cached: bool):
    """(target, draft) K/V of the prompt's entries right after its prefill, with or without the
    prefix cache, and the tokens it reused."""
    eng.sched.prefix_caching = cached
    req = Request(0, None, prompt, GREEDY, IdTokenizer(), (EOS,), MAX_SEQ, 0)
    kv = prefill_kv(eng, req)
    eng.sched.prefix_caching = True
    assert_clean(eng)
    return kv, req.num_cached_tokens


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_shared_pages_hold_what_the_request_would_compute(world, case):
    """Right after prefill, the K/V of every prompt entry (target and draft) in the slot of a request
    that reused pages equals what it computes without the cache, also when its prompt leaves a cached
    one at a page boundary (an EAGLE head's last entry of a page holds the next token)."""
    eng = spec_engine(world, case)
    _run(eng, PROMPTS)  # every page cached
    for p in (PROMPTS[9], PROMPTS[2]):
        (t0, d0), hit0 = kv_of(eng, p, cached=False)
        (t1, d1), hit1 = kv_of(eng, p, cached=True)
        assert hit0 == 0 and hit1 > 0
        np.testing.assert_allclose(t1, t0, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(d1, d0, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def page_budget(eng, n):
    """Let the scheduler use only n pages of the cache (same shapes, so no new programs)."""
    alloc = eng.alloc
    alloc.evict_all()
    kept, alloc.free = alloc.free[:-n], alloc.free[-n:]
    try:
        yield list(alloc.free)
    finally:
        alloc.evict_all()
        alloc.free = kept + alloc.free


def test_lru_eviction_under_page_pressure(plain_eng, reference):
    """30 pages of 4 tokens, one request at a time: three prompt families in turn fill the cache; a
    long request then evicts the least recently used family's pages, its last pages first; outputs
    stay those without the cache."""
    fams = [PROMPTS[7], PROMPTS[0], THIRD]  # OTHER + 3 tokens (6 pages), SYSTEM + 1 (9 pages), THIRD (7)
    keys = [page_keys(f, 4) for f in fams]
    with page_budget(plain_eng, 30) as pages:
        (ref3,) = [r.token_ids for r in _run(plain_eng, [THIRD], pages=pages)]
        plain_eng.alloc.evict_all()
        ev0 = plain_eng.stats()["prefix_cache_evictions"]
        assert [_run(plain_eng, [f], pages=pages)[0].token_ids for f in fams] == [reference[7], reference[0], ref3]
        assert [len(plain_eng.alloc.lookup(k)) for k in keys] == [6, 9, 7]  # all cached ...
        assert plain_eng.stats()["prefix_cache_evictions"] == ev0  # ... none evicted yet
        # SYSTEM + 19 shares the 9 SYSTEM pages (they become the most recently used) and needs more
        # pages than are free: the oldest cached pages go, OTHER's last first
        (r,) = _run(plain_eng, [PROMPTS[2]], pages=pages)
        assert r.token_ids == reference[2] and r.num_cached_tokens == 36
        evicted = plain_eng.stats()["prefix_cache_evictions"] - ev0
        assert 0 < evicted < 6
        assert [len(plain_eng.alloc.lookup(k)) for k in keys] == [6 - evicted, 9, 7]
        (again,) = _run(plain_eng, [PROMPTS[7]], pages=pages)
        assert again.token_ids == reference[7] and again.num_cached_tokens == (6 - evicted) * 4


def test_preemption_with_a_shared_prefix(world):
    """Requests sharing the SYSTEM pages outgrow 8 pages of 16 tokens: the youngest are retracted
    (their shared pages stay with the others), readmitted with a cache hit, and finish with the
    outputs of a run without preemption; no page is leaked."""
    eng = spec_engine(world, "eagle3-tree-p16")
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = _run(eng, PROMPTS[:4], long)
    hits, pre = eng.stats()["prefix_cache_hits"], eng.num_preempted
    with page_budget(eng, 8) as pages:
        reqs = _run(eng, PROMPTS[:4], long, pages=pages)
    assert [r.token_ids for r in reqs] == [r.token_ids for r in ref]
    assert eng.num_preempted > pre and any(r.num_preempted for r in reqs)
    # the budget starts with an empty prefix cache: the first admission misses, the others share its
    # SYSTEM pages, and every readmission hits (the shared pages stay with the running requests)
    assert eng.stats()["prefix_cache_hits"] - hits >= len(reqs) - 1 + sum(r.num_preempted for r in reqs)
    assert_clean(eng)
