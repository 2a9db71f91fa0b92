"""Admission ahead (specjax.engine_ahead): with max_batch 1 and a queue, the slot of a request expected
to finish with the dispatches in flight goes to the next request before they are read. Tokens equal
plain greedy decoding with it on or off, with right and wrong estimates; nothing leaks; a request
re-admitted after a wrong estimate can be cancelled alone."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from helpers import IdTokenizer, draft_setup, draft_of as make_draft
from specjax.engine import BatchOptions, CacheOptions, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions

MAX_SEQ = 64
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    return draft_setup((5, 19, 2, 11))


def _engine(setup, draft: str | None, ahead: bool = True, early: bool = True) -> Engine:
    cfg, target = setup[:2]
    return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=1),
                  jnp.float32, draft=make_draft(setup, draft),  # (without hand-over, the one-row default)
                  sched=SchedulerOptions(admit_ahead=ahead, admit_early=early, handover=False, unread=1))


def _requests(prompts, params=PARAMS):
    return [Request(i, None, p, params, IdTokenizer(), (96,), MAX_SEQ, 0) for i, p in enumerate(prompts)]


def _queued(setup, early: bool = True):
    """A speculative engine (the wrong draft, the always-done estimate patched in by the caller) with
    every request queued."""
    eng = _engine(setup, "other", early=early)
    reqs = _requests(setup[4])
    for r in reqs:
        eng.add_request(r)
    return eng, reqs


def _assert_others(eng, reqs, victim, want):
    """The victim was found and cancelled; nothing leaked; every other request has plain greedy's tokens."""
    assert victim is not None
    _assert_clean(eng)
    for i, r in enumerate(reqs):
        if r is not victim:
            assert r.output().token_ids == want[i]


def _assert_clean(eng):
    assert all(s is None for s in eng.slots) and not eng.sched.queue
    assert not eng.has_unfinished()
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked


def _run(eng, prompts):
    reqs = _requests(prompts)
    eng.run(reqs)
    _assert_clean(eng)
    return [r.output().token_ids for r in reqs]


def _always_done(self, slot, req):
    """An estimate that says "done" for every measured row with fused steps in flight."""
    return any(e.kind == "spec" for e in self._pending) and req.accept_ema is not None


@pytest.fixture(scope="module")
def want(setup):
    eng = _engine(setup, None, ahead=False)
    return _run(eng, setup[4])


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("draft", [None, "self", "other"])
def test_admission_ahead_equals_plain_greedy(setup, want, draft, early):
    """Each request boundary of the queued batch-1 run is crossed ahead (the rows finish certainly, or
    by the estimate; early: right after the dispatch that finishes them), and the tokens are plain
    greedy decoding's."""
    eng = _engine(setup, draft, early=early)
    assert _run(eng, setup[4]) == want
    st = eng.stats()
    assert st["admitted_ahead"] >= 1, st
    assert st["admitted_ahead"] <= len(setup[4]) - 1  # the last request has no successor
    if draft in (None, "self"):  # plain rows finish certainly; the target as draft: 4 tokens per step
        assert st["admitted_ahead"] == len(setup[4]) - 1 and st["admit_ahead_misses"] == 0, st
    if draft is None:  # early: every release right after the dispatch (a step's start never finds one)
        assert st["admitted_early"] == (st["admitted_ahead"] if early else 0), st
    elif not early:
        assert st["admitted_early"] == 0, st
    off = _engine(setup, draft, ahead=False)
    assert _run(off, setup[4]) == want
    assert off.stats()["admitted_ahead"] == 0


@pytest.mark.parametrize("early", [True, False])
def test_wrong_estimates_readmit_the_request(setup, want, monkeypatch, early):
    """An estimate that always says "done" releases rows that still need tokens: they are read,
    put back at the front of the queue, prefilled again with their tokens, and end as plain decoding
    would; every miss counts as a preemption."""
    monkeypatch.setattr(Engine, "_expected_done", _always_done)
    eng = _engine(setup, "other", early=early)
    assert _run(eng, setup[4]) == want
    st = eng.stats()
    assert st["admit_ahead_misses"] >= 1, st
    assert st["num_preempted"] >= st["admit_ahead_misses"]


@pytest.mark.parametrize("early", [True, False])
def test_released_requests_are_read_within_the_step(setup, want, monkeypatch, early):
    """The step that gives a slot away also reads the released rows' dispatches (early: the next step
    does, and until then they are in `_released_early`): after every step each unfinished request is in
    the queue, a slot or (early) that list, so cancel reaches it; cancelling the request re-admitted
    after a miss ends it alone, the others keep plain decoding's tokens."""
    monkeypatch.setattr(Engine, "_expected_done", _always_done)
    eng, reqs = _queued(setup, early)
    victim = None
    while eng.has_unfinished():
        eng.step()
        placed = {id(r) for r in eng.sched.queue} | {id(r) for r in eng.slots if r is not None}
        if not early:
            assert not eng._released_early
        placed |= {id(r) for r in eng._released_early}
        assert all(id(r) in placed for r in reqs if not r.finished)
        if victim is None and eng.admit_ahead_misses:
            victim = eng.sched.queue[0]  # the missed request, back at the front
            assert eng.cancel(victim.id) and victim.finish_reason == "cancelled"
    _assert_others(eng, reqs, victim, want)


def test_cancel_reaches_a_request_released_early(setup, want, monkeypatch):
    """A request whose slot went to the next request right after its dispatch (not read yet) is
    cancelled alone: its tokens stop, no page leaks, the others keep plain decoding's tokens."""
    monkeypatch.setattr(Engine, "_expected_done", _always_done)
    eng, reqs = _queued(setup)
    victim = None
    while eng.has_unfinished():
        eng.step()
        if victim is None:
            live = [r for r in eng._released_early if not r.finished]
            if live:
                victim = live[0]
                assert victim not in eng.slots and victim not in eng.sched.queue
                n = len(victim.token_ids)
                assert eng.cancel(victim.id) and victim.finish_reason == "cancelled"
                assert not eng.cancel(victim.id)  # once
    _assert_others(eng, reqs, victim, want)
    assert len(victim.token_ids) == n and victim.finish_reason == "cancelled"  # its dispatch's tokens dropped


def test_speculative_rows_released_early(setup):
    """Longer speculative requests (several dispatches: the acceptance is measured before the last one):
    their slots go to the next request right after the dispatch expected to finish them, and the tokens
    are plain greedy decoding's."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [p[:12] for p in setup[4]]
    plain = _engine(setup, None, ahead=False)
    reqs = _requests(prompts, params)
    plain.run(reqs)
    want = [r.output().token_ids for r in reqs]
    eng = _engine(setup, "self")
    reqs = _requests(prompts, params)
    eng.run(reqs)
    _assert_clean(eng)
    assert [r.output().token_ids for r in reqs] == want
    st = eng.stats()
    assert st["admitted_early"] >= 1 and st["admit_ahead_misses"] == 0, st
