"""Tensor parallelism with speculation: the engine under a CPU mesh (TP 2, 4) gives the same
greedy tokens as on one device, for a draft model (chain and tree) and an EAGLE-3 head; the
state is really sharded; LLM(tensor_parallel=3) on the real SmolLM2 (9 heads, 3 KV heads)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import IdTokenizer, tiny_model
from test_sharding import config
from test_spec_eagle import random_head

from specjax import sharding
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 64
PROMPTS = [[int(t) for t in np.random.default_rng(3).integers(0, 127, size=n)] for n in (5, 17, 2)]


def _run(tp, method, topk, m, draft_topk="auto"):
    cfg = config("gqa")
    target = tiny_model(cfg, seed=0)
    spec = SpecConfig(method=method, num_steps=3, topk=topk, num_draft_tokens=m)
    if method == "draft":
        dcfg = config("gqa").__class__.from_hf_dict({**_draft_dict(), "num_hidden_layers": 1})
        draft = Draft(tiny_model(dcfg, seed=4), dcfg, DraftInfo("draft"), spec)
    else:
        head, ecfg = random_head(cfg, "eagle3", draft_vocab=64, aux_layers=(0, 1, 2), heads=4, kv_heads=2)
        draft = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers), spec)
    mesh = sharding.make_mesh(tp) if tp > 1 else None
    eng = Engine(target, cfg, CacheOptions(page_size=8, max_seq_len=MAX_SEQ), BatchOptions(max_batch=2),
                 jnp.float32, draft=draft, mesh=mesh, draft_topk=draft_topk)
    if mesh is not None:
        spec_pages = eng.state.cache.kv[0].sharding.spec
        assert spec_pages[3] == sharding.AXIS, spec_pages  # KV pages split by kv heads
    reqs = [Request(i, None, p, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), IdTokenizer(),
                    (127,), MAX_SEQ, 0) for i, p in enumerate(PROMPTS)]
    eng.run(reqs)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1
    return [(r.output().token_ids, r.output().accept_len_mean) for r in reqs]


def _draft_dict():
    from test_sharding import hf_dict
    return hf_dict("gqa")


@pytest.mark.parametrize("method,topk,m,tp,draft_topk", [("draft", 1, None, 2, "auto"), ("draft", 2, 5, 4, "auto"),
                                                         ("eagle3", 2, 5, 2, "auto"), ("draft", 2, 5, 4, "reduce"),
                                                         ("eagle3", 2, 5, 2, "reduce")])
def test_spec_under_tp_equals_single_device(method, topk, m, tp, draft_topk):
    """draft_topk "reduce" (the GPU default): its reduction over a vocabulary split across the mesh
    grows the same trees (the same tokens and acceptance) as lax.top_k on one device."""
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    assert _run(tp, method, topk, m, draft_topk) == _run(1, method, topk, m, "xla")


def test_llm_tensor_parallel_smollm2():
    if len(jax.devices()) < 3:
        pytest.skip("needs 3 devices")
    from specjax import LLM
    from specjax.default_model import ensure_default
    model = ensure_default()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    one = LLM(model, dtype="float32", max_batch=2, max_seq_len=64).generate(prompts, params)
    tp3 = LLM(model, dtype="float32", max_batch=2, max_seq_len=64, tensor_parallel=3)
    got = tp3.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in one]
    w = tp3.engine.weights[0]
    assert len(w.sharding.device_set) == 3


def test_eagle3_head_with_a_draft_vocabulary_tp_does_not_divide():
    """The shipped SmolLM2 head has 16384 draft tokens, which TP 3 does not divide: its vocabulary
    axis is replicated (the target's 49152 is split), instead of failing to shard."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    cfg = config("gqa")
    mesh = sharding.make_mesh(2)
    for vd, vocab_rule in ((64, sharding.AXIS), (63, None)):
        head, ecfg = random_head(cfg, "eagle3", draft_vocab=vd, aux_layers=(0, 1, 2), heads=4, kv_heads=2)
        rules = sharding.model_rules(head, ecfg.layer, 2)
        assert rules["vocab"] == vocab_rule and sharding.resolve_rules(ecfg.layer, 2)["vocab"] == sharding.AXIS
        sharding.shard_model(head, mesh, rules)
        assert head.lm_head[...].sharding.spec == jax.sharding.PartitionSpec(None, vocab_rule)
