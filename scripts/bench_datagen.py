"""Offline generation throughput with refilled slots: LLM.generate over fresh slices of a prompt set
per pass, the workload of specjax.train.data (batch 512, temperatures 0 / 0.7 / 0 / 1.0 in turn,
EOS on, up to 512 tokens), reporting tokens/s, XLA compilations and their time, the padded
dispatches that reused a compiled shape (specjax.shape_reuse) and the engine's host times.

    python scripts/bench_datagen.py --passes 3 --prompts-per-pass 1536          # the engine's default reuse
    python scripts/bench_datagen.py --passes 3 --prompts-per-pass 1536 --slack 1  # no reuse: exact buckets

Each pass takes prompts none of the earlier passes used (no prefix-cache hits between passes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def main(argv=None) -> int:
    import jax

    from specjax import LLM, SamplingParams
    from specjax.shape_reuse import ShapeReuse
    from specjax.train.data import read_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="converted model directory (default: the default model)")
    p.add_argument("--prompts", default="data/train/gsm8k_train.jsonl")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--prompts-per-pass", type=int, default=1536)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--slack", type=float, default=4.0, help="ShapeReuse slack (1: no reuse)")
    p.add_argument("--json", default=None, help="append one JSON line per pass")
    a = p.parse_args(argv)
    texts = read_prompts(a.prompts)
    if len(texts) < a.passes * a.prompts_per_pass:
        p.error(f"{a.prompts} has {len(texts)} prompts; {a.passes} passes of {a.prompts_per_pass} need more")
    llm = LLM(a.model, dtype=a.dtype, max_batch=a.batch, max_seq_len=a.max_seq_len)
    llm.engine.shapes = ShapeReuse(slack=a.slack)
    comp = [0, 0.0]

    def listen(event, duration, **kw):
        if event == COMPILE_EVENT:
            comp[0] += 1
            comp[1] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    temps = (0.0, 0.7, 0.0, 1.0)
    for k in range(a.passes):
        part = texts[k * a.prompts_per_pass:(k + 1) * a.prompts_per_pass]
        ids = [llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
               for t in part]
        ids = [x for x in ids if len(x) + a.max_tokens <= a.max_seq_len]
        params = [SamplingParams(max_tokens=a.max_tokens, temperature=temps[i % 4], seed=i) for i in range(len(ids))]
        c0, s0, r0 = list(comp), dict(llm.stats()), llm.engine.shapes.reused
        t0 = time.perf_counter()
        outs = llm.generate(ids, params)
        dt = time.perf_counter() - t0
        s1 = llm.stats()
        row = {"pass": k, "slack": a.slack, "prompts": len(ids), "tokens": sum(len(o.token_ids) for o in outs),
               "seconds": round(dt, 2), "compiles": comp[0] - c0[0], "compile_s": round(comp[1] - c0[1], 2),
               "reused": llm.engine.shapes.reused - r0,
               **{key: round(s1[key] - s0[key], 3) for key in ("host_dispatch_s", "host_read_s", "decode_dispatches",
                                                                 "decode_dispatch_steps", "prefill_tokens")}}
        row["tok_s"] = round(row["tokens"] / dt, 1)
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
