"""Penalties survive preemption: a preempted request is prefilled again with its prompt and the
tokens it had generated, which must count as output again (not prompt), so frequency, presence and
repetition penalties give the same tokens as without preemption; plain and speculative decoding."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IdTokenizer, tiny_config, tiny_model
from test_scheduler import page_budget

from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 64
PAGE = 4
PENALTIES = {"frequency": dict(frequency_penalty=1.0), "presence": dict(presence_penalty=1.5),
             "repetition": dict(repetition_penalty=1.8)}


@pytest.fixture(scope="module")
def engines():
    cfg, dcfg = tiny_config(), tiny_config(num_hidden_layers=1)
    target = tiny_model(cfg, seed=0)
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=5)
    draft = Draft(tiny_model(dcfg, seed=5), dcfg, DraftInfo("draft"), spec)

    def make(d):
        return Engine(target, cfg, CacheOptions(page_size=PAGE, max_seq_len=MAX_SEQ),
                      BatchOptions(max_batch=2, steps_per_call=1), jnp.float32, draft=d)
    return {"plain": make(None), "spec": make(draft)}


def _run(eng, params, budget=None):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (12, 14, 13)]
    reqs = [Request(i, None, p, params, IdTokenizer(), (96,), MAX_SEQ, 7) for i, p in enumerate(prompts)]
    if budget is None:
        eng.run(reqs)
    else:
        with page_budget(eng, budget):
            eng.run(reqs)
    assert all(r.finish_reason == "length" for r in reqs)
    return [r.token_ids for r in reqs], sum(r.num_preempted for r in reqs)


@pytest.mark.parametrize("kind", PENALTIES)
@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_preemption_keeps_the_penalty_state(engines, mode, kind):
    eng = engines[mode]
    params = SamplingParams(max_tokens=36, temperature=0, ignore_eos=True, **PENALTIES[kind])
    want, n = _run(eng, params)
    assert n == 0
    got, n = _run(eng, params, budget=16)  # two requests of up to 50 tokens + lookahead cannot share 16 pages
    assert n >= 1
    assert got == want
    free, _ = _run(eng, SamplingParams(max_tokens=36, temperature=0, ignore_eos=True))
    assert free != want  # the penalty changes the output: the check above is not vacuous


def test_set_slots_counts_the_tokens_after_the_prompt():
    """The prefill of prompt + generated tokens: prompt set from the prompt, counts from the rest."""
    from specjax import penalties as P
    st = P.init_penalty_state(3, 8)
    toks = jnp.asarray([[1, 2, 5, 5, 3, 0], [4, 4, 6, 0, 0, 0]], jnp.int32)
    lens = jnp.asarray([5, 3], jnp.int32)
    prm = P.penalty_params([SamplingParams(frequency_penalty=1.0)] * 2, prompt_lens=[2, 3])
    st = P.set_slots(st, jnp.asarray([2, 0], jnp.int32), toks, lens, prm)
    np.testing.assert_array_equal(np.asarray(st.prompt_mask[2]), np.isin(np.arange(8), [1, 2]))
    np.testing.assert_array_equal(np.asarray(st.out_counts[2]), np.bincount([5, 5, 3], minlength=8))
    np.testing.assert_array_equal(np.asarray(st.prompt_mask[0]), np.isin(np.arange(8), [4, 6]))
    assert not np.asarray(st.out_counts[0]).any()  # a fresh request (prompt_len == len): no output yet
