"""The converted SmolLM2-135M-Instruct GGUF against HF transformers loading the same GGUF (f32)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from helpers import one_torch_thread  # noqa: E402
from specjax import LLM, SamplingParams  # noqa: E402
from specjax.default_model import CACHE_DIR, GGUF_NAME, default_gguf_path, ensure_default  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "def fibonacci(n):",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def hf():
    """The reference, run on one torch thread (helpers.one_torch_thread: with the other core busy,
    this module took 235 s on two threads, 90 s on one)."""
    default_gguf_path()
    with one_torch_thread():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(CACHE_DIR), gguf_file=GGUF_NAME,
                                                                  dtype=torch.float32)
        model.eval()
        yield model


@pytest.fixture(scope="module")
def llm():
    # the six prompts in one batch; prompt (35-39 tokens) + 32 new ones cross page boundaries (48, 64)
    return LLM(ensure_default(), dtype="float32", max_batch=8, max_seq_len=128, page_size=16)


def _chat_ids(llm, text):
    return llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)


def test_logits_match_hf(llm, hf):
    import jax.numpy as jnp

    from specjax.checkpoint import load_model
    from specjax.kv_cache import init_cache, step_meta

    ids = _chat_ids(llm, PROMPTS[0])
    T = len(ids)
    cfg, model = load_model(ensure_default(), "float32")
    cache = init_cache(cfg, num_pages=T // 4 + 3, page_size=4, max_slots=1, max_seq_len=T + 4, dtype=jnp.float32)
    cache.page_table = cache.page_table.at[0].set(jnp.arange(1, cache.pages_per_slot + 1))
    meta = step_meta(cache, jnp.array([0]), jnp.array([T]), T)
    h, _, _ = model(jnp.array([ids]), jnp.arange(T)[None], cache, meta)
    ours = np.asarray(model.logits(h))[0]  # [T, V]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(ref).max()
    np.testing.assert_allclose(ours, ref, atol=2e-4 * scale, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def _hf_greedy(hf, ids, n):
    """Greedy continuation with HF's KV cache, ignoring EOS (like ignore_eos=True)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        new = []
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            new.append(tok)
            out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return new


def test_greedy_32_tokens_match_hf(llm, hf):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [_chat_ids(llm, p) for p in PROMPTS]
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs):
        ref_new = _hf_greedy(hf, ids, 32)
        assert out.token_ids == ref_new, (llm.tokenizer.decode(out.token_ids), llm.tokenizer.decode(ref_new))
