"""Adaptive speculation (BatchOptions.speculate_below, specjax.dispatch_plan): a speculative engine
runs lite steps (step.spec_lite_step: plain decoding that keeps the draft in sync) for batches of
>= speculate_below rows and fused steps below. Requests arriving and finishing over time move the
batch across the threshold both ways: greedy float32 outputs equal plain decoding token for token
(EAGLE-3 tree, the target as its own chain draft (a chain keeps sampled-draft proposals), the n-gram
drafter; penalties, stop ids, max_tokens), also with lite steps only; the draft stays in sync (the
self-drafting chain accepts every token again after the first fused step that follows lite steps);
the switches compile nothing once warm and leak no page or slot. Sampling: the joint law of the first three tokens through a
lite step and then a fused step verifying the stale tree equals the exact law (chi-square), and the
same check rejects a stale tree verified against proposals it was not drawn from."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax import programs as prog
from specjax.decode import whole_prompts
from specjax.dispatch_plan import runs_lite
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.kv_cache import init_cache
from specjax.request import Request
from specjax.sampling import SamplingArrays
from specjax.sampling_params import SamplingParams
from specjax.step import init_spec_state
from specjax.tree import SpecConfig
from test_compile_once import CompileCounter

MAX_SEQ = 64
EOS = 96
ARRIVALS = (0, 3, 9, 13)  # engine step at which each request is added: the batch goes 1 -> 2 -> 1 -> 2 ...


@pytest.fixture(scope="module")
def world():
    cfg = tiny_config()  # two layers: greedy outputs vary (no early fixed point)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (5, 13, 11, 2)]  # one prefill length
    return cfg, tiny_model(cfg, seed=0), prompts


def _engine(world, draft, **batch):
    cfg, target, _ = world
    return Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                  BatchOptions(max_batch=2, steps_per_call=2, spec_steps_per_call=2, **batch), jnp.float32, draft=draft)


def _run(eng, prompts, params, below=None, spy=None, arrivals=ARRIVALS):
    """Run the requests, adding request i at engine step arrivals[i]; speculate_below = below.
    spy: a list that gets (lite, request ids) of every speculative dispatch."""
    eng.batch_opts = dataclasses.replace(eng.batch_opts, speculate_below=below)
    if spy is not None and not hasattr(eng, "_spied"):
        step = eng.spec_steps.step

        def spied(*a, **kw):  # (lite, the ids of the requests in the dispatch's slots)
            reqs = [eng.sched.slots[s] if s < len(eng.sched.slots) else None for s in np.asarray(a[4]).tolist()]
            spy.append((kw["lite"], [r.id for r in reqs if r is not None]))
            return step(*a, **kw)
        eng.spec_steps, eng._spied = eng.spec_steps._replace(step=spied), True
    reqs = [Request(i, None, p, params[i], IdTokenizer(), (EOS,), MAX_SEQ, 11 + i) for i, p in enumerate(prompts)]
    t = 0
    while t <= max(arrivals) or eng.has_unfinished():
        for i, a in enumerate(arrivals):
            if a == t:
                eng.add_request(reqs[i])
        eng.step()
        t += 1
    assert all(s is None for s in eng.slots)
    assert eng.alloc.num_free == eng.alloc.num_pages - 1  # every page back (cached prefixes count as free)
    return reqs


def _params(stop_id=None):
    return [SamplingParams(max_tokens=56, temperature=0, ignore_eos=True, repetition_penalty=1.1),
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                           stop_token_ids=[] if stop_id is None else [stop_id]),
            SamplingParams(max_tokens=12, temperature=0, frequency_penalty=0.7, presence_penalty=0.3,
                           repetition_penalty=1.3, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)]


@pytest.fixture(scope="module")
def plain(world):
    """Plain decoding's outputs of the requests (r1 stops at a token it emits, r2 has penalties)."""
    eng = _engine(world, None)
    first = _run(eng, world[2], _params())
    params = _params(first[1].token_ids[6])
    reqs = _run(eng, world[2], params)
    assert reqs[1].finish_reason == "stop" and len(reqs[1].token_ids) == 7
    return params, [(r.token_ids, r.finish_reason) for r in reqs]


def _draft(cfg, target, kind) -> Draft:
    if kind.startswith("eagle3 tree"):  # "eagle3 tree + ngram branch": 2 n-gram nodes added
        from test_spec_eagle import random_head
        head, ecfg = random_head(cfg, "eagle3", seed=3, draft_vocab=80, aux_layers=(0, 1, 2))
        return Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers),
                     SpecConfig(method="eagle3", num_steps=3, topk=2, num_draft_tokens=5,
                                ngram_branch=2 if "ngram" in kind else 0))
    if kind == "self chain":  # the target as its own draft: every drafted token is right
        return Draft(target, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=3))
    return Draft(None, None, DraftInfo("ngram"), SpecConfig(method="ngram", num_steps=3, topk=2))


def _check_in_sync(spy, lens, per_call: int, full: int):
    """The self-drafting request r0 accepts all `full` tokens of every fused step except the first
    one after lite steps (it verifies the stale tree, grown before them; the draft's extend over the
    lite steps' tokens keeps the following ones right). spy: (lite, request ids) of the dispatches;
    lens: r0's accept_lens (its fused steps, per_call per fused dispatch: the pages for them are
    always free here). Returns the fused steps that followed lite steps and had to be full."""
    i, prev_lite, seen_lite, checked = 0, False, False, 0
    for lite, ids in spy:
        if 0 not in ids:
            continue
        if not lite:
            for k, n in enumerate(lens[i:i + per_call]):
                stale = prev_lite and k == 0
                assert stale or n == full, (i + k, lens)
                checked += seen_lite and not stale
            i += per_call
        prev_lite = lite
        seen_lite |= lite
    assert i >= len(lens)
    return checked


@pytest.mark.parametrize("kind", ["eagle3 tree", "self chain", "ngram tree", "eagle3 tree + ngram branch"])
def test_switching_equals_plain(world, plain, kind):
    """Threshold 2 (the batch crosses it both ways), 1 (lite steps only), 2 again and None (fused
    steps only): the outputs of plain decoding each time. Once warm (the third run) switching
    compiles nothing; every run gives back every page and slot (_run)."""
    cfg, target, prompts = world
    params, want = plain
    eng = _engine(world, _draft(cfg, target, kind))
    if kind == "self chain":
        assert eng.state.draft_probs is not None  # the chain keeps sampled-draft proposals
    spy = []

    def outs(below):
        reqs = _run(eng, prompts, params, below=below, spy=spy)
        outs.r0 = reqs[0]
        return [(r.token_ids, r.finish_reason) for r in reqs]
    assert outs(2) == want
    if kind == "self chain":  # the draft stayed in sync through the lite steps
        assert _check_in_sync(spy, outs.r0.accept_lens, 2, 4) >= 3
    kinds = [lite for lite, _ in spy]
    assert any(a and not b for a, b in zip(kinds, kinds[1:])) and any(b and not a for a, b in zip(kinds, kinds[1:]))
    st = eng.stats()
    assert (st["lite_dispatches"], st["spec_dispatches"]) == (sum(kinds), len(kinds) - sum(kinds))
    assert st["lite_dispatch_steps"] >= st["lite_dispatches"] and st["decode_dispatches"] == 0
    spy.clear()
    assert outs(1) == want
    assert spy and all(lite for lite, _ in spy)
    compiled = eng.num_compiled()
    with CompileCounter() as c:
        assert outs(2) == want
    assert c.n == 0 and eng.num_compiled() == compiled, "switching compiled again in steady state"
    if kind == "eagle3 tree":
        spy.clear()
        assert outs(None) == want
        assert spy and not any(lite for lite, _ in spy)


def test_policy(tmp_path):
    """The threshold: lite steps from speculate_below rows; LLM(speculate_below=...) resolved from
    the draft's measurements ("auto"), checked, and refused without a draft."""
    import json

    from specjax.llm import resolve_speculate_below
    assert not runs_lite(7, 8) and runs_lite(8, 8) and runs_lite(64, 8) and not runs_lite(64, None)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="speculate_below"):
            BatchOptions(speculate_below=bad)
        with pytest.raises(ValueError, match="speculate_below"):
            resolve_speculate_below(bad, "self")
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"1": {"num_steps": 4}, "8": "plain"}}))
    assert resolve_speculate_below("auto", str(tmp_path)) == 8
    assert resolve_speculate_below(None, str(tmp_path)) is None and resolve_speculate_below(4, str(tmp_path)) == 4
    assert resolve_speculate_below("auto", "self") is None and resolve_speculate_below("auto", None) is None
    with pytest.raises(ValueError, match="needs speculative decoding"):
        resolve_speculate_below(4, None)


# ----------------------------------------------------------------------------- acceptance gate


class _Req:
    def __init__(self, ema=None):
        self.accept_ema = ema


def test_gate_decisions():
    """specjax.adaptive: fused steps while a row has no estimate or the mean estimate reaches
    min_accept; lite otherwise, with a fused probe after probe_every lite dispatches; estimates are
    exponential averages of the fused dispatches' tokens per step (a dispatch after lite steps
    skips its stale first step); bad settings are refused."""
    from specjax.adaptive import EMA_WEIGHT, AcceptanceGate
    g = AcceptanceGate()
    lo, hi, new = _Req(1.2), _Req(3.0), _Req()
    assert not g.lite([lo, new], 2.0, 3)  # a row without an estimate: measure it
    assert not g.lite([lo, hi], 2.0, 3)  # mean 2.1 >= 2.0
    assert not g.lite([lo], None, 3)  # no gate
    decisions = [g.lite([lo], 2.0, 3) for _ in range(8)]
    assert decisions == [True, True, True, False, True, True, True, False]
    assert g.stats() == {"gated_dispatches": 6, "gate_probes": 2}
    r = _Req()
    AcceptanceGate.observe(r, [3, 1, 0, 0], after_lite=False)  # finished rows' steps (0) do not count
    assert r.accept_ema == 2.0
    AcceptanceGate.observe(r, [1, 4, 4], after_lite=True)  # the stale first step is skipped
    assert r.accept_ema == pytest.approx((1 - EMA_WEIGHT) * 2.0 + EMA_WEIGHT * 4.0)
    AcceptanceGate.observe(r, [0, 0], after_lite=False)  # nothing emitted: unchanged
    AcceptanceGate.observe(_Req(), [2], after_lite=True)  # a single step is kept
    assert r.accept_ema == pytest.approx(3.0)
    for bad in (0.5, -1, True, "x", float("nan")):
        with pytest.raises(ValueError, match="min_accept"):
            BatchOptions(min_accept=bad)
    for bad in (0, 1.5, False):
        with pytest.raises(ValueError, match="probe_every"):
            BatchOptions(probe_every=bad)


@pytest.mark.parametrize("kind", ["ngram tree", "self chain"])
def test_gate_equals_plain(world, plain, kind):
    """The gate in the engine: with a break-even no draft reaches (100 tokens per step) every row is
    gated after its first fused dispatch, probes run every probe_every lite dispatches, and the
    outputs are plain decoding's (greedy float32; penalties, stop ids); with min_accept 1 (every
    fused step emits >= 1 token) nothing is gated. The self-drafting chain accepts every token, so
    its estimate is the full step (4) and min_accept 4 keeps it fused."""
    cfg, target, prompts = world
    params, want = plain
    eng = _engine(world, _draft(cfg, target, kind), min_accept=100.0, probe_every=2)
    spy = []
    reqs = _run(eng, prompts, params, spy=spy)
    assert [(r.token_ids, r.finish_reason) for r in reqs] == want
    st = eng.stats()
    assert st["gated_dispatches"] > 0 and st["gate_probes"] > 0 and st["lite_dispatches"] == st["gated_dispatches"]
    kinds = [lite for lite, _ in spy]
    assert not kinds[0] and any(kinds)  # the first dispatch measures, then lite steps
    assert all(r.accept_ema is not None and r.accept_ema < 100 for r in reqs)
    for gate in ((1.0,) if kind == "ngram tree" else (1.0, 4.0)):
        eng = _engine(world, _draft(cfg, target, kind), min_accept=gate, probe_every=2)
        reqs = _run(eng, prompts, params)
        assert [(r.token_ids, r.finish_reason) for r in reqs] == want
        assert eng.stats()["gated_dispatches"] == 0 and eng.stats()["lite_dispatches"] == 0
        if gate == 4.0:
            assert reqs[0].accept_ema == 4.0


def test_min_accept_resolution(tmp_path):
    """LLM(min_accept=...): "auto" is the n-gram break-even for "ngram", a draft's spec_defaults
    "min_accept" for the batch, else None; numbers are checked; a bad value in specjax.json names
    the file; the CLI flag takes a number, 'none' or 'auto'."""
    import argparse
    import json

    from specjax.adaptive import NGRAM_MIN_ACCEPT
    from specjax.checkpoint import CheckpointError
    from specjax.cli import min_accept_arg
    from specjax.llm import resolve_min_accept
    assert resolve_min_accept("auto", "ngram", 1) == NGRAM_MIN_ACCEPT
    assert resolve_min_accept("auto", None, 1) is None and resolve_min_accept("auto", "self", 1) is None
    assert resolve_min_accept(None, "ngram", 1) is None and resolve_min_accept(2.5, "self", 1) == 2.5
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {
        "1": {"num_steps": 5, "topk": 4, "num_draft_tokens": 16, "min_accept": 2.3}, "8": {"num_steps": 4}}}))
    assert resolve_min_accept("auto", str(tmp_path), 1) == 2.3 and resolve_min_accept("auto", str(tmp_path), 4) == 2.3
    assert resolve_min_accept("auto", str(tmp_path), 8) is None
    for bad in (0.9, "fast", True):
        with pytest.raises(ValueError, match="min_accept"):
            resolve_min_accept(bad, "ngram", 1)
    with pytest.raises(ValueError, match="needs speculative decoding"):
        resolve_min_accept(2.0, None, 1)
    (tmp_path / "specjax.json").write_text(json.dumps({"spec_defaults": {"1": {"num_steps": 5, "min_accept": 0}}}))
    with pytest.raises(CheckpointError, match="min_accept"):
        resolve_min_accept("auto", str(tmp_path), 1)
    assert min_accept_arg("none") is None and min_accept_arg("AUTO") == "auto" and min_accept_arg("1.5") == 1.5
    for bad in ("0.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            min_accept_arg(bad)


# ----------------------------------------------------------------------------- sampling law

V = 6
ROWS = 3000


def _lite_then_fused(cfg, target, draft, spec, temperature, top_p):
    """First three tokens of ROWS requests: prefill (token 1), a lite step (token 2), a fused step
    verifying the stale tree (token 3 on); then again from the same lite step with the stale nodes'
    proposals corrupted (node 1's and node 2's swapped: not what they were drawn from). Through the
    engine's programs. -> (first3, the fused step's num_accepted [ROWS], first3 corrupted)."""
    progs, tw, dw = prog.spec_programs(DraftInfo("draft"), spec, *nnx.split(target), *nnx.split(draft))
    pps = 8
    cache = init_cache(cfg, num_pages=1 + ROWS * pps, page_size=4, max_slots=ROWS, max_seq_len=4 * pps,
                       dtype=jnp.float32)
    cache.page_table = jnp.asarray(1 + np.arange(ROWS * pps, dtype=np.int32).reshape(ROWS, pps))
    dkv = init_cache(cfg, num_pages=1 + ROWS * pps, page_size=4, max_slots=ROWS, max_seq_len=4 * pps,
                     dtype=jnp.float32).kv
    state = init_spec_state(cache, dkv, spec, V)
    samp = SamplingArrays(temperature=jnp.full((ROWS,), temperature, jnp.float32),
                          top_p=jnp.full((ROWS,), top_p, jnp.float32), top_k=jnp.zeros((ROWS,), jnp.int32),
                          seed=jnp.arange(ROWS, dtype=jnp.uint32) * 7919 + 13)
    from test_spec_sampling import PROMPT
    slots = jnp.arange(ROWS, dtype=jnp.int32)
    rows = whole_prompts(jnp.asarray(np.tile(np.array(PROMPT, np.int32), (ROWS, 1))),
                         jnp.full((ROWS,), len(PROMPT), jnp.int32), slots)
    out, _, state, samp_all = progs.prefill(tw, dw, state, prog.init_samp(ROWS), rows, samp, None,
                                            want_logprobs=False, stochastic=True)
    active, stop = jnp.ones((ROWS,), bool), prog.no_stop(ROWS)

    def step(state, lite):
        o, _, state = progs.step(tw, dw, state, samp_all, slots, active, None, stop, num_steps=1, lite=lite,
                                 want_logprobs=False, stochastic=True)
        t, n = np.asarray(o.tokens)[0], np.asarray(o.num_accepted)[0]  # [ROWS, S + 1], [ROWS]
        assert ((t >= 0) == (np.arange(t.shape[1])[None] < n[:, None])).all()
        assert (n == 1).all() if lite else (n >= 1).all()
        return t, n, state

    t2, _, state = step(state, True)
    q = state.draft_probs  # [ROWS, N, V]
    q = q.at[:, 1].set(q[:, 2]).at[:, 2].set(q[:, 1])
    swapped = jax.tree.map(jnp.copy, dataclasses.replace(state, draft_probs=q))  # a copy: `state` is donated
    t3, n, _ = step(state, False)
    t3_bad, _, _ = step(swapped, False)

    def first3(*streams):
        return np.stack([row[row >= 0][:3] for row in np.concatenate(streams, axis=1)])
    t1 = np.asarray(out.tokens)[:, None]
    return first3(t1, t2, t3), n, first3(t1, t2, t3_bad)


@pytest.fixture(scope="module")
def small():
    """test_spec_sampling's models: a target and another draft model over a vocabulary of V."""
    from test_spec_sampling import _cfg
    cfg = _cfg()
    assert cfg.vocab_size == V
    return cfg, tiny_model(cfg, seed=0, std=0.25), tiny_model(cfg, seed=11, std=0.25)


def test_lite_then_fused_sampling_law(small):
    """A sampled chain (proposals draft_probs) of another model: tokens 1 - 3 from prefill, a lite
    step and the fused step that verifies the stale chain follow the exact law; with the stale
    proposals swapped the same check rejects."""
    from test_spec_sampling import _chi2_pvalue, _counts, _exact_law
    cfg, target, other = small
    law = _exact_law(cfg, target, 0.9, 0.9)
    first3, n, corrupted = _lite_then_fused(cfg, target, other, SpecConfig(method="draft", num_steps=2), 0.9, 0.9)
    pval, stat, dof = _chi2_pvalue(_counts(first3), law)
    assert pval > 1e-3, (pval, stat, dof)
    assert (n >= 2).mean() > 0.05  # stale drafts do get accepted: their proposals matter
    pval, _, _ = _chi2_pvalue(_counts(corrupted), law)
    assert pval < 1e-6


@pytest.mark.parametrize("kind", ["eagle3 tree", "self chain"])
def test_lite_dispatch_extends_the_draft_once(world, kind):
    """K lite steps in one dispatch (the target's side K times, then one draft extend over the K
    tokens: step.lite_draft_sync) leave the state that K one-step lite dispatches leave: the same
    tokens, lengths, trees and draft lengths, the draft's KV equal up to float32 rounding; a row that
    finishes inside the dispatch (its length limit after 2 steps) is extended over its 2 tokens only,
    and a padding row changes nothing."""
    cfg, target, prompts = world
    d = _draft(cfg, target, kind)
    progs, tw, dw = prog.spec_programs(d.info, d.spec, *nnx.split(target), *nnx.split(d.model))
    slots_n, pps = 2, 8

    def fresh():
        cache = init_cache(cfg, num_pages=1 + slots_n * pps, page_size=4, max_slots=slots_n, max_seq_len=4 * pps,
                           dtype=jnp.float32)
        cache.page_table = jnp.asarray(1 + np.arange(slots_n * pps, dtype=np.int32).reshape(slots_n, pps))
        dkv = init_cache(d.kv_cfg, num_pages=1 + slots_n * pps, page_size=4, max_slots=slots_n,
                         max_seq_len=4 * pps, dtype=jnp.float32).kv
        state = init_spec_state(cache, dkv, d.spec, cfg.vocab_size)
        P = [prompts[1][:11], prompts[2][:11]]
        rows = whole_prompts(jnp.asarray(np.array(P, np.int32)), jnp.array([11, 11], jnp.int32),
                             jnp.arange(2, dtype=jnp.int32))
        samp = SamplingArrays(jnp.zeros(2, jnp.float32), jnp.ones(2, jnp.float32), jnp.zeros(2, jnp.int32),
                              jnp.zeros(2, jnp.uint32))
        _, _, state, samp_all = progs.prefill(tw, dw, state, prog.init_samp(slots_n), rows, samp, None,
                                              want_logprobs=False, stochastic=False)
        return state, samp_all

    slots = jnp.array([0, 1, slots_n], jnp.int32)  # a padding row (out of range)
    active = jnp.array([True, True, False])
    stop = prog.StopRows(jnp.full((3, 1), -1, jnp.int32), jnp.array([10 ** 6, 11 + 2, 10 ** 6], jnp.int32))

    def run(K, calls):
        state, samp_all = fresh()
        outs = []
        for _ in range(calls):
            o, _, state = progs.step(tw, dw, state, samp_all, slots, active, None, stop, num_steps=K, lite=True,
                                     want_logprobs=False, stochastic=False)
            outs.append(o)  # fields [K, 3, ...] in the fused step's layout
        out = jax.tree.map(lambda *x: np.concatenate([np.asarray(a) for a in x]), *outs)
        return out, state

    o_once, once = run(3, 1)
    o_each, each = run(1, 3)  # one-step dispatches: spec_lite_step, its outputs drawn by accept itself
    for name in ("tokens", "num_accepted", "accept_hist"):  # the K-step loop's outputs, rebuilt after it
        np.testing.assert_array_equal(getattr(o_once, name), getattr(o_each, name), name)
    assert o_once.tokens.shape == (3, 3, d.spec.num_steps + 1) and (o_once.tokens[:, :, 1:] == -1).all()
    assert o_once.num_accepted.tolist() == [[1, 1, 0], [1, 1, 0], [1, 0, 0]]
    t_once = o_once.tokens[:, :, 0]
    assert (t_once[:, 2] == -1).all() and (t_once[2:, 1] == -1).all() and (t_once[:, 0] >= 0).all()
    for name in ("draft_seq_lens", "tree_tokens", "tree_parents"):
        np.testing.assert_array_equal(np.asarray(getattr(once, name)), np.asarray(getattr(each, name)), name)
    np.testing.assert_array_equal(np.asarray(once.cache.seq_lens), np.asarray(each.cache.seq_lens))
    assert np.asarray(once.cache.seq_lens).tolist() == [14, 13]
    pt = np.asarray(once.cache.page_table)

    def entries(kv, lens):  # each slot's entries below its length, through its page table
        return [np.asarray(layer)[pt[s, np.arange(n) // 4], np.arange(n) % 4] for layer in kv
                for s, n in enumerate(np.asarray(lens).tolist())]
    for a, b in zip(entries(once.draft_kv, once.draft_seq_lens), entries(each.draft_kv, each.draft_seq_lens)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(entries(once.cache.kv, once.cache.seq_lens), entries(each.cache.kv, each.cache.seq_lens)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
