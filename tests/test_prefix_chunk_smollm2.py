"""Real SmolLM2-135M-Instruct (f32) with the shipped EAGLE-3 head, through LLM: chat prompts that
share a system prompt give the same greedy tokens and the same acceptance with the prefix cache and
chunked prefill on as with both off; the shared pages are hit."""
from __future__ import annotations

from helpers import default_model_or_skip

from specjax import LLM, SamplingParams
from specjax.assets import DEFAULT_HEAD_DIR
from specjax.prefix_cache import max_shared_pages

SYSTEM = ("You are a careful assistant for a small public library. Answer in one short sentence, "
          "mention the opening hours (9 to 17, closed on Sundays) when they matter, and never invent "
          "book titles that the catalogue does not list.")
QUESTIONS = ["Can I return a book on Sunday?", "What is a library card for?", "Do you lend board games?"]


def test_smollm2_eagle3_prefix_cache_and_chunks_change_nothing():
    llm = LLM(default_model_or_skip(), dtype="float32", max_batch=4, max_seq_len=256, page_size=16, draft=DEFAULT_HEAD_DIR,
              max_prefill_tokens=32)
    eng = llm.engine
    prompts = [llm.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    assert min(map(len, ids)) > 64  # several chunks and pages each
    params = SamplingParams(max_tokens=8, temperature=0.0)
    eng.sched.prefix_caching, eng.sched.max_prefill_tokens = False, 8192
    ref = llm.generate(prompts, params)
    eng.sched.prefix_caching, eng.sched.max_prefill_tokens = True, 32
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.accept_len_mean for o in outs] == [o.accept_len_mean for o in ref]
    assert max(o.accept_len_mean for o in outs) > 1.5  # the trained head drafts well
    common = min(len(ids[0]), *(next(i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b) for x in ids[1:]))
    assert all(o.num_cached_tokens >= (common - 1) // 16 * 16 >= 32 for o in outs[1:])
    st = llm.stats()
    assert st["prefix_cache_hits"] == 2 and st["pages_in_use"] == 0
    assert st["prefill_tokens"] == 2 * sum(map(len, ids)) - st["prefix_cache_hit_tokens"]
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in again] == [max_shared_pages(len(x), 16, 1) * 16 for x in ids]
