"""Speculative decoding through the engine (draft model, chain and tree) equals plain decoding:
greedy tokens, stops inside an accepted block, logprobs."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.scheduler import SchedulerOptions
from specjax.tree import SpecConfig

MAX_SEQ = 64
LENS = (1, 40, 7, 16, 17, 3, 12)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0)
    other = tiny_model(tiny_config(num_hidden_layers=1), seed=5)  # a different draft, same vocab
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in LENS]
    return cfg, target, other, prompts


def _engine(cfg, target, draft=None, page_size=4):
    return Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ), BatchOptions(max_batch=3),
                  jnp.float32, draft=draft)


def _run(eng, prompts, params):
    reqs = [Request(i, None, p, params[i] if isinstance(params, list) else params, IdTokenizer(), (96,),
                    MAX_SEQ, 0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert all(s is None for s in eng.slots)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
    return [r.output() for r in reqs]


@pytest.fixture(scope="module")
def plain(setup):
    cfg, target, _, prompts = setup
    return _run(_engine(cfg, target), prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def _draft(model, cfg, k, topk=1, m=None):
    return Draft(model, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=k, topk=topk, num_draft_tokens=m))


@pytest.mark.parametrize("which,page_size,k,topk,m", [("self", 4, 3, 1, None), ("other", 1, 3, 2, 6),
                                                      ("other", 16, 3, 4, 10)])
def test_spec_equals_plain_greedy(setup, plain, which, page_size, k, topk, m):
    cfg, target, other, prompts = setup
    draft = _draft(target, cfg, k) if which == "self" else _draft(other, other_cfg(), k, topk, m)
    outs = _run(_engine(cfg, target, draft, page_size), prompts,
                SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" for o in outs)
    taus = [o.accept_len_mean for o in outs]
    if which == "self":
        assert taus == [k + 1] * len(outs)  # every drafted token accepted
    else:
        assert all(1 <= t <= k + 1 for t in taus) and min(taus) < k + 1


def other_cfg():
    return tiny_config(num_hidden_layers=1)


@pytest.mark.parametrize("max_batch,k,topk,m", [(1, 3, 1, None), (1, 3, 2, 6), (3, 3, 4, 10)])
def test_fused_steps_without_the_padding_row(setup, plain, max_batch, k, topk, m):
    """BatchOptions(fused_min_rows=1): a fused dispatch of one request runs one row (no padding row),
    and the streams still equal plain greedy decoding; with max_batch 1 no two-row program is made."""
    cfg, target, other, prompts = setup
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=max_batch, fused_min_rows=1), jnp.float32,
                 draft=_draft(other, other_cfg(), k, topk, m))
    outs = _run(eng, prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    spec_rows = {d for key, dims in eng.shapes.used.items() if key[:2] == ("decode", "spec") for d in dims}
    if max_batch == 1:
        assert spec_rows == {(1,)}, spec_rows
    else:
        assert spec_rows, eng.shapes.used


def test_fused_min_rows_is_checked():
    with pytest.raises(ValueError, match="fused_min_rows must be 1 or 2"):
        BatchOptions(fused_min_rows=0)
    with pytest.raises(ValueError, match="fused_min_rows must be 1 or 2"):
        BatchOptions(fused_min_rows=True)


@pytest.mark.parametrize("hold", [True, False])
def test_hold_back_near_max_tokens(setup, monkeypatch, hold):
    """A speculative engine does not dispatch fused steps that the steps in flight are expected to make
    useless (every row reaches max_tokens by its measured tokens per step): with a draft that is the
    target itself (4 tokens per fused step) the requests run fewer fused steps than with the hold-back
    switched off, and their tokens equal plain greedy decoding either way."""
    cfg, target, _, prompts = setup
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    short = [prompts[i] for i in (0, 2, 5)]  # prompt + 30 tokens fit the 64-token context
    want = _run(_engine(cfg, target), short, params)

    def run(hold_back):
        if not hold_back:  # no estimate: neither the hold-back nor admission ahead on a guess
            monkeypatch.setattr(Engine, "_expected_done", lambda self, slot, req: False)
        eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=1),
                     jnp.float32, draft=_draft(target, cfg, 3),
                     sched=SchedulerOptions(handover=False, unread=1))  # (hand-over runs no step past the end)
        got = _run(eng, short, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        st = eng.stats()
        assert (st["held_back_steps"] > 0) == hold_back
        return st["spec_dispatch_steps"], sum(len(o.token_ids) for o in got)

    steps, tokens = run(hold)
    assert tokens == 3 * 30
    # 30 tokens at 4 per fused step: 8 useful steps per request (the last one cut at max_tokens)
    if hold:
        assert steps == 3 * 8, steps  # the 4-step dispatches: 4 + 4, none past the end
    else:
        assert steps == 3 * (8 + 4), steps  # one whole 4-step dispatch past each request's end


def test_stops_inside_an_accepted_block(setup, plain):
    """EOS / stop ids / max_tokens that fall inside one speculative step cut exactly where plain
    decoding stops: same tokens, same finish reason, nothing after the stop."""
    cfg, target, _, prompts = setup
    params = []
    for i, o in enumerate(plain):
        toks = o.token_ids
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[toks[4]]))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=12, temperature=0, stop=[f"<{toks[6]}>"], ignore_eos=True))
    want = _run(_engine(cfg, target), prompts, params)
    got = _run(_engine(cfg, target, _draft(target, cfg, 4)), prompts, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
    assert any(w.finish_reason == "stop" for w in want) and any(len(w.token_ids) == 5 for w in want)


@pytest.mark.parametrize("topk,m", [(1, None), (2, 5)])
def test_logprobs_equal_plain(setup, topk, m):
    """Logprobs of accepted tokens (chosen + top alternatives) equal plain decoding's."""
    cfg, target, other, prompts = setup
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    want = _run(_engine(cfg, target), prompts[:4], params)
    got = _run(_engine(cfg, target, _draft(other, other_cfg(), 3, topk, m)), prompts[:4], params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs) == 8
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert list(lw) == list(lg)  # same chosen token and the same top-3 ids, same order
            np.testing.assert_allclose(list(lg.values()), list(lw.values()), rtol=1e-4, atol=1e-4)
