"""EAGLE-1 / EAGLE-3 heads (random weights) in the fused step through the engine: greedy output
equals plain greedy decoding for chains and trees; speculative sampling with an EAGLE-3 head
and its reduced draft vocabulary stays within the target's support."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import IdTokenizer, tiny_config, tiny_model

from specjax.config import ModelConfig
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.models.eagle import EagleConfig, EagleHead
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 64
LENS = (1, 9, 23, 4, 15)


def random_head(cfg: ModelConfig, method: str, seed: int = 3, draft_vocab: int | None = None,
                aux_layers=(1, 2, 3), heads=2, kv_heads=1) -> tuple[EagleHead, EagleConfig]:
    """A random EAGLE head for target cfg; EAGLE-3 with a random reduced vocabulary."""
    layer = ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=48, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
        rope_theta=10000.0))
    vd = draft_vocab or cfg.vocab_size
    ecfg = EagleConfig(method=method, layer=layer, target_vocab_size=cfg.vocab_size,
                       draft_vocab_size=vd if method == "eagle3" else cfg.vocab_size,
                       aux_layers=tuple(aux_layers) if method == "eagle3" else (), fc_bias=method == "eagle")
    head = EagleHead(ecfg, jnp.float32, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, p in nnx.iter_graph(head):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = p[...] * 10.0  # sharper than the init default
    if method == "eagle3":
        ids = np.sort(rng.choice(cfg.vocab_size, size=vd, replace=False)).astype(np.int32)
        head.d2t[...] = jnp.asarray(ids - np.arange(vd, dtype=np.int32))  # offsets: target = d + d2t[d]
    return head, ecfg


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(num_hidden_layers=4)
    target = tiny_model(cfg, seed=0)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in LENS]
    return cfg, target, prompts


def _run(cfg, target, prompts, params, draft=None, page_size=4, max_batch=3):
    eng = Engine(target, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ), BatchOptions(max_batch=max_batch),
                 jnp.float32, draft=draft)
    reqs = [Request(i, None, p, params, IdTokenizer(), (96,), MAX_SEQ, 100 + i) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert all(s is None for s in eng.slots)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
    return [r.output() for r in reqs]


@pytest.fixture(scope="module")
def plain(setup):
    cfg, target, prompts = setup
    return _run(cfg, target, prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("method,topk,steps,m,page_size,batch", [
    ("eagle", 1, 3, None, 4, 3), ("eagle", 3, 3, 7, 1, 1), ("eagle3", 1, 4, None, 16, 1),
    ("eagle3", 2, 3, 6, 4, 3)])
def test_eagle_greedy_equals_plain(setup, plain, method, topk, steps, m, page_size, batch):
    cfg, target, prompts = setup
    head, ecfg = random_head(cfg, method, draft_vocab=60)
    spec = SpecConfig(method=method, num_steps=steps, topk=topk, num_draft_tokens=m)
    draft = Draft(head, ecfg.layer, DraftInfo(method, ecfg.aux_layers), spec)
    outs = _run(cfg, target, prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), draft,
                page_size, batch)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(1 <= o.accept_len_mean <= steps + 1 for o in outs)


def test_eagle3_sampling_runs_in_support(setup):
    """Sampling rows with an EAGLE-3 chain (proposals scattered from the draft vocabulary)."""
    cfg, target, prompts = setup
    head, ecfg = random_head(cfg, "eagle3", draft_vocab=40)
    spec = SpecConfig(method="eagle3", num_steps=3, topk=1)
    draft = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers), spec)
    outs = _run(cfg, target, prompts, SamplingParams(max_tokens=12, temperature=0.8, top_k=5, ignore_eos=True),
                draft)
    assert all(len(o.token_ids) == 12 and all(0 <= t < cfg.vocab_size for t in o.token_ids) for o in outs)
