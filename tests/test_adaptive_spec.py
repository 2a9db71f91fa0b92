"""Adaptive speculation (BatchOptions.speculate_below, specjax.dispatch_plan): a speculative engine
runs lite steps (step_lite.spec_lite_step: plain decoding that keeps the draft in sync) for batches of
>= speculate_below rows and fused steps below. Requests arriving and finishing over time move the
batch across the threshold both ways: greedy float32 outputs (and logprobs) equal plain decoding token for token
(EAGLE-3 tree, the target as its own chain draft (a chain keeps sampled-draft proposals), the n-gram
drafter; penalties, stop ids, max_tokens), also with lite steps only; the draft stays in sync (the
self-drafting chain accepts every token again after the first fused step that follows lite steps);
the switches compile nothing once warm and leak no page or slot. An EAGLE-3 head's plain steps are
lazy (specjax.lazy_draft: plain decoding's program, the draft caught up before a dispatch reads it):
every dispatch that reads the draft finds it in sync, K lazy steps and the catch-up leave the state
of K lite steps, also under preemption with arrivals. Sampling: the joint law of the first three
tokens through a lite (or lazy + catch-up) step and then a fused step verifying the stale tree equals
the exact law (chi-square), and the same check rejects a stale tree verified against proposals it was
not drawn from."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import IdTokenizer, tiny_config, tiny_model
from specjax import programs as prog
from specjax.decode import PrefillRows, whole_prompts
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


class _Spy(list):
    lazy = 0  # lazy dispatches seen


def _install_spy(eng, spy):
    """Wrap eng's speculative step program: spy gets (lite, request ids) of every dispatch, spy.lazy
    counts the lazy ones; a dispatch that reads the draft asserts every active row's draft in sync."""
    step = eng.spec_steps.step
    info = eng.draft.info

    def spied(*a, **kw):  # (lite, the ids of the requests in the dispatch's slots)
        slots = np.asarray(a[4]).tolist()
        reqs = [eng.sched.slots[s] if s < len(eng.sched.slots) else None for s in slots]
        if kw.get("lazy"):
            spy.lazy += 1
        elif info.has_model:
            state = a[2]
            dl, L = np.asarray(state.draft_seq_lens), np.asarray(state.cache.seq_lens)
            for s, on in zip(slots, np.asarray(a[5]).tolist()):
                if on and s < len(dl):
                    assert dl[s] == L[s] + 1 - info.shift, (s, dl[s], L[s], kw)
        spy.append((kw["lite"], [r.id for r in reqs if r is not None]))
        return step(*a, **kw)
    eng.spec_steps, eng._spied = eng.spec_steps._replace(step=spied), True


def _run(eng, prompts, params, below=None, spy=None, arrivals=ARRIVALS):
    """Run the requests, adding request i at engine step arrivals[i]; speculate_below = below.
    spy: a list that gets (lite, request ids) of every speculative dispatch; spy.lazy counts the
    lazy ones (specjax.lazy_draft). A dispatch that reads the draft (not lazy) finds the draft of
    every active row in sync (Ld = L + 1 - shift): lazy steps' lagging drafts were caught up."""
    eng.batch_opts = dataclasses.replace(eng.batch_opts, speculate_below=below)
    if spy is not None and not hasattr(eng, "_spied"):
        _install_spy(eng, spy)
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


@pytest.mark.parametrize("kind", ["eagle3 tree", "eagle3 tree, synced lite", "eagle3 tree, gated", "self chain",
                                  "ngram tree", "eagle3 tree + ngram branch"])
def test_switching_equals_plain(world, plain, kind):
    """Threshold 2 (the batch crosses it both ways), 1 (lite steps only), 2 again and None (fused
    steps only): the outputs of plain decoding each time. Once warm (the third run) switching
    compiles nothing; every run gives back every page and slot (_run). The EAGLE-3 head's lite
    steps are lazy (plain decoding's program; its draft caught up before a dispatch reads it: _run
    checks), or synced (BatchOptions.lazy_draft off); "gated": the acceptance gate's lite steps
    (synced) for one row, lazy ones for two. The others keep their drafts in sync."""
    cfg, target, prompts = world
    params, want = plain
    opts = dict(lazy_draft="synced" not in kind)
    if "gated" in kind:
        opts.update(min_accept=100.0, probe_every=2)
    eng = _engine(world, _draft(cfg, target, kind), **opts)
    if kind == "self chain":
        assert eng.state.draft_probs is not None  # the chain keeps sampled-draft proposals
    spy = _Spy()

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
    lazy = kind in ("eagle3 tree", "eagle3 tree, gated")
    assert st["lazy_dispatches"] == spy.lazy and (spy.lazy > 0) == lazy
    assert (st["lite_dispatches"] + st["lazy_dispatches"], st["spec_dispatches"]) == (sum(kinds), len(kinds) - sum(kinds))
    assert st["lite_dispatch_steps"] >= st["lite_dispatches"] and st["decode_dispatches"] == 0
    assert (st["catch_ups"] > 0 and st["catch_up_tokens"] > 0) == lazy
    if "gated" in kind:
        assert st["gated_dispatches"] > 0 and st["lite_dispatches"] == st["gated_dispatches"]
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
    spy = _Spy()
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


def _lite_then_fused(cfg, target, draft, spec, temperature, top_p, info=DraftInfo("draft"), kv_cfg=None,
                     lazy=False):
    """First three tokens of ROWS requests: prefill (token 1), a lite step (token 2; lazy: a lazy step,
    then the catch-up piece x_P from P with next token x_{P+1}: specjax.lazy_draft), a fused step
    verifying the stale tree (token 3 on); then again from the same lite step with the stale nodes'
    proposals corrupted (node 1's and node 2's swapped: not what they were drawn from). Through the
    engine's programs. -> (first3, the fused step's num_accepted [ROWS], first3 corrupted)."""
    progs, tw, dw = prog.spec_programs(info, spec, *nnx.split(target), *nnx.split(draft))
    pps = 8
    cache = init_cache(cfg, num_pages=1 + ROWS * pps, page_size=4, max_slots=ROWS, max_seq_len=4 * pps,
                       dtype=jnp.float32)
    cache.page_table = jnp.asarray(1 + np.arange(ROWS * pps, dtype=np.int32).reshape(ROWS, pps))
    dkv = init_cache(kv_cfg or cfg, num_pages=1 + ROWS * pps, page_size=4, max_slots=ROWS, max_seq_len=4 * pps,
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

    def step(state, lite, lazy=False):
        o, _, state = progs.step(tw, dw, state, samp_all, slots, active, None, stop, num_steps=1, lite=lite,
                                 lazy=lazy, want_logprobs=False, stochastic=True)
        t, n = np.asarray(o.tokens)[0], np.asarray(o.num_accepted)[0]  # [ROWS, S + 1], [ROWS]
        assert ((t >= 0) == (np.arange(t.shape[1])[None] < n[:, None])).all()
        assert (n == 1).all() if lite else (n >= 1).all()
        return t, n, state

    t2, _, state = step(state, True, lazy)
    if lazy:  # the draft caught up over x_P (the first token), the next one x_{P+1}
        P = len(PROMPT)
        assert (np.asarray(state.draft_seq_lens) == P).all() and (np.asarray(state.cache.seq_lens) == P + 1).all()
        piece = PrefillRows(tokens=out.tokens[:, None], start=jnp.full((ROWS,), P, jnp.int32),
                            lens=jnp.ones((ROWS,), jnp.int32), slots=slots, final=jnp.zeros((ROWS,), bool),
                            next_ids=jnp.asarray(t2[:, 0]))
        _, _, state, samp_all = progs.prefill(tw, dw, state, samp_all, piece, samp, None, want_logprobs=False,
                                              stochastic=True)
        assert (np.asarray(state.draft_seq_lens) == P + 1).all()
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


def test_lazy_then_fused_sampling_law(small):
    """An EAGLE-3 head's sampled chain (its proposals kept): tokens 1 - 3 from prefill, a lazy step
    (plain decoding's sampling), the catch-up and the fused step that verifies the stale chain follow
    the exact law; with the stale proposals swapped the same check rejects."""
    from test_spec_eagle import random_head
    from test_spec_sampling import _chi2_pvalue, _counts, _exact_law
    cfg, target, _ = small
    head, ecfg = random_head(cfg, "eagle3", seed=5, aux_layers=(0, 1, 2))
    law = _exact_law(cfg, target, 0.9, 0.9)
    first3, n, corrupted = _lite_then_fused(cfg, target, head, SpecConfig(method="eagle3", num_steps=2), 0.9, 0.9,
                                            info=DraftInfo("eagle3", ecfg.aux_layers), kv_cfg=ecfg.layer, lazy=True)
    pval, stat, dof = _chi2_pvalue(_counts(first3), law)
    assert pval > 1e-3, (pval, stat, dof)
    assert (n >= 2).mean() > 0.05  # stale drafts do get accepted: their proposals matter
    pval, _, _ = _chi2_pvalue(_counts(corrupted), law)
    assert pval < 1e-6


@pytest.mark.parametrize("kind", ["eagle3 tree", "self chain"])
def test_lite_dispatch_extends_the_draft_once(world, kind):
    """K lite steps in one dispatch (the target's side K times, then one draft extend over the K
    tokens: step_lite.lite_draft_sync) leave the state that K one-step lite dispatches leave: the same
    tokens, lengths, trees and draft lengths, the draft's KV equal up to float32 rounding; a row that
    finishes inside the dispatch (its length limit after 2 steps) is extended over its 2 tokens only,
    and a padding row changes nothing."""
    cfg, target, prompts = world
    d = _draft(cfg, target, kind)
    progs, tw, dw = prog.spec_programs(d.info, d.spec, *nnx.split(target), *nnx.split(d.model))
    slots_n = 2

    def fresh():
        return _two_rows(cfg, d, progs, tw, dw, prompts)[1:]

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
    _same_kv(once, each)


def _two_rows(cfg, d: Draft, progs, tw, dw, prompts, pps: int = 8):
    """Two slots prefilled with 11-token prompts, greedy -> (first tokens [2], state, samp_all)."""
    cache = init_cache(cfg, num_pages=1 + 2 * pps, page_size=4, max_slots=2, max_seq_len=4 * pps, dtype=jnp.float32)
    cache.page_table = jnp.asarray(1 + np.arange(2 * pps, dtype=np.int32).reshape(2, pps))
    dkv = init_cache(d.kv_cfg, num_pages=1 + 2 * pps, page_size=4, max_slots=2, max_seq_len=4 * pps,
                     dtype=jnp.float32).kv
    state = init_spec_state(cache, dkv, d.spec, cfg.vocab_size)
    P = [prompts[1][:11], prompts[2][:11]]
    rows = whole_prompts(jnp.asarray(np.array(P, np.int32)), jnp.array([11, 11], jnp.int32),
                         jnp.arange(2, dtype=jnp.int32))
    out, _, state, samp_all = progs.prefill(tw, dw, state, prog.init_samp(2), rows, _greedy(2), None,
                                            want_logprobs=False, stochastic=False)
    return np.asarray(out.tokens), state, samp_all


def _greedy(B: int) -> SamplingArrays:
    return SamplingArrays(jnp.zeros(B, jnp.float32), jnp.ones(B, jnp.float32), jnp.zeros(B, jnp.int32),
                          jnp.zeros(B, jnp.uint32))


def _same_kv(a, b):
    """The draft's and the target's K/V of each slot below its length equal up to float32 rounding."""
    pt = np.asarray(a.cache.page_table)

    def entries(kv, lens):  # each slot's entries below its length, through its page table
        return [np.asarray(layer)[pt[s, np.arange(n) // 4], np.arange(n) % 4] for layer in kv
                for s, n in enumerate(np.asarray(lens).tolist())]
    for x, y in zip(entries(a.draft_kv, a.draft_seq_lens), entries(b.draft_kv, b.draft_seq_lens)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    for x, y in zip(entries(a.cache.kv, a.cache.seq_lens), entries(b.cache.kv, b.cache.seq_lens)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_lazy_steps_then_catch_up_equal_lite(world):
    """K lazy steps (plain decoding's program on the speculative state: specjax.lazy_draft) give the
    tokens, counts and histograms of K synced lite steps and leave the draft at the prompt's length;
    the catch-up (a prefill piece that does not end the prompt: x_11 .. x_13 from 11, next token x_14)
    then leaves the state the lite steps leave: lengths, draft lengths, trees (stale nodes kept, the
    root the last token), the draft's and the target's K/V up to float32 rounding. A padding row
    changes nothing; a lazy dispatch for another draft is refused."""
    cfg, target, prompts = world
    d = _draft(cfg, target, "eagle3 tree")
    progs, tw, dw = prog.spec_programs(d.info, d.spec, *nnx.split(target), *nnx.split(d.model))
    slots, active = jnp.array([0, 1, 2], jnp.int32), jnp.array([True, True, False])
    stop = prog.no_stop(3)

    def run(lazy):
        first, state, samp_all = _two_rows(cfg, d, progs, tw, dw, prompts)
        o, _, state = progs.step(tw, dw, state, samp_all, slots, active, None, stop, num_steps=3, lite=True,
                                 lazy=lazy, want_logprobs=False, stochastic=False)
        return first, jax.tree.map(np.asarray, o), state, samp_all

    first, o_lite, lite, _ = run(False)
    first_z, o_lazy, lazy, samp_all = run(True)
    np.testing.assert_array_equal(first, first_z)
    for name in ("tokens", "num_accepted", "accept_hist"):
        np.testing.assert_array_equal(getattr(o_lazy, name), getattr(o_lite, name), name)
    assert np.asarray(lazy.draft_seq_lens).tolist() == [11, 11] and np.asarray(lazy.cache.seq_lens).tolist() == [14, 14]
    np.testing.assert_array_equal(np.asarray(lazy.tree_tokens), np.asarray(lite.tree_tokens))
    toks = o_lazy.tokens[:, :2, 0].T  # [2, 3]: x_12 .. x_14
    seq = np.concatenate([first[:, None], toks], axis=1)  # x_11 .. x_14
    rows = PrefillRows(tokens=jnp.asarray(seq[:, :3].astype(np.int32)), start=jnp.array([11, 11], jnp.int32),
                       lens=jnp.array([3, 3], jnp.int32), slots=jnp.array([0, 1], jnp.int32),
                       final=jnp.array([False, False]), next_ids=jnp.asarray(seq[:, 3].astype(np.int32)))
    _, _, caught, _ = progs.prefill(tw, dw, lazy, samp_all, rows, _greedy(2), None, want_logprobs=False,
                                    stochastic=False)
    for name in ("draft_seq_lens", "tree_tokens", "tree_parents", "tree_depth"):
        np.testing.assert_array_equal(np.asarray(getattr(caught, name)), np.asarray(getattr(lite, name)), name)
    np.testing.assert_array_equal(np.asarray(caught.cache.seq_lens), np.asarray(lite.cache.seq_lens))
    _same_kv(caught, lite)
    chain = _draft(cfg, target, "self chain")
    progs_c, tw_c, dw_c = prog.spec_programs(chain.info, chain.spec, *nnx.split(target), *nnx.split(chain.model))
    _, state_c, samp_c = _two_rows(cfg, chain, progs_c, tw_c, dw_c, prompts)
    with pytest.raises(AssertionError, match="lazy"):
        progs_c.step(tw_c, dw_c, state_c, samp_c, slots, active, None, stop, num_steps=3, lite=True, lazy=True,
                     want_logprobs=False, stochastic=False)


def test_lazy_drafts_under_preemption_and_arrivals():
    """An EAGLE-3 head with lazy steps for batches of >= 3 rows: 16 greedy requests arriving in two
    waves under a budget of 13 pages (the youngest preempted and recomputed, some while their drafts
    lag; prefix caching on) give each request's output alone (one row: fused steps only), every
    page and slot comes back (test_scheduler.run_arriving), and drafts were left behind and caught
    up (before each fused dispatch every active row's draft is in sync: _install_spy's check)."""
    from test_scheduler import MAX_SEQ as SEQ, check_preemption, make_models, preemption_items
    from test_spec_eagle import random_head
    cfg, target, _, _ = make_models()
    head, ecfg = random_head(cfg, "eagle3", seed=3, draft_vocab=80, aux_layers=(0, 1, 2))
    draft = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers),
                  SpecConfig(method="eagle3", num_steps=3, topk=2, num_draft_tokens=5))
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=SEQ),
                 BatchOptions(max_batch=8, steps_per_call=4, speculate_below=3), jnp.float32, draft=draft)
    spy = _Spy()
    _install_spy(eng, spy)
    check_preemption(eng, preemption_items(sampled=False))
    st = eng.stats()
    assert spy.lazy == st["lazy_dispatches"] and len(spy) - spy.lazy == st["spec_dispatches"]
    assert st["lazy_dispatches"] > 0 and st["spec_dispatches"] > 0 and st["catch_ups"] > 0, st
    assert not eng._lag or all(eng.sched.slots[s] is not r for s, (r, _, _) in eng._lag.items())


def test_lazy_steps_give_plain_logprobs(world):
    """Logprobs through lazy steps (the plain program's, widened to the fused layout) and synced lite
    steps equal plain decoding's: the same tokens, top ids, and logprobs to float32 rounding (greedy;
    two requests, so every dispatch of the speculative engines is a lazy / lite one)."""
    cfg, target, prompts = world
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3) for _ in range(2)]

    def run(draft, **opts):
        eng = _engine(world, draft, **opts)
        reqs = _run(eng, prompts[:2], params, below=1 if draft is not None else None, arrivals=(0, 0))
        return eng.stats(), [(r.token_ids, r.logprobs) for r in reqs]
    _, want = run(None)
    d = _draft(cfg, target, "eagle3 tree")
    for lazy in (True, False):
        st, got = run(d, lazy_draft=lazy)
        assert st["lazy_dispatches" if lazy else "lite_dispatches"] > 0 and st["spec_dispatches"] == 0
        for (t, lps), (t0, lps0) in zip(got, want):
            assert t == t0 and len(lps) == len(lps0) == 10
            for e, e0 in zip(lps, lps0):
                assert list(e) == list(e0)  # the token, then its top ids in order
                np.testing.assert_allclose(list(e.values()), list(e0.values()), rtol=1e-5, atol=1e-5)
