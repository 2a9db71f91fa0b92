"""Time the Mosaic GPU paged attention (its XLA combine of the splits included) per layer for
several split counts: a chain of --layers dependent calls in one jitted program, so the figure is
device time as a model step sees it (no per-call host dispatch).

Each row's key range is shared by `num_splits` CTAs per (row, KV head) and XLA then combines the
splits' partials; more splits help long contexts, and every split costs the combine. This probe
measures that trade-off on the shapes the fused step runs (SmolLM2: 9 / 3 heads, head_dim 64, a
17-node tree at batch 1, 2 rows, the second a padding row; an 8B shape: 32 / 8 heads, 128) at
several contexts.

    python3 scripts/probe_splits.py [--splits 4,8,16,32] [--contexts 300,4000] [--layers 10] [--json F]
    python3 scripts/probe_splits.py --interpret --splits 2 --contexts 40 --layers 2 --shapes smollm2 --reps 1
        # CPU smoke run (the Mosaic GPU interpreter)

Measured on an H200 (docs/benchmarks.md, 2026-11-26 evening), SmolLM2 verify, us per call: context 300:
8 splits 12.6, 32 splits 16.7 (unrolled combine); context 4000: 8 splits 32.3, 32 splits 19.1 (reduction
combine), so fewer splits cannot be the default while the split count is fixed at compile time. (At
context 300 / 32 splits this chain gave the reduction combine 15.9 us against 16.7 unrolled, where the
profiled model step got faster with the unrolled one: the chain's query update fuses with the combine
differently than the model does, so compare combines with scripts/profile_step.py.) Compiling
a 30-layer chain for four split counts took over 5 minutes per context: hence --layers 10.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"smollm2": dict(heads=[9, 3], D=64), "llama3.1-8b": dict(heads=[32, 8], D=128)}


def timed_chain(case, num_splits, layers, reps, interpret):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    # lowered once for all the chain's call sites, as the model's layers share one (specjax.attention)
    attn = jax.jit(functools.partial(paged_attention_mosaic, num_splits=num_splits, interpret=interpret,
                                     mask_start=case.mask_start))

    @jax.jit
    def run(q, kv, table, q_start, kv_len, block_mask):
        for _ in range(layers):  # each call's query depends on the previous output: they run in order
            o = attn(q, kv, table, q_start, kv_len, block_mask)
            q = (q.astype(jnp.float32) + 1e-3 * o.astype(jnp.float32)).astype(q.dtype)
        return q

    args = case.args
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, time.perf_counter() - t)
    return best / layers * 1e6  # us per call


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_paged_attention_gpu import make
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", default="4,8,16,32")
    p.add_argument("--contexts", default="300,4000")
    p.add_argument("--shapes", default="smollm2,llama3.1-8b")
    p.add_argument("--modes", default="verify", help="verify (a tree of --verify-nodes tokens), grow (a draft "
                   "level: --grow-queries tokens against the prefix and the tree so far)")
    p.add_argument("--verify-nodes", type=int, default=17)
    p.add_argument("--grow-queries", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="rows (2: one row and the engine's padding row)")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    for shape, mode in itertools.product(a.shapes.split(","), a.modes.split(",")):
        T = {"verify": a.verify_nodes, "grow": a.grow_queries}[mode]
        for ctx in (int(c) for c in a.contexts.split(",")):
            cfg = dict(name=f"{shape}-{mode}-ctx{ctx}", mode=mode, T=T, ps=16, dtype="bfloat16", batch=a.batch,
                       context=ctx, cap=max(1024, 2 * ctx + 64), clamped_pad=True, **SHAPES[shape])
            case = make(cfg)
            row = dict(shape=shape, mode=mode, T=T, context=ctx)
            for s in (int(x) for x in a.splits.split(",")):
                row[f"splits{s}_us"] = round(timed_chain(case, s, a.layers, a.reps, a.interpret), 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = [k for k in rows[0] if k.endswith("_us")]
    print("| shape | mode (T) | context | " + " | ".join(k[:-3] + " (us)" for k in keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} ({r['T']}) | {r['context']} | "
              + " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
