"""Real SmolLM2-135M-Instruct (f32): greedy speculative output equals greedy plain output token
for token over 30 prompts, with a random EAGLE-3 head and with a small random draft model, at
batch 1 and 8, chain and tree, page sizes 1 and 16 (each dimension covered by one of two runs)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx
from test_spec_eagle import random_head

from specjax.checkpoint import load_model, load_tokenizer
from specjax.config import ModelConfig
from specjax.default_model import ensure_default
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.models.llama import Llama
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 128
TOKENS = 6
SUBJECTS = ["the ocean", "a violin", "Mars", "bread", "a library", "winter", "a bicycle", "volcanoes", "honey",
            "chess", "the moon", "a lighthouse", "rain", "coffee", "owls", "a bridge", "glaciers", "jazz",
            "tomatoes", "a compass", "thunder", "paper", "whales", "a clock", "deserts", "silk", "bees",
            "mountains", "a telescope", "salt"]
PROMPTS = [f"Write one sentence about {s}." if i % 2 else f"Q: What is {s}?\nA:" for i, s in enumerate(SUBJECTS)]


@pytest.fixture(scope="module")
def smol():
    model_dir = ensure_default()
    cfg, module = load_model(model_dir, "float32")
    tok = load_tokenizer(model_dir)
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    return cfg, module, tok, ids


def _run(smol, draft=None, page_size=16, max_batch=8):
    cfg, module, tok, ids = smol
    eng = Engine(module, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=max_batch), jnp.float32, draft=draft)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    reqs = [Request(i, None, p, params, tok, (), MAX_SEQ, 0) for i, p in enumerate(ids)]
    eng.run(reqs)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1
    return [r.output() for r in reqs]


@pytest.fixture(scope="module")
def plain(smol):
    return [o.token_ids for o in _run(smol)]


def _small_draft(cfg: ModelConfig):
    dcfg = ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size,
                                         hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                         tie_word_embeddings=True))
    return dcfg, Llama(dcfg, jnp.float32, nnx.Rngs(5))


@pytest.mark.parametrize("kind,topk,m,page_size,batch", [("eagle3", 3, 8, 1, 8), ("draft", 1, None, 16, 1)])
def test_smollm2_spec_equals_plain(smol, plain, kind, topk, m, page_size, batch):
    cfg = smol[0]
    spec = SpecConfig(method=kind, num_steps=3, topk=topk, num_draft_tokens=m)
    if kind == "eagle3":
        head, ecfg = random_head(cfg, "eagle3", draft_vocab=4096, aux_layers=(2, 15, 27), heads=4, kv_heads=2)
        draft = Draft(head, ecfg.layer, DraftInfo("eagle3", ecfg.aux_layers), spec)
    else:
        dcfg, dmodel = _small_draft(cfg)
        draft = Draft(dmodel, dcfg, DraftInfo("draft"), spec)
    outs = _run(smol, draft, page_size, batch)
    assert [o.token_ids for o in outs] == plain
    assert all(1.0 <= o.accept_len_mean <= 4.0 for o in outs)


END_TEXT = ("Q: What is the ocean? A: The ocean is a large body of salt water that covers most of the Earth. "
            "It is home to many animals and plants, and it shapes the weather and climate of the whole planet.")


def test_smollm2_tree_to_the_end_of_the_context(smol):
    """A tree (the target drafting for itself: long accepted paths) decoding up to the last token of a
    48-token context, where its last nodes are written past max_seq_len, equals plain decoding."""
    cfg, module, tok, _ = smol
    ids = tok.encode(END_TEXT, add_special_tokens=False)
    prompts = [ids[:38], ids[:40]]
    spec = SpecConfig(method="draft", num_steps=3, topk=4, num_draft_tokens=12)
    outs = []
    for draft in (None, Draft(module, cfg, DraftInfo("draft"), spec)):
        eng = Engine(module, cfg, CacheOptions(page_size=16, max_seq_len=48),
                     BatchOptions(max_batch=1, steps_per_call=1), jnp.float32, draft=draft)
        reqs = [Request(i, None, p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), tok, (), 48, 0)
                for i, p in enumerate(prompts)]
        eng.run(reqs)
        assert all(len(r.prompt_ids) + len(r.token_ids) == 48 for r in reqs)
        outs.append(reqs)
    assert [r.token_ids for r in outs[1]] == [r.token_ids for r in outs[0]]
    assert all(max(r.accept_lens) == 4 for r in outs[1])  # whole paths of the tree accepted
