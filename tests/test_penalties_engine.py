"""Penalties through the engine: with repetition / frequency / presence penalties, speculative
output (draft model, tree) equals plain output; penalised and free requests share a batch."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from helpers import IdTokenizer, tiny_config, tiny_model

from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 64


def _run(cfg, target, draft, params):
    eng = Engine(target, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=2),
                 jnp.float32, draft=draft)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 96, size=5 + 3 * i)] for i in range(3)]
    reqs = [Request(i, None, p, params[i], IdTokenizer(), (96,), MAX_SEQ, 0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    return [r.output().token_ids for r in reqs]


def test_engine_penalties_spec_equals_plain():
    cfg = tiny_config()
    target = tiny_model(cfg, seed=0)
    dcfg = tiny_config(num_hidden_layers=1)
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=5)
    draft = Draft(tiny_model(dcfg, seed=2), dcfg, DraftInfo("draft"), spec)
    pen = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.8,
                         frequency_penalty=0.9, presence_penalty=0.5)
    free = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    params = [pen, free, pen]
    plain = _run(cfg, target, None, params)
    assert plain == _run(cfg, target, draft, params)
    # the penalties change the output (the check above is not vacuous)
    assert plain[0] != _run(cfg, target, None, [free, free, free])[0]
