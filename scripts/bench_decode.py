"""Plain decode step time against the roofline (run on the GPU machine).

    python scripts/bench_decode.py --shapes llama3.1-8b --batches 1,32 --context 512,4096 \
        --max-seq-len 1024,8192 --attention auto

Random weights are made on the device; every combination of shape x batch x context x capacity
(max_seq_len, context < capacity) is timed. The device's copy bandwidth is measured in the same
run. Reported per row:
  weight GB/s     bytes of weights streamed per step / step time (the embedding table only when
                  tied, where it is the lm_head)
  kv GB           live KV bytes one step reads: layers x batch x context x 2 x Hkv x D x itemsize
  % roofline      (weights + live KV bytes) / copy bandwidth / step time: 100 % = every byte that
                  must be read is read once at the copy bandwidth; a kernel that reads dead pages
                  (capacity instead of context) falls behind as the capacity grows
  % copy BW       weights only (the earlier figure)
On CPU, a tiny smoke run: --shapes tiny --copy-gib 0.05 --steps 4 (add --attention pallas
--interpret to run the generic Pallas kernel in its interpreter).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax import attention, decode  # noqa: E402
from specjax.kv_cache import init_cache  # noqa: E402
from specjax.models.llama import Llama, flat_state  # noqa: E402
from specjax.sampling import SamplingArrays  # noqa: E402
from specjax.shapes import shape_config  # noqa: E402


def copy_bandwidth(gib=4.0, reps=50):
    """Best of a few device-memory streaming kernels: bytes read + written per second."""
    n = int(gib * 2**30) // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    kernels = {
        "f32 x*a+b": (jax.jit(lambda a: a * 1.5 + 1.0), 8 * n),
        "f32 copy": (jax.jit(lambda a: jnp.copy(a)), 8 * n),
        "f32 sum (read only)": (jax.jit(lambda a: jnp.sum(a)), 4 * n),
    }
    best = {}
    for name, (f, nbytes) in kernels.items():
        jax.block_until_ready(f(x))
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            t.append(time.perf_counter() - t0)
        best[name] = nbytes / np.median(t)
    del x
    return max(best.values()), best


def launch_count(compiled) -> int:
    """Instructions of the optimized entry computation that launch work (kernels, library calls)."""
    text = compiled.as_text()
    if os.environ.get("BENCH_HLO_DIR"):
        Path(os.environ["BENCH_HLO_DIR"], f"decode_{len(text)}.hlo.txt").write_text(text)
    entry = text[text.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    skip = ("parameter(", "tuple(", "get-tuple-element(", "bitcast(", "constant(", "ROOT ")
    ops = []
    for line in entry.splitlines()[1:]:
        if "=" not in line or any(s in line for s in skip):
            continue
        head = line.split("=", 1)[1].split("(")[0].split()
        ops.append(head[-1] if head else "?")
    if os.environ.get("BENCH_HLO_BREAKDOWN"):
        from collections import Counter
        print("launches by op:", Counter(ops).most_common(12), flush=True)
    return len(ops)


def streamed_weight_bytes(model, cfg):
    flat = flat_state(model)
    total = sum(v.size * v.dtype.itemsize for v in flat.values())
    if not cfg.tie_word_embeddings:
        total -= flat["embed"].size * flat["embed"].dtype.itemsize
    return total


def live_kv_bytes(cfg, batch, context, dtype=jnp.bfloat16):
    """K and V bytes of the live entries one decode step reads (every layer, every active row)."""
    return cfg.num_layers * batch * context * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def bench_one(shape, batch, context, steps, max_seq_len, page_size, attn="auto", interpret=False):
    cfg = shape_config(shape)
    model = Llama(cfg, jnp.bfloat16, nnx.Rngs(0))
    wbytes = streamed_weight_bytes(model, cfg)
    impl, choice = attention.resolve(attn, dtype=jnp.bfloat16, page_size=page_size, head_dim=cfg.head_dim,
                                     interpret=interpret)
    model = attention.configure(model, impl)  # what the engine does at start
    fns, weights = decode.compile_steps(*nnx.split(model))
    pages_per_slot = max_seq_len // page_size
    num_pages = batch * pages_per_slot + 1
    cache = init_cache(cfg, num_pages=num_pages, page_size=page_size, max_slots=batch,
                       max_seq_len=max_seq_len, dtype=jnp.bfloat16)
    table = 1 + np.arange(batch * pages_per_slot, dtype=np.int32).reshape(batch, pages_per_slot)
    cache.page_table = jnp.asarray(table)
    cache.seq_lens = jnp.full((batch,), context, jnp.int32)
    state = decode.DecodeState(cache, jnp.ones((batch,), jnp.int32))
    rows = max(2, batch)  # as the engine: a single request runs with one padding row
    slots = jnp.arange(rows, dtype=jnp.int32)
    active = jnp.arange(rows) < batch
    samp = SamplingArrays(jnp.zeros((rows,), jnp.float32), jnp.ones((rows,), jnp.float32),
                          jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.uint32))

    def reset(state):  # keep the context length fixed across timed steps
        c = state.cache
        c.seq_lens = jnp.full((batch,), context, jnp.int32)
        return state

    t0 = time.perf_counter()
    out, state = fns.decode(weights, state, slots, active, samp, stochastic=False)
    out.tokens.block_until_ready()
    compile_s = time.perf_counter() - t0
    kernels = launch_count(fns.decode.lower(weights, state, slots, active, samp, stochastic=False).compile())
    for _ in range(3):
        out, state = fns.decode(weights, state, slots, active, samp, stochastic=False)
    out.tokens.block_until_ready()
    state = reset(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        out, state = fns.decode(weights, state, slots, active, samp, stochastic=False)
    out.tokens.block_until_ready()
    step_s = (time.perf_counter() - t0) / steps
    # host dispatch cost alone: time to enqueue (not wait for) the steps
    state = reset(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        out, state = fns.decode(weights, state, slots, active, samp, stochastic=False)
    dispatch_s = (time.perf_counter() - t0) / steps
    out.tokens.block_until_ready()
    # device-only step time: `loop` steps inside one program (no per-step host dispatch)
    loop = 8  # the engine's default steps_per_call
    state = reset(state)
    toks, state = fns.decode_many(weights, state, slots, active, samp, num_steps=loop, stochastic=False)
    toks.tokens.block_until_ready()
    reps = max(1, steps // loop)
    t0 = time.perf_counter()
    for _ in range(reps):
        state = reset(state)
        toks, state = fns.decode_many(weights, state, slots, active, samp, num_steps=loop, stochastic=False)
    toks.tokens.block_until_ready()
    loop_s = (time.perf_counter() - t0) / (reps * loop)
    del state, weights, model
    kv = live_kv_bytes(cfg, batch, context)
    return dict(shape=shape, batch=batch, context=context, max_seq_len=max_seq_len, attention=str(choice),
                step_ms=step_s * 1e3, dispatch_ms=dispatch_s * 1e3,
                kernels=kernels, loop_step_ms=loop_s * 1e3, loop_weight_gbps=wbytes / loop_s / 1e9,
                weight_gb=wbytes / 1e9, kv_gb=kv / 1e9, weight_gbps=wbytes / step_s / 1e9,
                tokens_per_s=batch / step_s, compile_s=compile_s)


def ints(text):
    return [int(x) for x in str(text).split(",")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="smollm2-135m,llama3.1-8b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", default="512", help="comma list: tokens per row in the cache")
    p.add_argument("--max-seq-len", default="1024", help="comma list: the cache capacity per row")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy-bandwidth probe")
    p.add_argument("--json", default=None)
    p.add_argument("--attention", default="auto", help="implementation at specjax.attention (resolve)")
    p.add_argument("--interpret", action="store_true", help="run a Pallas kernel in its interpreter (CPU)")
    a = p.parse_args()
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    bw, kinds = copy_bandwidth(a.copy_gib)
    print("copy bandwidth (GB/s):", {k: round(v / 1e9) for k, v in kinds.items()}, flush=True)
    rows = []
    for shape in a.shapes.split(","):
        for b in ints(a.batches):
            for cap in ints(a.max_seq_len):
                for ctx in ints(a.context):
                    if ctx + 16 > cap:
                        print(f"skip context {ctx} at max_seq_len {cap}: no room for the timed steps", flush=True)
                        continue
                    r = bench_one(shape, b, ctx, a.steps, cap, a.page_size, a.attention, a.interpret)
                    r["pct_copy_bw"] = 100 * r["weight_gbps"] * 1e9 / bw
                    r["pct_roofline"] = 100 * (r["weight_gb"] + r["kv_gb"]) * 1e9 / bw / (r["step_ms"] / 1e3)
                    r["loop_pct_roofline"] = 100 * (r["weight_gb"] + r["kv_gb"]) * 1e9 / bw / (r["loop_step_ms"] / 1e3)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"attention: {rows[0]['attention'] if rows else '-'}")
    print("| shape | batch | context | max_seq_len | step ms | weights GB | live KV GB | % roofline "
          "| % copy BW (weights) | tok/s | in-program step ms | in-program % roofline | launches/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['max_seq_len']} | {r['step_ms']:.3f} "
              f"| {r['weight_gb']:.3f} | {r['kv_gb']:.3f} | {r['pct_roofline']:.1f} | {r['pct_copy_bw']:.1f} "
              f"| {r['tokens_per_s']:.0f} | {r['loop_step_ms']:.3f} | {r['loop_pct_roofline']:.1f} | {r['kernels']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbps=bw / 1e9, copy_kinds=kinds, rows=rows), indent=1))


if __name__ == "__main__":
    main()
