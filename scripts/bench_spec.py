"""Fused speculative step (chain, draft model) vs a plain decode step, on the GPU machine.

    python scripts/bench_spec.py --shapes llama3.1-8b,smollm2-135m --batches 1,32 --num-steps 4

Random bf16 weights on the device. The draft is a small Llama with the target's vocabulary
(2 layers, hidden 1024 for the 8B shape; 2 layers of the target's width for SmolLM2). Reported:
ms per plain decode step, ms per fused spec step (draft k tokens + verify k+1 + accept), and
their ratio: with acceptance length tau, speculation pays when tau > ratio.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax import decode, step  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.kv_cache import init_cache  # noqa: E402
from specjax.models.llama import Llama  # noqa: E402
from specjax.sampling import SamplingArrays  # noqa: E402
from specjax.shapes import SHAPES, shape_config  # noqa: E402


def draft_config(shape: str) -> ModelConfig:
    d = dict(SHAPES[shape], num_hidden_layers=2)
    if d["hidden_size"] > 1024:
        d.update(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8)
    return ModelConfig.from_hf_dict(d)


def timed(fn, state, steps):
    out, state = fn(state)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out, state = fn(state)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps, state


def bench(shape, batch, k, context, max_seq_len, page_size, steps):
    cfg, dcfg = shape_config(shape), draft_config(shape)
    target, draft = Llama(cfg, jnp.bfloat16, nnx.Rngs(0)), Llama(dcfg, jnp.bfloat16, nnx.Rngs(1))
    rows = max(2, batch)
    P = max_seq_len // page_size

    def cache():
        c = init_cache(cfg, num_pages=rows * P + 1, page_size=page_size, max_slots=rows,
                       max_seq_len=max_seq_len, dtype=jnp.bfloat16)
        c.page_table = jnp.asarray(1 + np.arange(rows * P, dtype=np.int32).reshape(rows, P))
        c.seq_lens = jnp.full((rows,), context, jnp.int32)
        return c

    slots = jnp.arange(rows, dtype=jnp.int32)
    active = jnp.arange(rows) < batch
    samp = SamplingArrays(jnp.zeros((rows,)), jnp.ones((rows,)), jnp.zeros((rows,), jnp.int32),
                          jnp.zeros((rows,), jnp.uint32))
    fns, w = decode.compile_steps(*nnx.split(target))
    plain_s, _ = timed(lambda s: fns.decode(w, s, slots, active, samp, stochastic=False),
                       decode.DecodeState(cache(), jnp.ones((rows,), jnp.int32)), steps)

    sfns, tw, dw = step.compile_spec_steps(*nnx.split(target), *nnx.split(draft))
    st = step.init_spec_state(cache(), dcfg, jnp.bfloat16)
    st.draft_seq_lens = jnp.full((rows,), context, jnp.int32)

    def spec(s):  # keep lengths fixed so every timed step sees the same context
        s.cache.seq_lens = jnp.full((rows,), context, jnp.int32)
        s.draft_seq_lens = jnp.full((rows,), context, jnp.int32)
        return sfns.step(tw, dw, s, slots, active, num_steps=k)
    spec_s, _ = timed(spec, st, steps)
    return dict(shape=shape, batch=batch, num_steps=k, plain_ms=plain_s * 1e3, spec_ms=spec_s * 1e3,
                ratio=spec_s / plain_s)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="llama3.1-8b,smollm2-135m")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    rows = []
    for shape in a.shapes.split(","):
        for b in map(int, a.batches.split(",")):
            r = bench(shape, b, a.num_steps, a.context, a.max_seq_len, a.page_size, a.steps)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("| shape | batch | k | plain step ms | fused spec step ms | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['num_steps']} | {r['plain_ms']:.3f} | {r['spec_ms']:.3f} "
              f"| {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
