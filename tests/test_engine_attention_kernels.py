"""The engine's outputs do not change when the paged-attention kernel replaces the jnp reference:
greedy float32 on a tiny model, plain decoding and speculative decoding (a draft tree: tree verify,
draft growth with scratch masks, compaction), the generic Pallas kernel forced on in the Pallas
interpreter (CPU), ragged prompts and several rows, page sizes 1 (plain) and 4 (speculative), and across the
attention split cap's switch (fused programs with and without it). On a GPU the same check of the Mosaic kernel
on the default model is test_kernel_on_gpu_default_model (skipped elsewhere)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Held, IdTokenizer, tiny_config, tiny_model

from specjax import attention
from specjax.attention import AttnImpl
from specjax.drafter import DraftInfo
from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.tree import SpecConfig

MAX_SEQ = 40
KERNEL = AttnImpl("pallas", interpret=True, block_kv=8)


def _run(cfg, model, prompts, attention, draft=None, page_size=4, split_caps=None):
    eng = Engine(model, cfg, CacheOptions(page_size=page_size, max_seq_len=MAX_SEQ),
                 BatchOptions(max_batch=3, steps_per_call=1, spec_steps_per_call=1), jnp.float32, draft=draft,
                 attention=attention)
    if split_caps is not None:  # record each dispatch's attention split cap; background compiles held
        eng.background = Held()  # until two dispatches have run
        choose = eng._split_flags

        def chosen(*a, **kw):
            flags = choose(*a, **kw)
            split_caps.append(flags.get("max_splits", "no cap"))
            if len(split_caps) == 2:
                eng.background.gate.set()
                eng.background.wait()
            return flags
        eng._split_flags = chosen
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [Request(i, None, p, params, IdTokenizer(), (96,), MAX_SEQ, 100 + i) for i, p in enumerate(prompts)]
    eng.run(reqs)
    assert eng.alloc.num_free == int(eng.state.cache.kv[0].shape[0]) - 1  # no page leaked
    return [r.output().token_ids for r in reqs], eng.attention_choice


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 96, size=n)] for n in (9, 3, 14)]
    model = tiny_model(cfg, seed=2)
    want, kernels = _run(cfg, model, prompts, "reference")  # plain greedy with the jnp reference
    assert kernels == {"attention": "attention: reference (forced)"}
    return cfg, model, prompts, want


def test_plain_greedy_unchanged_with_kernel(setup):
    cfg, model, prompts, want = setup
    got, kernels = _run(cfg, model, prompts, KERNEL, page_size=1)
    assert kernels == {"attention": "attention: pallas (forced)"}
    assert got == want


def test_spec_tree_greedy_unchanged_with_kernel(setup, monkeypatch):
    """Also across the attention split cap (attention.split_cap): rows start below SHORT_CONTEXT keys
    (at most 2 splits here) and grow past it (the kernel's own count). The uncapped program is asked
    of the worker thread when rows near SHORT_CONTEXT; while it is not ready (held here) the capped
    one keeps running past SHORT_CONTEXT; then the uncapped one runs. The outputs do not change."""
    cfg, model, prompts, want = setup
    monkeypatch.setattr(attention, "SHORT_CONTEXT", 23)  # the first step's rows (14 + 3 + lookahead 6)
    monkeypatch.setattr(attention, "SHORT_SPLITS", 2)
    spec = SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=4)  # growth step 2 masks scratch
    draft = Draft(model, cfg, DraftInfo("draft"), spec)  # the target drafts for itself: trees get accepted
    caps = []
    got, kernels = _run(cfg, model, prompts, KERNEL, draft=draft, split_caps=caps)
    assert kernels == {"attention": "attention: pallas (forced)"}
    assert got == want
    assert caps == [2, 2, None], caps  # short rows; past SHORT_CONTEXT, the uncapped one held; ready


def test_split_cap_by_context_and_rows():
    assert attention.split_cap(attention.SHORT_CONTEXT, 1) == attention.SHORT_SPLITS
    assert attention.split_cap(attention.SHORT_CONTEXT + 1, 1) is None  # long rows: the kernel's own count
    assert attention.split_cap(100, attention.SHORT_ROWS + 1) is None  # many rows: few splits already


def test_kernel_on_gpu_default_model():
    """On a GPU: the default model in float32 with the auto kernel (Triton for f32) equals the
    reference, plain and speculative (draft = self, a tree)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (the CPU check is the interpreted kernel above)")
    from specjax import LLM
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = SpecConfig(method="draft", num_steps=3, topk=2, num_draft_tokens=6)
    outs = {}
    for attn in ("reference", "auto"):
        for draft in (None, "self"):
            llm = LLM(dtype="float32", attention=attn, draft=draft, spec=spec if draft else None)
            if attn == "auto":
                assert "reference" not in llm.engine.attention_choice["attention"].split("(")[0], llm.engine.attention_choice
            outs[attn, draft] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["auto", None] == outs["reference", None] == outs["auto", "self"] == outs["reference", "self"]


def test_split_flags_choice(monkeypatch):
    """Engine._split_flags on its own (no program runs): the wanted cap by the rows' length bound, the
    uncapped sibling asked of the worker once rows near SHORT_CONTEXT, the compiled variant while the
    wanted one is not, no cap for grammar batches or many rows."""
    from specjax.dispatch_plan import DispatchPlan
    cfg = tiny_config()
    model = tiny_model(cfg, seed=2)
    draft = Draft(model, cfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=2, topk=2, num_draft_tokens=4))
    eng = Engine(model, cfg, CacheOptions(page_size=4, max_seq_len=MAX_SEQ), BatchOptions(max_batch=8), jnp.float32,
                 draft=draft, attention="reference")
    assert not eng.split_caps  # the reference splits nothing: one program per shape, as before
    eng.split_caps = True
    asked = []
    monkeypatch.setattr(eng, "_compile_later", lambda kind, K, rows, flags: asked.append(flags["max_splits"]))
    monkeypatch.setattr(attention, "SHORT_CONTEXT", 20)
    flags = {"want_logprobs": False}
    p = DispatchPlan("spec", 1, 3, 1)
    rows = [(0, None)]
    eng.sched.lens[0] = 0  # bound 0 + 3 + lookahead 6 = 9 keys: short, the uncapped sibling not asked yet
    assert eng._split_flags(p, rows, flags, (1,))["max_splits"] == attention.SHORT_SPLITS and asked == []
    eng.sched.lens[0] = 5  # 14 keys: past half of SHORT_CONTEXT, the uncapped one is asked ahead
    assert eng._split_flags(p, rows, flags, (1,))["max_splits"] == attention.SHORT_SPLITS and asked == [None]
    eng.shapes.add(eng._decode_key("spec", 1, dict(flags, max_splits=attention.SHORT_SPLITS)), (1,))
    eng.sched.lens[0] = 30  # long: the uncapped program is wanted but not compiled yet
    assert eng._split_flags(p, rows, flags, (1,))["max_splits"] == attention.SHORT_SPLITS and asked == [None, None]
    eng.shapes.add(eng._decode_key("spec", 1, dict(flags, max_splits=None)), (1,))
    assert eng._split_flags(p, rows, flags, (1,))["max_splits"] is None and len(asked) == 2
    eng.sched.lens[0] = 5
    assert eng._split_flags(p, rows, flags, (1,), grammar=True)["max_splits"] is None
    assert eng._split_flags(p, rows, flags, (attention.SHORT_ROWS * 2,))["max_splits"] is None
    assert eng._split_flags(p._replace(kind="decode"), rows, flags, (1,)) == flags
