"""Prefix caching and chunked prefill through the engine (GPU): time to first token with a shared
system prompt, and the streams' inter-token latency while a long prompt arrives.

  prefix   requests made of one shared system prompt (--system-tokens) and a short question each,
           submitted one after another (each alone, so TTFT is the prefill's own time); TTFT
           p50 / p99 with the prefix cache on and off, and the hit rate. Goal: >= 3x lower TTFT on.
  chunk    --streams requests decode; once they run, a --long-tokens prompt arrives. For each
           --max-prefill-tokens budget: the gaps between token deliveries to the streams (wall time
           between engine steps that gave a stream tokens, per token delivered) in the steady state
           and while the long prompt is prefilled, p50 / p99. Goal: p99 during <= 2x steady p99.

Every scenario runs once to compile and is measured the second time (the prefix cache is emptied
in between). Outputs are compared between the settings (greedy): they must be equal.

    python scripts/bench_prefill.py                                   # SmolLM2 bf16, both modes
    python scripts/bench_prefill.py --speculate --mode chunk --max-prefill-tokens 256,512,1024,8192
    python scripts/bench_prefill.py --dtype float32 --system-tokens 96 --long-tokens 300 \\
        --max-seq-len 512 --max-prefill-tokens 64,8192 --requests 4     # a quick CPU check
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specjax import LLM, SamplingParams  # noqa: E402
from specjax.request import Request  # noqa: E402

_ids = iter(range(10**9))


def make_request(llm, ids, params) -> Request:
    return Request(next(_ids), None, list(ids), params, llm.tokenizer, llm.eos_ids, llm.max_seq_len, 0)


def text_ids(llm, n: int, seed: int) -> list[int]:
    """n token ids of ordinary text (a tokenized passage, repeated as needed)."""
    words = ("the library opens at nine and closes at five while the reading room stays quiet for "
             "students who prepare their exams and for travellers who rest between two trains").split()
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += llm.tokenizer.encode(" ".join(rng.permutation(words)) + ".", add_special_tokens=False)
    return ids[:n]


def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")


def run_prefix(llm, a) -> list[dict]:
    eng = llm.engine
    system = text_ids(llm, a.system_tokens, 0)
    prompts = [system + text_ids(llm, 24, 100 + i) for i in range(a.requests)]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    rows, outs = [], {}
    for on in (False, True):
        eng.sched.prefix_caching = on
        for rep in range(2):  # compile, then measure
            eng.alloc.evict_all()
            ttft, toks = [], []
            for p in prompts:
                req = make_request(llm, p, params)
                t0 = time.perf_counter()
                eng.add_request(req)
                while not req.token_ids:
                    eng.step()
                ttft.append(time.perf_counter() - t0)
                while eng.has_unfinished():
                    eng.step()
                toks.append(req.token_ids)
        outs[on] = toks
        st = eng.stats()
        rows.append(dict(mode="prefix", prefix_cache=on, system_tokens=a.system_tokens, requests=a.requests,
                         ttft_p50_ms=pct(ttft[1:], 50), ttft_p99_ms=pct(ttft[1:], 99),
                         hit_rate=st["prefix_cache_hit_rate"]))
    rows[-1]["ttft_speedup_p50"] = rows[0]["ttft_p50_ms"] / rows[1]["ttft_p50_ms"]
    rows[-1]["outputs_equal"] = outs[True] == outs[False]
    return rows


def run_chunk(llm, a, budget: int, ref: dict) -> dict:
    eng = llm.engine
    eng.sched.max_prefill_tokens = budget
    eng.sched.prefix_caching = False
    long_ids = text_ids(llm, a.long_tokens, 7)
    stream = SamplingParams(max_tokens=a.stream_tokens, temperature=0.0, ignore_eos=True)
    for rep in range(2):  # compile, then measure
        streams = [make_request(llm, text_ids(llm, 32, 200 + i), stream) for i in range(a.streams)]
        long = make_request(llm, long_ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        for r in streams:
            eng.add_request(r)
        last, steady, during = {}, [], []
        steps = 0
        while eng.has_unfinished():
            if steps == a.warm_steps:
                eng.add_request(long)
            upd = eng.step()
            now = time.perf_counter()
            steps += 1
            arrived = steps > a.warm_steps
            # steady: before the long prompt arrives and after it finished; during: until its first token
            bucket_ = during if arrived and not long.token_ids else steady if not arrived or long.finished else None
            for u in upd:
                r = u.request
                if r is long or not u.token_ids:
                    continue
                if id(r) in last and bucket_ is not None:
                    bucket_.extend([(now - last[id(r)]) / len(u.token_ids)] * len(u.token_ids))
                last[id(r)] = now
    toks = [r.token_ids for r in streams] + [long.token_ids]
    ref.setdefault("toks", toks)
    return dict(mode="chunk", max_prefill_tokens=budget, long_tokens=a.long_tokens, streams=a.streams,
                steady_p50_ms=pct(steady, 50), steady_p99_ms=pct(steady, 99),
                during_p50_ms=pct(during, 50), during_p99_ms=pct(during, 99),
                p99_ratio=pct(during, 99) / pct(steady, 99), outputs_equal=toks == ref["toks"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--speculate", action="store_true", help="the shipped EAGLE-3 head (default model)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--mode", default="both", choices=["prefix", "chunk", "both"])
    ap.add_argument("--max-seq-len", type=int, default=4608)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--warm-steps", type=int, default=24, help="engine steps before the long prompt arrives")
    ap.add_argument("--max-prefill-tokens", default="512,8192", help="budgets to compare (chunk mode)")
    ap.add_argument("--json", default=None, help="append the rows to this JSONL file")
    a = ap.parse_args(argv)
    draft = a.draft
    if a.speculate and draft is None:
        from specjax.default_model import DEFAULT_HEAD_DIR
        draft = str(DEFAULT_HEAD_DIR)
    llm = LLM(a.model, dtype=a.dtype, max_batch=a.max_batch, max_seq_len=a.max_seq_len, page_size=a.page_size,
              draft=draft)
    rows = []
    if a.mode in ("prefix", "both"):
        rows += run_prefix(llm, a)
    if a.mode in ("chunk", "both"):
        ref: dict = {}
        for b in (int(x) for x in a.max_prefill_tokens.split(",")):
            rows.append(run_chunk(llm, a, b, ref))
    for r in rows:
        r.update(speculate=draft is not None, dtype=a.dtype)
        print(json.dumps(r))
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
