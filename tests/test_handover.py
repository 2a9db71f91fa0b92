"""Row hand-over (specjax.engine_handover): a speculative engine with a spare slot per row runs the next
request, prefilled ahead, in a fused dispatch's steps after a row's request ends. Greedy tokens equal
plain decoding (float32), sampled tokens equal the engine without hand-over (same seeds: the random
streams are keyed by request and position), requests ending by a stop id or by max_tokens hand over,
nothing leaks, a parked request can be cancelled alone, steady state compiles nothing."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from helpers import IdTokenizer, draft_setup, draft_of as make_draft
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions
from specjax.spec_tiers import SpecTiers
from specjax.tree import SpecConfig

MAX_SEQ = 64
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    return draft_setup((5, 19, 2, 11, 7, 3))


def _engine(setup, draft: str | None, handover: bool = True, max_batch: int = 1, unread: int = 1) -> Engine:
    """An engine with hand-over on or off and one dispatch unread (unread=2, the default with hand-over at
    max_batch 1, has its own tests below)."""
    cfg, target = setup[:2]
    return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=max_batch),
                  jnp.float32, draft=make_draft(setup, draft), sched=SchedulerOptions(handover=handover, unread=unread))


def _requests(prompts, params):
    ps = params if isinstance(params, list) else [params] * len(prompts)
    return [Request(i, None, p, ps[i], IdTokenizer(), (96,), MAX_SEQ, 1000 + i) for i, p in enumerate(prompts)]


def _assert_clean(eng):
    assert all(s is None for s in eng.slots) and not eng.sched.queue
    assert not eng.has_unfinished()
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked


def _run(eng, prompts, params=GREEDY):
    reqs = _requests(prompts, params)
    eng.run(reqs)
    _assert_clean(eng)
    return [r.output().token_ids for r in reqs]


@pytest.mark.parametrize("draft,max_batch", [("other", 1), ("self", 1), ("other", 2)])
def test_greedy_equals_plain(setup, draft, max_batch):
    prompts = setup[4]
    want = _run(_engine(setup, None, max_batch=max_batch), prompts)
    eng = _engine(setup, draft, max_batch=max_batch)
    assert eng.num_slots == 2 * max_batch and eng.handover
    assert _run(eng, prompts) == want
    if draft == "other":  # (the target as its own draft finishes rows certainly: replaced between dispatches)
        assert eng.handed_over > 0  # some row ran the next request inside a dispatch
    assert eng.admitted_ahead == 0  # no slot given up before its last read (hold-backs: the last request only)


def test_stop_ids_and_short_requests(setup):
    """Requests ending by a stop id (SpecState.done keeps a finished row from running again before the
    host reads it) and by small max_tokens, mixed: greedy tokens equal plain's, rows hand over."""
    prompts = setup[4]
    probe = _run(_engine(setup, None), prompts)
    stop = probe[0][3]  # a token plain decoding emits early for the first prompt
    params = [SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[stop], ignore_eos=True)
              for n in (20, 3, 20, 1, 9, 20)]
    want = _run(_engine(setup, None), prompts, params)
    assert any(len(w) < p.max_tokens for w, p in zip(want, params))  # the stop id ends some request
    eng = _engine(setup, "other")
    assert _run(eng, prompts, params) == want
    assert eng.handed_over > 0


def test_sampling_equals_without_handover(setup):
    """Sampled speculative tokens do not depend on hand-over: a successor's rows use its own sampling
    parameters and seed (per-slot arrays), the draws are keyed by request and position."""
    prompts = setup[4]
    params = [SamplingParams(max_tokens=16, temperature=t, top_p=p, ignore_eos=True)
              for t, p in ((0.9, 1.0), (0.0, 1.0), (1.2, 0.8), (0.7, 1.0), (0.0, 1.0), (1.0, 0.9))]
    want = _run(_engine(setup, "other", handover=False), prompts, params)
    eng = _engine(setup, "other")
    assert _run(eng, prompts, params) == want
    assert eng.handed_over > 0


def test_penalties_logprobs_and_ngram_branch(setup):
    """Successors carry their own per-slot state into the dispatch: penalty counts (admitted with the
    parked request's prefill), the n-gram history of a tree with an n-gram branch, logprobs. Greedy
    tokens equal plain decoding's with the same penalties, logprobs match plain's."""
    cfg, target, other_cfg, other, prompts = setup
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2 if i % 2 else None,
                             repetition_penalty=(1.0, 1.3, 1.0, 0.8, 1.0, 1.1)[i],
                             frequency_penalty=(0.0, 0.0, 0.5, 0.0, 0.0, 0.3)[i],
                             presence_penalty=(0.0, 0.0, 0.0, 0.4, 0.0, 0.0)[i])
              for i, n in enumerate((20, 7, 20, 12, 5, 20))]
    plain = _engine(setup, None)
    want_reqs = _requests(prompts, params)
    plain.run(want_reqs)
    d = Draft(other, other_cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3, topk=2,
                                                               num_draft_tokens=6, ngram_branch=2))
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=1),
                 jnp.float32, draft=d, sched=SchedulerOptions(handover=True, unread=1))
    reqs = _requests(prompts, params)
    eng.run(reqs)
    _assert_clean(eng)
    assert eng.handed_over > 0
    for r, w in zip(reqs, want_reqs):
        got, ref = r.output(), w.output()
        assert got.token_ids == ref.token_ids
        if r.params.logprobs is not None:
            assert len(got.logprobs) == len(ref.logprobs)
            for a, b in zip(got.logprobs, ref.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_cancel_parked_request(setup):
    """A request parked in a spare slot (prefilled, waiting) is cancelled alone: its slot and pages
    are freed, the others' tokens are plain greedy's."""
    prompts = setup[4]
    want = _run(_engine(setup, None), prompts)
    eng = _engine(setup, "other")
    reqs = _requests(prompts, GREEDY)
    for r in reqs:
        eng.add_request(r)
    victim = None
    while eng.has_unfinished():
        eng.step()
        parked = eng.sched.parked()
        if victim is None and parked:
            victim = parked[0][1]
            assert eng.cancel(victim.id)
    assert victim is not None and victim.output().finish_reason == "cancelled"
    _assert_clean(eng)
    for i, r in enumerate(reqs):
        if r is not victim:
            assert r.output().token_ids == want[i]


@pytest.mark.parametrize("max_batch", [1, 2])
def test_cancel_running_row(setup, max_batch):
    """A decoding row's request cancelled while dispatches naming its successor are in flight: its slot and
    pages are freed at once, the successor still runs (inside those dispatches or as a row), the others'
    tokens are plain greedy's, nothing leaks."""
    prompts = setup[4]
    want = _run(_engine(setup, None, max_batch=max_batch), prompts)
    eng = _engine(setup, "other", max_batch=max_batch)
    reqs = _requests(prompts, GREEDY)
    for r in reqs:
        eng.add_request(r)
    victims = []
    while eng.has_unfinished():
        eng.step()
        rows = [r for _, r in eng.sched.decoding() if r.token_ids and not r.finished]
        if len(victims) < 2 and eng.sched.parked() and rows and eng._pending:
            victims.append(rows[0])
            assert eng.cancel(rows[0].id)
    assert len(victims) == 2 and all(v.output().finish_reason == "cancelled" for v in victims)
    _assert_clean(eng)
    for i, r in enumerate(reqs):
        if r not in victims:
            assert r.output().token_ids == want[i]


def test_second_run_compiles_nothing(setup):
    prompts = setup[4]
    eng = _engine(setup, "other")
    first = _run(eng, prompts)
    n = eng.num_compiled()
    assert _run(eng, prompts) == first
    assert eng.num_compiled() == n


def test_handover_with_tiers_is_refused(setup):
    cfg, target, other_cfg, other, _ = setup
    tiers = SpecTiers.of([(1, SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=6)),
                          (2, SpecConfig(method="draft", num_steps=2))])
    d = Draft(other, other_cfg, DraftInfo("draft"), tiers.specs[-1], tiers)
    with pytest.raises(ValueError, match="handover"):
        Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=2),
               jnp.float32, draft=d, sched=SchedulerOptions(handover=True, unread=1))


def test_plain_engine_has_no_spare_slots(setup):
    eng = _engine(setup, None)
    assert eng.num_slots == 1 and not eng.handover


def test_tight_cache_preempts_parked_requests(setup):
    """With too few KV pages for a row and its parked successor, the parked one gives its pages back
    (preempted, re-admitted later); tokens equal plain greedy, nothing leaks."""
    cfg, target, _, _, prompts = setup
    want = _run(_engine(setup, None), prompts)
    d = _engine(setup, "other").draft
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, num_pages=18), BatchOptions(max_batch=1),
                 jnp.float32, draft=d, sched=SchedulerOptions(handover=True, unread=1))
    assert _run(eng, prompts) == want
    assert eng.num_preempted > 0


def test_successors_without_pages_wait(setup):
    """With pages for the rows and their parked successors but not for the successors' steps inside a
    dispatch, dispatches run without hand-over (counted); tokens equal plain greedy, nothing leaks."""
    cfg, target, _, _, prompts = setup
    want = _run(_engine(setup, None), prompts)
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ, num_pages=20), BatchOptions(max_batch=1),
                 jnp.float32, draft=_engine(setup, "other").draft, sched=SchedulerOptions(handover=True, unread=1))
    assert _run(eng, prompts) == want
    assert eng.stats()["handover_no_pages"] > 0


def test_context_end_hands_over(setup):
    """Requests whose prompts nearly fill the context end at MAX_SEQ inside a dispatch (finish_reason
    "length" before max_tokens) and hand over there: greedy tokens equal plain's, nothing leaks."""
    cfg, target, _, _, prompts = setup
    long = [p + [(7 * i + 3 * j) % 96 for j in range(MAX_SEQ - len(p) - 24 + 2 * i)] for i, p in enumerate(prompts)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = _run(_engine(setup, None), long, params)
    eng = _engine(setup, "other")
    reqs = _requests(long, params)
    eng.run(reqs)
    _assert_clean(eng)
    assert [r.output().token_ids for r in reqs] == want
    assert all(r.output().finish_reason == "length" and len(r.output().token_ids) < 40 for r in reqs)
    assert eng.handed_over > 0


def test_dispatch_without_handover_takes_its_rows_flags(setup):
    """A dispatch that runs no successor (lite steps: rows >= speculate_below) is compiled for its rows'
    flags alone: a parked request that wants logprobs does not make its rows' programs compute them."""
    cfg, target = setup[:2]
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=2, speculate_below=2), jnp.float32, draft=make_draft(setup, "other"),
                 sched=SchedulerOptions(handover=True, unread=1))
    calls, decode_call = [], eng._decode_call

    def watched(kind, K, rows, slots, active, mask, drafts, flags, succ=None):
        calls.append((kind, flags, [r for _, r in rows]))
        return decode_call(kind, K, rows, slots, active, mask, drafts, flags, succ)

    eng._decode_call = watched
    params = [GREEDY if i < 4 else SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
              for i in range(6)]
    want = _run(_engine(setup, None, max_batch=2), setup[4], params)
    assert _run(eng, setup[4], params) == want
    lite = [(flags, reqs) for kind, flags, reqs in calls if kind == "lite"]
    assert lite and any(r.logprobs is not None for _, reqs in lite for r in reqs)
    for flags, reqs in lite:
        assert flags["want_logprobs"] == any(r.logprobs is not None for r in reqs)


@pytest.mark.parametrize("draft,handover", [(None, False), ("other", False), ("other", True), ("self", True)])
def test_two_dispatches_unread(setup, draft, handover):
    """SchedulerOptions(unread=2): the host reads two dispatches behind. Greedy tokens equal plain decoding's
    (with stop ids and short requests mixed), sampled ones the one-behind engine's; nothing leaks."""
    cfg, target, _, _, prompts = setup
    probe = _run(_engine(setup, None), prompts)
    params = [SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[probe[0][3]], ignore_eos=True)
              for n in (20, 3, 20, 1, 9, 20)]
    sampled = [SamplingParams(max_tokens=16, temperature=t, ignore_eos=True) for t in (0.9, 0.0, 1.2, 0.7, 0.0, 1.0)]
    d = make_draft(setup, draft)
    make = lambda unread: Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),  # noqa: E731
                                 BatchOptions(max_batch=1), jnp.float32, draft=d,
                                 sched=SchedulerOptions(handover=handover, unread=unread))
    eng = make(2)
    unread, step = [], eng.step

    def counted():  # decode dispatches left unread after each step
        out = step()
        unread.append(sum(e.kind != "prefill" for e in eng._pending))
        return out

    eng.step = counted
    assert _run(eng, prompts, params) == _run(_engine(setup, None), prompts, params)
    assert max(unread) == 2
    assert _run(eng, prompts, sampled) == _run(make(1), prompts, sampled)


def test_default_is_handover_with_two_unread_for_one_row(setup):
    """SchedulerOptions() leaves hand-over and unread to the engine: on (and two dispatches unread) for a
    speculative engine of one row; off (one unread) with more rows, without a draft, in the synchronous
    loop or with tree tiers; an explicit choice holds; the info line says which. The default engine's greedy
    tokens equal plain's."""
    cfg, target, _, _, prompts = setup

    def make(draft="other", max_batch=1, **opts):
        return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=max_batch),
                      jnp.float32, draft=make_draft(setup, draft) if draft else None, sched=SchedulerOptions(**opts))

    def mode(eng):
        return eng.handover, eng.opts.handover, eng.opts.unread
    eng = make()
    assert mode(eng) == (True, True, 2) and eng.num_slots == 2
    assert "row hand-over (a spare slot per row), the host 2 dispatch(es) behind" in eng.info
    assert _run(eng, prompts) == _run(_engine(setup, None), prompts)
    assert eng.handed_over > 0 and eng.admitted_ahead == 0
    wide = make(max_batch=2)
    assert mode(wide) == (False, False, 1) and "admission ahead, the host 1 dispatch(es) behind" in wide.info
    assert mode(make(draft=None)) == (False, False, 1)
    assert mode(make(async_loop=False)) == (False, False, 1)
    assert mode(make(handover=False)) == (False, False, 1)
    assert mode(make(unread=1)) == (True, True, 1)
    assert mode(make(max_batch=2, handover=True)) == (True, True, 1)  # two unread: measured at one row only
    assert mode(make(max_batch=2, handover=True, unread=2)) == (True, True, 2)
    other_cfg, other = setup[2:4]
    tiers = SpecTiers.of([(1, SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=6)),
                          (2, SpecConfig(method="draft", num_steps=2))])
    tiered = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=1), jnp.float32,
                    draft=Draft(other, other_cfg, DraftInfo("draft"), tiers.specs[-1], tiers))
    assert mode(tiered) == (False, False, 1)
    with pytest.raises(ValueError, match="handover must be True, False or None"):
        SchedulerOptions(handover=1)
    with pytest.raises(ValueError, match="unread must be an int >= 1 or None"):
        SchedulerOptions(unread=0)


def test_one_row_speculative_engine_without_handover_keeps_a_spare_device_slot(setup):
    """A speculative engine of max_batch 1 without hand-over schedules one slot but holds two in its
    device state (engine_handover.device_slots: one slot's fused loop was compiled wrong by XLA on GPUs);
    its greedy tokens, with penalties too, equal plain decoding's, and nothing leaks. Plain engines and
    engines of two slots keep their own count."""
    from specjax import engine_handover as eh
    assert (eh.device_slots(1, True), eh.device_slots(2, True), eh.device_slots(1, False)) == (2, 2, 1)
    prompts = setup[4]
    pen = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4)
    plain = _engine(setup, None, handover=False)
    assert plain.device_slots == plain.num_slots == plain.state.cache.seq_lens.shape[0] == 1
    want, want_pen = _run(plain, prompts), _run(plain, prompts, pen)
    eng = _engine(setup, "other", handover=False)
    assert (eng.num_slots, eng.device_slots, eng.handover) == (1, 2, False)
    s = eng.state
    assert s.cache.seq_lens.shape[0] == s.cache.page_table.shape[0] == s.tree_tokens.shape[0] == 2
    assert s.draft_seq_lens.shape[0] == eng.samp.seed.shape[0] == 2
    assert _run(eng, prompts) == want
    assert _run(eng, prompts, pen) == want_pen
    assert eng.state.penalties.out_counts.shape[0] == 2
    two = _engine(setup, "other", handover=False, max_batch=2)
    assert two.device_slots == two.num_slots == two.state.cache.seq_lens.shape[0] == 2
