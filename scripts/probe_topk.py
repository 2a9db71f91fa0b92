"""Time the draft tree's per-level top-k ([B, F, V] -> [B, F, k]) on the device, several ways.

The fused step calls one top-k per draft level (tree.expand_step); on the GPU XLA lowers
`lax.top_k` to a custom call that a profile of the step put at ~15 us per call. This probe times a
chain of N dependent top-k calls inside one jitted program (each input depends on the previous
output, so they run in order), minus the same chain without the top-k, for each variant, and checks
that every variant returns what `lax.top_k` returns (values and ids, ties to the lower id).

    python3 scripts/probe_topk.py [--rows 4,32,128] [--vocab 16384] [--k 4] [--chain 20] [--json F]

Measured on an H200 (docs/benchmarks.md, 2026-11-26): alone, k argmax rounds took 2-6 us against
13-18 us for the custom call; inside the fused step (scripts/profile_step.py) the rounds cost as
much as the calls they replaced (+36 kernels, -3 us per step), so the step keeps `lax.top_k`.
"reduce" is specjax.topk.top_k_reduce (one kernel per call; measured 2026-11-27: 8-13 us at 16 384 ids),
two reductions (over N chunks of the vocabulary, then over the chunks; commit 17432c4) were probed
2026-11-27 and were not faster at every row count, so they were removed; the "+log_softmax"
variants compute what a draft level needs from its logits (specjax.topk.top_k_log_softmax).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from specjax.topk import top_k_log_softmax, top_k_reduce  # one variadic reduction (Kernels.draft_topk "reduce")


def topk_xla(x, k):
    return jax.lax.top_k(x, k)


def topk_argmax(x, k):
    """k rounds of argmax (first maximum = lower id), each round masking the id it took."""
    vals, ids = [], []
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    for _ in range(k):
        i = jnp.argmax(x, axis=-1).astype(jnp.int32)
        vals.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        ids.append(i)
        x = jnp.where(idx == i[..., None], -jnp.inf, x)
    return jnp.stack(vals, -1), jnp.stack(ids, -1)


def topk_chunked(x, k, chunk=256):
    """top-k per chunk of the vocabulary, then top-k over the chunks' candidates (ids kept)."""
    *lead, v = x.shape
    c = v // chunk
    xv, xi = jax.lax.top_k(x.reshape(*lead, c, chunk), k)  # [..., c, k]
    xi = xi + (jnp.arange(c, dtype=jnp.int32) * chunk)[:, None]
    val, pos = jax.lax.top_k(xv.reshape(*lead, c * k), k)
    return val, jnp.take_along_axis(xi.reshape(*lead, c * k), pos, axis=-1)


VARIANTS = {"xla": topk_xla, "argmax": topk_argmax, "chunked256": topk_chunked,
            "chunked2048": lambda x, k: topk_chunked(x, k, 2048), "reduce": top_k_reduce,
            # with the log-softmax the tree needs: what one draft level computes from its logits
            "xla+log_softmax": lambda x, k: top_k_log_softmax(x, k, "xla"),
            "reduce+log_softmax": lambda x, k: top_k_log_softmax(x, k, "reduce")}


def chain(fn, k, n):
    def run(x):
        acc = jnp.zeros(x.shape[:-1], jnp.float32)
        for _ in range(n):
            x = x + acc[..., None] * 1e-30  # a dependency on the previous call; values unchanged
            if fn is None:
                acc = acc + x[..., 0]
            else:
                val, ids = fn(x, k)
                acc = acc + val[..., 0] + ids[..., 0].astype(jnp.float32) * 0.0
        return acc
    return jax.jit(run)


def timed(f, x, iters=50):
    f(x).block_until_ready()
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(x)
        out.block_until_ready()
        best.append((time.perf_counter() - t) / iters)
    return min(best)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,32,128", help="B*F rows per call")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, V={a.vocab}, k={a.k}, chain {a.chain}")
    out = []
    for r in [int(s) for s in a.rows.split(",")]:
        x = jax.random.normal(jax.random.key(r), (1, r, a.vocab), jnp.float32)
        x = x.at[0, 0, 7].set(x[0, 0, 3])  # a tie
        ref = jax.jit(topk_xla, static_argnums=1)(x, a.k)
        base = timed(chain(None, a.k, a.chain), x)
        row = {"rows": r, "baseline_us": base * 1e6}
        for name, fn in VARIANTS.items():
            got = jax.jit(fn, static_argnums=1)(x, a.k)
            if name.endswith("log_softmax"):  # ids those of top_k(log_softmax), values within rounding
                want = topk_xla(jax.nn.log_softmax(x, axis=-1), a.k)
                same = bool(jnp.array_equal(got[1], want[1]) and jnp.allclose(got[0], want[0], atol=1e-4))
            else:
                same = bool(jnp.array_equal(got[0], ref[0]) and jnp.array_equal(got[1], ref[1]))
            t = timed(chain(fn, a.k, a.chain), x)
            row[name] = {"us_per_call": (t - base) / a.chain * 1e6, "same_as_lax_top_k": same}
            print(f"rows {r:4d} {name:22s} {(t - base) / a.chain * 1e6:8.2f} us/call  same={same}")
        out.append(row)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
