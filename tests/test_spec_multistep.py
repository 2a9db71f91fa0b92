"""Several fused speculative steps per dispatch (BatchOptions.spec_steps_per_call): the same outputs
as one step per dispatch (greedy, sampled, penalties, stops inside a dispatch), and a row that
finishes inside a dispatch stops changing the device state."""
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
EOS = 7


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0)
    dcfg = tiny_config(num_hidden_layers=1)
    draft = Draft(tiny_model(dcfg, seed=5), dcfg, DraftInfo("draft"),
                  SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=6))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (5, 23, 11, 2)]
    return cfg, target, draft, prompts


def _run(setup, K, params, spy=None, released=None):
    cfg, target, draft, prompts = setup
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=3, spec_steps_per_call=K), jnp.float32, draft=draft,
                 sched=SchedulerOptions(async_loop=released is None))
    if released is not None:  # (request, its slot's device length) at release
        release = eng.sched.release

        def spy_release(slot):
            released.append((eng.sched.slots[slot], int(np.asarray(eng.state.cache.seq_lens)[slot])))
            release(slot)
        eng.sched.release = spy_release
    if spy is not None:
        step = eng.spec_steps.step

        def counted(*a, **kw):
            spy.append(kw["num_steps"])
            return step(*a, **kw)
        eng.spec_steps = eng.spec_steps._replace(step=counted)
    reqs = [Request(i, None, p, params[i] if isinstance(params, list) else params, IdTokenizer(), (EOS,),
                    MAX_SEQ, 11 + i) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert all(s is None for s in eng.slots)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
    return eng, reqs


def _outs(reqs):
    return [(r.token_ids, r.finish_reason) for r in reqs]


def test_k_steps_equal_one_step(setup):
    """Greedy, sampled and penalised rows, stops at different steps of a dispatch (a stop id the
    greedy run emits, max_tokens): 8 steps per dispatch give the outputs (and the accepted lengths
    of each step) of one step per dispatch; at release each slot's device length is exactly prompt +
    the tokens its steps accepted (no step ran for it after it finished; the synchronous loop has
    nothing in flight at release)."""
    _, ref = _run(setup, 1, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[ref[0].token_ids[5]]),
              SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=3),
              SamplingParams(max_tokens=13, temperature=0, frequency_penalty=0.7, presence_penalty=0.3,
                             ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)]
    _, one = _run(setup, 1, params)
    seen, released = [], []
    _, many = _run(setup, 8, params, seen, released)
    assert _outs(many) == _outs(one)
    assert [r.accept_lens for r in many] == [r.accept_lens for r in one]  # the same steps, regrouped
    assert max(seen) > 1  # dispatches did run several steps
    assert [r.finish_reason for r in many][::3] == ["stop", "length"]
    assert sorted(id(r) for r, _ in released) == sorted(id(r) for r in many)
    for r, length in released:
        assert length == len(r.prompt_ids) + sum(r.accept_lens), (r.id, length, r.accept_lens)


def test_stacked_step_outputs_rebuild_counts_and_histogram():
    """A multi-step program stacks only the tokens (and the slot each row ran) per step; num_accepted
    and accept_hist rebuilt after the loop equal the step's own: tokens >= 0 counted, active rows
    (num_accepted >= 1) histogrammed as SpecStep's `zeros.at[n].add(active)`."""
    import jax

    from specjax import programs
    from specjax.step import SpecOut
    rng = np.random.default_rng(4)
    K, B, W = 5, 3, 6  # steps, rows, tokens per step (num_steps + 1)
    steps = []
    for _ in range(K):
        n = rng.integers(0, W + 1, size=B).astype(np.int32)  # 0: an inactive row
        toks = np.where(np.arange(W)[None, :] < n[:, None], rng.integers(0, 50, size=(B, W)), -1).astype(np.int32)
        hist = np.zeros(W + 1, np.int32)
        np.add.at(hist, n, (n > 0).astype(np.int32))
        steps.append(SpecOut(tokens=jnp.asarray(toks), num_accepted=jnp.asarray(n), accept_hist=jnp.asarray(hist),
                             slot=jnp.asarray(rng.integers(0, 8, size=B).astype(np.int32))))
    for slot in (True, False):
        outs = [s if slot else SpecOut(s.tokens, s.num_accepted, s.accept_hist) for s in steps]
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *[programs._stacked(o) for o in outs])
        assert stacked.num_accepted is None and stacked.accept_hist is None and stacked.slot is None
        got = programs._unstacked(stacked, slot=slot)
        for name in ("tokens", "num_accepted", "accept_hist") + (("slot",) if slot else ()):
            want = np.stack([np.asarray(getattr(o, name)) for o in outs])
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), want, err_msg=name)
        assert got.slot is None if not slot else got.slot.shape == (K, B)
