"""The scheduler and the one-step-behind engine loop on tiny random models: requests arriving while
others run, mixed lengths and sampling parameters, with and without speculation, equal what each
request gets alone through the synchronous loop; preemption under a tiny page budget changes no
output; cancellation frees the slot at once; no recompilation in steady state; streaming deltas."""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions, bucket
from specjax.tree import SpecConfig

MAX_SEQ = 64
EOS = 96
SYNC = SchedulerOptions(async_loop=False)
MODES = {"plain": None, "chain": (3, 1, None), "tree": (3, 2, 5)}  # (num_steps, topk, num_draft_tokens)


def make_models():
    cfg = tiny_config()
    dcfg = tiny_config(num_hidden_layers=1)
    return cfg, tiny_model(cfg, seed=0), dcfg, tiny_model(dcfg, seed=5)


@pytest.fixture(scope="module")
def models():
    return make_models()


def engine(models, mode, *, max_batch=8, page_size=4, num_pages=None, sched=None, steps_per_call=4):
    cfg, target, dcfg, other = models
    draft = None
    if MODES[mode] is not None:
        k, topk, m = MODES[mode]
        draft = Draft(other, dcfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=k, topk=topk,
                                                                  num_draft_tokens=m))
    return Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ, num_pages=num_pages),
                  BatchOptions(max_batch=max_batch, steps_per_call=steps_per_call), jnp.float32, draft=draft,
                  sched=sched)


def workload(n=64, seed=0, stop_ids=8):
    """(prompt, params, seed) of n requests: mixed prompt lengths, lengths to generate, greedy and
    sampled rows, EOS / stop ids (lists of `stop_ids` ids) / stop strings."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(0, 96, size=int(rng.integers(1, 17)))]
        kw = dict(max_tokens=int(rng.integers(1, 17)), temperature=0.0, ignore_eos=bool(i % 2))
        if i % 4 == 1:
            kw.update(temperature=0.8, top_p=0.9, top_k=20)
        if i % 7 == 3:
            kw["stop_token_ids"] = [int(t) for t in rng.integers(0, 96, size=8)][:stop_ids]
        if i % 9 == 5:
            kw["stop"] = [f"<{int(t)}>" for t in rng.integers(0, 96, size=6)]
        out.append((prompt, SamplingParams(**kw), 1000 + i))
    return out


def requests(items, first_id=0):
    return [Request(first_id + i, None, p, sp, IdTokenizer(), (EOS,), MAX_SEQ, s) for i, (p, sp, s) in enumerate(items)]


def summary(req):
    o = req.output()
    return o.token_ids, o.finish_reason, o.text


def assert_clean(eng, free=None):
    """No slot busy, nothing in flight, every page free (or exactly the pages `free`)."""
    num_pages = int(eng.state.cache.kv[0].shape[0])
    assert eng.alloc.unused_pages() == (list(range(1, num_pages)) if free is None else sorted(free))
    assert all(s is None for s in eng.slots) and not any(eng.alloc.owned)
    assert not eng.has_unfinished() and not eng.sched.inflight.any()


def run_alone(eng, items):
    """Each request alone, through the synchronous loop of the same engine (same programs)."""
    opts, eng.opts = eng.opts, SYNC
    try:
        outs = []
        for i, item in enumerate(items):
            (r,) = requests([item], i)
            eng.run([r])
            outs.append(summary(r))
    finally:
        eng.opts = opts
    return outs


def run_arriving(eng, items, waves=((0, 40), (3, 52), (6, 64)), free=None):
    """Submit items[:b] in waves (step, b): those up to b once `step` engine steps have run."""
    reqs = requests(items)
    start, steps, w = 0, 0, 0
    while w < len(waves) or eng.has_unfinished():
        while w < len(waves) and waves[w][0] <= steps:
            for r in reqs[start: waves[w][1]]:
                eng.add_request(r)
            start, w = waves[w][1], w + 1
        held = eng.held_back
        eng.step()
        steps += 1
        if eng.opts.async_loop and any(s is not None for s in eng.slots) and eng.held_back == held:
            assert len(eng._pending) == 1  # the next step is on the device while the host returns
    assert all(r.finished for r in reqs)
    assert_clean(eng, free)
    return reqs


@contextlib.contextmanager
def page_budget(eng, n):
    """Let the scheduler use only n pages of the cache (same shapes, so no new programs)."""
    alloc = eng.alloc
    alloc.evict_all()  # the prefix cache forgets its pages: all are on the free list
    kept, alloc.free = alloc.free[:-n], alloc.free[-n:]
    budget = list(alloc.free)
    try:
        yield budget
    finally:
        alloc.free = kept + alloc.free


def check_arrivals(eng, items, alone):
    reqs = run_arriving(eng, items)
    got = [summary(r) for r in reqs]
    assert got == alone
    assert {f for _, f, _ in got} >= {"stop", "length"}
    return reqs


def check_preemption(eng, items):
    """Running requests outgrow a budget of 13 pages of 4 tokens, the youngest are retracted and
    recomputed; every output equals the request's output alone."""
    with page_budget(eng, 13) as budget:
        before = eng.num_preempted
        reqs = run_arriving(eng, items, waves=((0, 8), (2, 16)), free=budget)
        assert eng.num_preempted > before and any(r.num_preempted for r in reqs)
    assert [summary(r) for r in reqs] == run_alone(eng, items)


def preemption_items(sampled: bool):
    items = [it for it in workload() if len(it[0]) <= 14][:16]
    return [(p, SamplingParams(max_tokens=16, temperature=sp.temperature if sampled else 0.0, top_p=sp.top_p,
                               top_k=sp.top_k, ignore_eos=True), s) for p, sp, s in items]


# ----------------------------------------------------------------- plain decoding

@pytest.fixture(scope="module")
def eng(models):
    return engine(models, "plain")


@pytest.fixture(scope="module")
def alone(eng):
    return run_alone(eng, workload())


def test_arrivals_over_time_equal_alone(eng, alone):
    """64 requests (mixed lengths, greedy and sampled, stops) arriving in three waves while others
    run, through the one-step-behind loop == each alone through the synchronous loop."""
    check_arrivals(eng, workload(), alone)


def test_no_recompilation_in_steady_state(eng, alone):
    n = eng.num_compiled()
    eng.alloc.evict_all()  # prefix-cache hits would prefill other lengths
    check_arrivals(eng, workload(), alone)  # the same traffic again compiles nothing
    assert eng.num_compiled() == n
    # a constant batch: every step after the first few reuses one program
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for r in requests([([1, 2, 3], params, 0)] * 8):
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    n = eng.num_compiled()
    for _ in range(6):
        eng.step()
    assert eng.num_compiled() == n
    while eng.has_unfinished():
        eng.step()


def test_preemption_under_a_tiny_page_budget(eng):
    check_preemption(eng, preemption_items(sampled=True))


def test_cancel_frees_slot_and_pages(eng):
    items = [(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), s) for p, _, s in workload(9)]
    reqs = requests(items)
    for r in reqs:
        eng.add_request(r)
    eng.step()
    eng.step()
    a, c = reqs[0], reqs[8]  # running / still queued (8 slots)
    slot = a.slot
    assert slot is not None and eng.alloc.owned[slot] and c.slot is None
    assert eng.cancel(a.id) and eng.cancel(c.id)
    assert eng.slots[slot] is None and not eng.alloc.owned[slot]
    assert a.finish_reason == c.finish_reason == "cancelled" and c.token_ids == []
    assert not eng.cancel(a.id) and not eng.cancel(12345)
    updates = eng.step()
    assert {u.request.id for u in updates if u.finished} >= {a.id, c.id}
    n_a = len(a.token_ids)
    while eng.has_unfinished():
        eng.step()
    assert len(a.token_ids) == n_a  # nothing delivered after the cancellation
    assert_clean(eng)
    assert [summary(r) for r in reqs[1:8]] == run_alone(eng, items[1:8])


def test_streaming_deltas_concatenate_to_the_text(eng):
    reqs = requests(workload(12, seed=11))
    pieces = {r.id: [] for r in reqs}
    toks = {r.id: [] for r in reqs}
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        for u in eng.step():
            pieces[u.request.id].append(u.request.take_text_delta())
            toks[u.request.id] += u.token_ids
    for r in reqs:
        assert "".join(pieces[r.id]) == r.output().text
        assert toks[r.id] == r.token_ids
    assert any(len([p for p in pieces[r.id] if p]) > 1 for r in reqs)  # text really arrived in pieces


def test_bucket():
    assert [bucket(n, 2, 8) for n in (1, 2, 3, 5, 8)] == [2, 2, 4, 8, 8]
    assert [bucket(n, 2, 6) for n in (3, 5, 6)] == [4, 6, 6]
    assert bucket(40, 16, 64) == 64 and bucket(70, 16, 64) == 128
