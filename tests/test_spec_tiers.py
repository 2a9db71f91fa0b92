"""Tree shapes by the running batch (specjax.spec_tiers): an engine with tiers runs each dispatch with
the shape of its rows' tier; rows whose tree another tier grew get a new one first (a catch-up piece
with `regrow`). Greedy float32 outputs equal plain decoding's token for token while requests arrive
and finish and the tier changes both ways (EAGLE-3 trees of two sizes, with lazy steps too; a draft
model's sampled chain beside a tree: the chain proposals narrowed from the state's widest array);
every dispatch finds its rows' trees grown by its own tier; nothing leaks. Sampling: a tree grown by
one tier, regrown by another and verified there gives the exact law (chi-square; swapped proposals
rejected). The policy: bounds, hysteresis, a draft's spec_defaults -> tiers."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_model
from specjax import programs as prog
from specjax.decode import PrefillRows, whole_prompts
from specjax.drafter import DraftInfo
from specjax.engine import Draft
from specjax.kv_cache import init_cache
from specjax.sampling import SamplingArrays
from specjax.spec_tiers import SpecTiers, describe
from specjax.step import init_spec_state
from specjax.tree import SpecConfig
from test_adaptive_spec import _engine, _params, _run, plain, world  # noqa: F401 - fixtures

EAGLE_TIERS = SpecTiers.of([(1, SpecConfig(method="eagle3", num_steps=4, topk=2, num_draft_tokens=7)),
                            (2, SpecConfig(method="eagle3", num_steps=2, topk=2, num_draft_tokens=3))])
BRANCH_TIERS = SpecTiers.of([(1, SpecConfig(method="eagle3", num_steps=4, topk=2, num_draft_tokens=7, ngram_branch=2)),
                             (2, SpecConfig(method="eagle3", num_steps=2, topk=2, num_draft_tokens=3))])
MIXED_TIERS = SpecTiers.of([(1, SpecConfig(method="draft", num_steps=4)),  # a chain: sampled proposals kept
                            (2, SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=3))])


def _tiered_draft(cfg, target, kind) -> Draft:
    if kind.startswith("eagle3"):
        from test_spec_eagle import random_head
        head, ecfg = random_head(cfg, "eagle3", seed=3, draft_vocab=80, aux_layers=(0, 1, 2))
        tiers = BRANCH_TIERS if "branch" in kind else EAGLE_TIERS
        return Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers), tiers.specs[-1], tiers)
    other = tiny_model(cfg, seed=7)
    return Draft(other, cfg, DraftInfo("draft"), MIXED_TIERS.specs[-1], MIXED_TIERS)


def _watch_tiers(eng, seen):
    """Wrap every tier's step program: a dispatch that reads the draft asserts that each active row's
    tree was grown by the dispatch's tier; seen gets (tier, lazy) of every dispatch."""
    for t, steps in enumerate(eng._tier_steps):
        def spied(*a, _t=t, _step=steps.step, **kw):
            assert eng.tier == _t
            if not kw.get("lazy"):
                for s, on in zip(np.asarray(a[4]).tolist(), np.asarray(a[5]).tolist()):
                    if on and s < len(eng._tree_tier):
                        assert eng._tree_tier[s] == _t, (s, eng._tree_tier, _t)
            seen.append((_t, bool(kw.get("lazy"))))
            return _step(*a, **kw)
        eng._tier_steps[t] = steps._replace(step=spied)


@pytest.mark.parametrize("kind", ["eagle3", "eagle3, n-gram branch at 1 row", "draft chain + tree"])
def test_tiers_equal_plain(world, plain, kind):  # noqa: F811 - fixtures
    """The batch goes 1 -> 2 -> 1 -> 2 rows (test_adaptive_spec's arrivals): the tier follows, both
    ways, and the outputs are plain decoding's; with lazy steps at 2 rows (EAGLE-3) as well. With an
    n-gram branch in the 1-row tier only, the state keeps the token history for every tier (each
    appends to it), and large batches run lite steps, not lazy ones (those would not append)."""
    cfg, target, prompts = world
    params, want = plain
    eng = _engine(world, _tiered_draft(cfg, target, kind))
    assert eng.state.tree_tokens.shape[1] == max(s.num_nodes for s in eng.draft.tiers.specs)
    assert (eng.state.draft_probs is not None) == (kind == "draft chain + tree")
    assert (eng.state.history is not None) == ("branch" in kind)
    seen = []
    _watch_tiers(eng, seen)
    reqs = _run(eng, prompts, params)
    assert [(r.token_ids, r.finish_reason) for r in reqs] == want
    assert {t for t, _ in seen} == {0, 1} and eng.tier_switches >= 2 and eng.regrown >= 2
    assert any(a != b for (a, _), (b, _) in zip(seen, seen[1:]))
    if kind == "eagle3":  # lazy steps for 2 rows: lagging drafts and new trees in one catch-up
        seen.clear()
        switches = eng.tier_switches
        reqs = _run(eng, prompts, params, below=2)
        assert [(r.token_ids, r.finish_reason) for r in reqs] == want
        assert any(lazy for _, lazy in seen) and eng.tier_switches > switches
        st = eng.stats()
        assert st["catch_ups"] > 0 and st["lazy_dispatches"] > 0
    if "branch" in kind:  # lite steps at 2 rows (they append to the history), never lazy ones
        seen.clear()
        reqs = _run(eng, prompts, params, below=2)
        assert [(r.token_ids, r.finish_reason) for r in reqs] == want
        assert seen and not any(lazy for _, lazy in seen) and eng.stats()["lazy_dispatches"] == 0


def test_policy(tmp_path, caplog):
    """Bounds from 1 row, one method, hysteresis on the way down; a draft's spec_defaults give the
    tiers up to max_batch (none with fewer than two entries)."""
    from specjax.llm import default_tiers
    t = SpecTiers.of([(8, SpecConfig(method="eagle3", num_steps=5, topk=4, num_draft_tokens=16)),
                      (1, SpecConfig(method="eagle3", num_steps=7, topk=4, num_draft_tokens=28)),
                      (32, SpecConfig(method="eagle3", num_steps=4, topk=2, num_draft_tokens=8))])
    assert t.bounds == (1, 8, 32) and t.num_nodes == 29
    assert [t.pick(n, 0) for n in (1, 7, 8, 31, 32, 64)] == [0, 0, 1, 1, 2, 2]
    assert [t.pick(n, 1) for n in (7, 6, 5, 1)] == [1, 1, 0, 0]  # down once n < 3/4 of 8
    assert [t.pick(n, 2) for n in (31, 24, 23, 9, 5)] == [2, 2, 1, 1, 0]
    with pytest.raises(ValueError, match="start at 1 row"):
        SpecTiers.of([(2, SpecConfig(method="eagle3", num_steps=2))])
    b = SpecTiers.of([(1, SpecConfig(method="eagle3", num_steps=7, topk=4, num_draft_tokens=24, ngram_branch=7)),
                      (8, SpecConfig(method="eagle3", num_steps=5, topk=4, num_draft_tokens=16))])
    assert b.num_nodes == 32 and [s.ngram_branch for s in b.specs] == [7, 0]  # a branch in some tiers only
    assert describe(b) == ">= 1 rows 7/4/24+7, >= 8 rows 5/4/16"
    with pytest.raises(ValueError, match="share method"):
        SpecTiers.of([(1, SpecConfig(method="eagle3", num_steps=2)), (4, SpecConfig(method="draft", num_steps=2))])
    with pytest.raises(ValueError, match="repeated"):
        SpecTiers.of([(1, SpecConfig(method="draft", num_steps=2)), (1, SpecConfig(method="draft", num_steps=3))])
    (tmp_path / "specjax.json").write_text(json.dumps({"kind": "eagle3", "spec_defaults": {
        "1": {"num_steps": 7, "topk": 4, "num_draft_tokens": 28}, "8": {"num_steps": 5, "topk": 4, "num_draft_tokens": 16},
        "32": {"num_steps": 4, "topk": 2, "num_draft_tokens": 8}, "128": "plain"}}))
    got = default_tiers(tmp_path, "eagle3", 64)
    assert got.bounds == (1, 8, 32) and [s.num_nodes for s in got.specs] == [29, 17, 9]
    assert default_tiers(tmp_path, "eagle3", 16).bounds == (1, 8)
    with caplog.at_level("WARNING", logger="specjax"):
        assert default_tiers(tmp_path, "eagle3", 4) is None  # one entry: the engine's spec alone
    assert "give one tree shape up to max_batch 4" in caplog.text  # asked for tiers, got one shape: said
    from specjax import LLM
    with pytest.raises(ValueError, match="spec_tiers=True .* needs a draft and no explicit spec"):
        LLM("unused-dir", draft=None, spec_tiers=True)
    with pytest.raises(ValueError, match="no explicit spec"):
        LLM("unused-dir", draft="self", spec=SpecConfig(method="draft", num_steps=2), spec_tiers=True)


V = 6
ROWS = 3000


def _regrown_then_fused(cfg, target, draft, temperature, top_p, swap=False):
    """First three tokens of ROWS requests: prefill with tier 0 (a chain of 3: token 1), a regrow
    piece with tier 1 (a chain of 2: x_{P-1} from P - 1, next token x_P), then two tier-1 fused
    steps verifying the new chain. swap: tier 1's node 1 and node 2 proposals swapped after the
    regrow (not what they were drawn from)."""
    tiers = (SpecConfig(method="draft", num_steps=3), SpecConfig(method="draft", num_steps=2))
    N = max(s.num_nodes for s in tiers)
    (p0, tw, dw), (p1, _, _) = (prog.spec_programs(DraftInfo("draft"), s, *nnx.split(target), *nnx.split(draft),
                                                   num_nodes=N) for s in tiers)
    pps = 8
    cache = init_cache(cfg, num_pages=1 + ROWS * pps, page_size=4, max_slots=ROWS, max_seq_len=4 * pps,
                       dtype=jnp.float32)
    cache.page_table = jnp.asarray(1 + np.arange(ROWS * pps, dtype=np.int32).reshape(ROWS, pps))
    dkv = init_cache(cfg, num_pages=1 + ROWS * pps, page_size=4, max_slots=ROWS, max_seq_len=4 * pps,
                     dtype=jnp.float32).kv
    state = init_spec_state(cache, dkv, tiers[0], V, tiers=tiers)
    assert state.draft_probs.shape == (ROWS, N, V)
    samp = SamplingArrays(temperature=jnp.full((ROWS,), temperature, jnp.float32),
                          top_p=jnp.full((ROWS,), top_p, jnp.float32), top_k=jnp.zeros((ROWS,), jnp.int32),
                          seed=jnp.arange(ROWS, dtype=jnp.uint32) * 7919 + 13)
    from test_spec_sampling import PROMPT
    P = len(PROMPT)
    slots = jnp.arange(ROWS, dtype=jnp.int32)
    prompts = jnp.asarray(np.tile(np.array(PROMPT, np.int32), (ROWS, 1)))
    out, _, state, samp_all = p0.prefill(tw, dw, state, prog.init_samp(ROWS), whole_prompts(
        prompts, jnp.full((ROWS,), P, jnp.int32), slots), samp, None, want_logprobs=False, stochastic=True)
    before = np.asarray(state.tree_tokens[:, 3])
    piece = PrefillRows(tokens=prompts[:, -1:], start=jnp.full((ROWS,), P - 1, jnp.int32),
                        lens=jnp.ones((ROWS,), jnp.int32), slots=slots, final=jnp.zeros((ROWS,), bool),
                        next_ids=out.tokens, regrow=jnp.ones((ROWS,), bool))
    _, trees, state, samp_all = p1.prefill(tw, dw, state, samp_all, piece, samp, None, want_logprobs=False,
                                           stochastic=True)
    assert trees[0].shape == (ROWS, 3) and (np.asarray(trees[0][:, 0]) == np.asarray(out.tokens)).all()
    assert (np.asarray(state.draft_seq_lens) == P + 1).all() and (np.asarray(state.cache.seq_lens) == P).all()
    assert (np.asarray(state.tree_tokens[:, :3]) == np.asarray(trees[0])).all()
    assert (np.asarray(state.tree_tokens[:, 3]) == before).all()  # past tier 1's nodes: untouched
    if swap:
        q = state.draft_probs
        state = dataclasses.replace(state, draft_probs=q.at[:, 1].set(q[:, 2]).at[:, 2].set(q[:, 1]))
    active, stop = jnp.ones((ROWS,), bool), prog.no_stop(ROWS)
    streams, counts = [np.asarray(out.tokens)[:, None]], []
    for _ in range(2):
        o, _, state = p1.step(tw, dw, state, samp_all, slots, active, None, stop, num_steps=1,
                              want_logprobs=False, stochastic=True)
        streams.append(np.asarray(o.tokens)[0])
        counts.append(np.asarray(o.num_accepted)[0])
    n = counts[0]  # the step that verified the regrown chain
    first3 = np.stack([row[row >= 0][:3] for row in np.concatenate(streams, axis=1)])
    return first3, n


def test_regrown_tree_sampling_law():
    """A sampled chain grown by one tier, regrown by another (its proposals narrowed from the state's
    wider array) and verified there: tokens 1 - 3 follow the exact law; with the regrown proposals
    swapped the same check rejects."""
    from test_spec_sampling import _cfg, _chi2_pvalue, _counts, _exact_law
    cfg = _cfg()
    assert cfg.vocab_size == V
    target, other = tiny_model(cfg, seed=0, std=0.25), tiny_model(cfg, seed=11, std=0.25)
    law = _exact_law(cfg, target, 0.9, 0.9)
    first3, n = _regrown_then_fused(cfg, target, other, 0.9, 0.9)
    pval, stat, dof = _chi2_pvalue(_counts(first3), law)
    assert pval > 1e-3, (pval, stat, dof)
    assert (n >= 2).mean() > 0.05  # the regrown drafts do get accepted: their proposals matter
    bad, _ = _regrown_then_fused(cfg, target, other, 0.9, 0.9, swap=True)
    pval, _, _ = _chi2_pvalue(_counts(bad), law)
    assert pval < 1e-6


def test_shipped_head_tiers_equal_plain():
    """The default model with the shipped head in an engine of 8 slots, LLM(spec_tiers=True) (off by
    default): tiers 7/4/24 with an n-gram branch of 7 (from 1 row) and 5/4/16 (from 8) by its
    spec_defaults; 10 requests of different lengths fill the 8 slots, refill them and drain to one:
    the tier changes and rows get new trees, the outputs are plain decoding's (greedy, float32)."""
    from specjax import LLM, SamplingParams
    from specjax.assets import DEFAULT_HEAD_DIR
    prompts = [f"Write one sentence about {s}." for s in ("owls", "rain", "jazz", "salt", "a clock", "bees",
                                                          "paper", "Mars", "honey", "chess")]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(dtype="float32", max_batch=8, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    assert LLM(dtype="float32", max_batch=8, max_seq_len=256, draft=DEFAULT_HEAD_DIR).spec_tiers is None  # opt-in
    llm = LLM(dtype="float32", max_batch=8, max_seq_len=256, draft=DEFAULT_HEAD_DIR, spec_tiers=True)
    assert llm.spec_tiers is not None and llm.spec_tiers.bounds == (1, 8)
    assert [(s.num_steps, s.topk, s.num_draft_tokens, s.ngram_branch) for s in llm.spec_tiers.specs] == [
        (7, 4, 24, 7), (5, 4, 16, 0)]
    assert llm.engine.state.history is not None
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    st = llm.stats()
    assert st["tier_switches"] >= 1 and st["regrown_trees"] >= 1 and st["spec_tier"] == 0, st
    assert st["running"] == 0
    assert llm.engine.alloc.num_free == llm.engine.alloc.num_pages - 1  # every page back (cached prefixes count)
