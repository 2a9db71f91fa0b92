"""Host time of one jitted call on this device: from the call until it returns with its work enqueued,
by number of array arguments (with and without donation) and by number of kernels in the program.

The engine's fused speculative dispatch costs the host ~3 ms on an H200 whether it holds 4 or 8 steps
(docs/benchmarks.md, session 22); this probe separates two parts of such a cost on toy programs:

  ARGS n         a program reading one element of each of n [64, 64] arrays (one kernel)
  DONATE k / d   k arrays read, d donated and rewritten (the engine's weights / state split)
  KERNELS n      n dependent links x = tanh(x @ w + i): about 2n kernels, unrolled
  SCAN4 n        the same n links as a lax.scan of 4 iterations over n / 4 links (the fused step's shape)

    python3 scripts/probe_dispatch_cost.py [--args 1,50,100,200,340] [--links 50,200,800,2000] [--reps 100]

Each figure is the median over --reps calls, each call's output waited for before the next one (so no
queue builds up). On the CPU a program runs partly inside its call: the figures mean something on GPUs.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def median_call_us(f, args, reps: int) -> float:
    """Median host time of f(*args) until it returns (its outputs waited for outside the timing)."""
    jax.block_until_ready(f(*args))  # compile
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = f(*args)
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def donated_call_us(n_keep: int, n_donated: int, reps: int) -> float:
    """Median host time of a call that reads n_keep arrays and donates and rewrites n_donated."""
    keep = [jnp.ones((64, 64), jnp.bfloat16) for _ in range(n_keep)]
    state = [jnp.ones((64, 64), jnp.bfloat16) for _ in range(n_donated)]
    g = jax.jit(lambda k, s: [x + k[0] for x in s], donate_argnums=(1,))
    state = jax.block_until_ready(g(keep, state))  # compile
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        state = g(keep, state)
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(state)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def chain(links: int):
    def f(x, w):  # x [16, 64], w [64, 64]
        for i in range(links):
            x = jnp.tanh(x @ w + i)
        return x
    return jax.jit(f)


def scanned_chain(links: int, iters: int = 4):
    def f(x, w):
        def body(x, _):
            for i in range(links // iters):
                x = jnp.tanh(x @ w + i)
            return x, None
        return jax.lax.scan(body, x, None, length=iters)[0]
    return jax.jit(f)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--args", default="1,50,100,200,340", help="argument counts")
    p.add_argument("--links", default="50,200,800,2000", help="chain lengths (about 2 kernels per link)")
    p.add_argument("--reps", type=int, default=100)
    a = p.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    res = {}
    for n in (int(s) for s in a.args.split(",")):
        xs = [jnp.ones((64, 64), jnp.bfloat16) + i for i in range(n)]
        res[f"args {n}"] = median_call_us(jax.jit(lambda *v: sum(x[0, 0].astype(jnp.float32) for x in v)), xs, a.reps)
    for nk, nd in ((290, 1), (290, 45), (1, 45)):
        res[f"donate {nk} / {nd}"] = donated_call_us(nk, nd, a.reps)
    x, w = jnp.ones((16, 64), jnp.bfloat16), jnp.full((64, 64), 0.01, jnp.bfloat16)
    for n in (int(s) for s in a.links.split(",")):
        res[f"kernels {n}"] = median_call_us(chain(n), (x, w), max(a.reps // 3, 1))
        res[f"scan4 {n}"] = median_call_us(scanned_chain(n), (x, w), max(a.reps // 3, 1))
    for k, v in res.items():
        print(f"{k:>20}: {v:9.1f} us per call", flush=True)
    return res


if __name__ == "__main__":
    main()
