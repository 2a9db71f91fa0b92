"""Speculative decoding up to the last token of the context equals plain decoding (float32, greedy).

A step writes tree node i at cache index L + i while it sits at position L + depth[i] (and the
draft writes scratch entries past L too), so near the end of the context a step writes past
max_seq_len. Every request here runs until prompt + output = max_seq_len; the prompt lengths vary so
that the last trees of the requests reach past max_seq_len by different amounts (checked: every
request's last tree crosses it, and one reaches with every node i >= 2 past it, the most possible).
Draft models (the target itself: long accepted paths) and EAGLE-1 / EAGLE-3 heads, chains and trees,
page sizes 1 and 16. A small vocabulary makes random heads' drafts get accepted often.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IdTokenizer, tiny_config, tiny_model
from test_spec_eagle import random_head

from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 32  # a multiple of 16: without room past it, pages 1 and 16 both end the slot there
V = 12
LENS = tuple(range(17, MAX_SEQ - 1)) * 3  # > 16: one prefill shape
GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(vocab_size=V, eos_token_id=V - 1)
    target = tiny_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, V, size=n)] for n in LENS]
    return cfg, target, prompts


def _run(cfg, target, prompts, draft=None, page_size=16):
    eng = Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=1, steps_per_call=1), jnp.float32, draft=draft)
    reqs = [Request(i, None, p, GREEDY, IdTokenizer(), (V - 1,), MAX_SEQ, 0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert all(s is None for s in eng.slots)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
    assert all(len(r.prompt_ids) + len(r.token_ids) == MAX_SEQ for r in reqs)  # to the end of the context
    return eng, reqs


@pytest.fixture(scope="module")
def plain(setup):  # the page size changes no output of plain decoding (tests/test_engine.py)
    cfg, target, prompts = setup
    return [r.token_ids for r in _run(cfg, target, prompts)[1]]


CASES = [  # (draft, page size, num_steps, topk, num_draft_tokens)
    ("self", 1, 3, 4, 12),  # the tree of the reproducer, a draft model
    ("eagle3", 16, 3, 4, 12),  # a tree
    ("eagle", 16, 4, 1, None),  # a chain
]


@pytest.mark.parametrize("kind,page_size,steps,topk,m", CASES)
def test_spec_equals_plain_to_the_end_of_the_context(setup, plain, kind, page_size, steps, topk, m):
    cfg, target, prompts = setup
    spec = SpecConfig(method="draft" if kind == "self" else kind, num_steps=steps, topk=topk, num_draft_tokens=m)
    if kind == "self":
        draft = Draft(target, cfg, DraftInfo("draft"), spec)
    else:
        head, ecfg = random_head(cfg, kind, draft_vocab=V - 3, aux_layers=(0, 1, 2))
        draft = Draft(head, ecfg.layer, DraftInfo(kind, ecfg.aux_layers), spec)
    eng, reqs = _run(cfg, target, prompts, draft, page_size)
    assert [r.token_ids for r in reqs] == plain
    assert eng.sched.capacity >= MAX_SEQ + eng.lookahead  # a slot addresses what a step writes
    # the last step of each request wrote past max_seq_len (a tree: its last nodes)
    last_L = [len(r.prompt_ids) + sum(r.accept_lens[:-1]) for r in reqs]
    reach = eng.lookahead if spec.is_chain else spec.num_nodes
    assert all(L + reach > MAX_SEQ for L in last_L), last_L
    assert min(MAX_SEQ - L for L in last_L) == 2  # there, every node i >= 2 is past max_seq_len
    assert max(max(r.accept_lens) for r in reqs) > 1  # drafts are accepted
