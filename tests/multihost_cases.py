"""Requests of tests/test_multihost.py, shared by the test (single-process references) and
tests/multihost_worker.py (the 2-process job). Tiny random model (tests/tiny_dir.py): token i is "w{i}"."""
from __future__ import annotations

from specjax import SamplingParams

LLM_ARGS = dict(dtype="float32", max_batch=2, max_seq_len=32, tensor_parallel=2)
PROMPTS = ["w5 w17 w3 w9", "w8 w8 w40 w41", "w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22",
           " ".join(["w7"] * 40)]  # the last is longer than the context: it fails alone
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)  # logprobs everywhere: one set of programs
PARAMS = [GREEDY, GREEDY, SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, stop_token_ids=[40]), GREEDY]
STREAM_PROMPTS = ["w5 w17 w3 w9", "w30 w31"]
STREAM_PARAMS = GREEDY
LONG = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)  # closed after its first token


def output_record(o) -> dict:
    return {"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason, "error": o.error,
            "logprobs": None if o.logprobs is None else [{str(k): v for k, v in e.items()} for e in o.logprobs]}
