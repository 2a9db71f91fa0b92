"""XLA compile time of a program by its number of Mosaic GPU attention call sites (GPU only).

One paged-attention kernel shape (SmolLM2's heads, a 29-query block, the engine's page layout) called N times
in a chain (each call's output is the next call's query, so none is removed), as the layers of the engine's
programs call it. jaxlib keeps compiled Mosaic kernels for the life of a process, so each N is compiled in a
process of its own (a cold jit, no persistent cache; on the CPU, a smoke run, the kernels run in their
interpreter). If the time grows with N while the kernel is one, the cost is per call site (each custom call
carries the serialized kernel), not the kernel's own compilation.

    python3 scripts/probe_mosaic_compile.py --sites 1,2,8,30 [--impl reference]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one(n: int, impl: str) -> dict:
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, str(REPO))
    from specjax import attention
    from specjax.kv_cache import meta_at

    B, T, H, KVH, D, P, ps, W = 1, 29, 9, 3, 64, 67, 16, 66
    impl_obj, _ = attention.resolve(impl, dtype=jnp.bfloat16, page_size=ps, head_dim=D,
                                    interpret=jax.default_backend() == "cpu")
    q = jnp.zeros((B, T, H, D), jnp.bfloat16)
    kv = jnp.zeros((P, ps, 2, KVH, D), jnp.bfloat16)
    pt = jnp.zeros((B, W), jnp.int32)
    start = jnp.full((B,), 100, jnp.int32)
    n_new = jnp.full((B,), T, jnp.int32)

    def f(q, kv, pt, start, n_new):
        meta = meta_at(pt, start, n_new, T, ps)
        for _ in range(n):
            q = attention.attend(q, kv, meta, impl_obj).astype(q.dtype)
        return q

    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(q, kv, pt, start, n_new)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    compiled(q, kv, pt, start, n_new).block_until_ready()
    return dict(sites=n, impl=impl_obj.name, lower_s=round(t1 - t0, 2),
                compile_s=round(t2 - t1, 2), hlo_chars=len(lowered.as_text()))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", default="1,2,8,30")
    p.add_argument("--impl", default="mosaic_gpu")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one is not None:
        row = one(a.one, a.impl)
        print(json.dumps(row), flush=True)
        return [row]
    rows = []
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", SPECJAX_COMPILE_CACHE="off")
    for n in (int(s) for s in a.sites.split(",")):
        r = subprocess.run([sys.executable, __file__, "--one", str(n), "--impl", a.impl], env=env,
                           capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        print(line[-1] if line else f"sites {n}: failed: {r.stderr[-800:]}", flush=True)
        if line:
            rows.append(json.loads(line[-1]))
    return rows


if __name__ == "__main__":
    main()
