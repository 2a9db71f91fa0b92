"""Target forward cost over T new tokens (the verify part of a speculative step), GPU machine.

    python scripts/bench_verify_fwd.py --shape llama3.1-8b --tokens 1,6,17 --attention mosaic_gpu,cudnn,reference

Random bf16 weights; --rows batch rows (row 0 active; the engine pads batch 1 to 2 rows for T = 1), context 512 in a
1024-token paged slot; a tree-style block mask (each token sees itself and token 0) for T > 1.
Prints ms per forward (logits included) for each T and attention implementation; run under
different XLA_FLAGS to compare GEMM back ends. `--profile N` also traces N forwards per T and prints
the device time per forward of each instruction kind (op name, layers folded; kernel), the largest
first (XLA's HLO dump maps kernels to op names, as in scripts/profile_step.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import tempfile
from pathlib import Path

DUMP = None
if __name__ == "__main__" and "--profile" in sys.argv:  # before jax starts
    DUMP = tempfile.mkdtemp(prefix="specjax_hlo_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                               " --xla_gpu_enable_command_buffer=").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from specjax import attention  # noqa: E402
from specjax.kv_cache import init_cache, meta_at  # noqa: E402
from specjax.models.llama import Llama  # noqa: E402
from specjax.shapes import shape_config  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3.1-8b")
    p.add_argument("--tokens", default="1,6,17")
    p.add_argument("--attention", default="cudnn,reference")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--profile", type=int, default=0, help="trace N forwards per T; print the costliest kernels")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    cfg = shape_config(a.shape)
    base = Llama(cfg, jnp.bfloat16, nnx.Rngs(0))
    rows, ps, max_len, ctx = a.rows, 16, 1024, 512
    cache = init_cache(cfg, num_pages=rows * max_len // ps + 1, page_size=ps, max_slots=rows, max_seq_len=max_len,
                       dtype=jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(rows * max_len // ps, dtype=np.int32).reshape(rows, -1))
    cache.page_table = table

    def fwd(gd, tdef, w, cache, tokens, positions, mask):
        m = nnx.merge(gd, jax.tree.unflatten(tdef, w))
        T = tokens.shape[1]
        num_new = jnp.where(jnp.arange(rows) == 0, T, 0).astype(jnp.int32)  # row 0 active
        meta = meta_at(cache.page_table, jnp.full((rows,), ctx, jnp.int32), num_new, T, ps, mask)
        h, cache, _ = m(tokens, positions, cache, meta)
        return jnp.argmax(m.logits(h), -1), cache

    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, "XLA_FLAGS",
          os.environ.get("XLA_FLAGS", ""), flush=True)
    for impl in a.attention.split(","):
        chosen, choice = attention.resolve(impl, dtype=jnp.bfloat16, page_size=ps, head_dim=cfg.head_dim)
        print(choice, flush=True)
        gd, params = nnx.split(attention.configure(base, chosen))
        leaves, tdef = jax.tree.flatten(params)
        for T in map(int, a.tokens.split(",")):
            f = jax.jit(functools.partial(fwd, gd, tdef), donate_argnums=(1,))
            toks = jax.random.randint(jax.random.key(T), (rows, T), 0, cfg.vocab_size, jnp.int32)
            pos = ctx + jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (rows, T))
            i = jnp.arange(T)
            mask = None if T == 1 else jnp.broadcast_to((i[:, None] == i[None, :]) | (i[None, :] == 0), (rows, T, T))
            for _ in range(2):
                out, cache = f(leaves, cache, toks, pos, mask)
            jax.block_until_ready((out, cache))
            t0 = time.perf_counter()
            for _ in range(a.steps):
                out, cache = f(leaves, cache, toks, pos, mask)
            jax.block_until_ready((out, cache))
            ms = (time.perf_counter() - t0) / a.steps * 1e3
            print(json.dumps(dict(shape=a.shape, attention=impl, T=T, ms=ms)), flush=True)
            if a.profile:
                cache = profile(lambda c: f(leaves, c, toks, pos, mask), cache, a.profile, a.top, f"{impl} T={T}")


def profile(call, cache, n, top, label):
    """Trace n calls; print us per call of each (op kind, kernel), largest first. -> the cache."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import profile_step as ps
    tdir = tempfile.mkdtemp(prefix="specjax_prof_")
    with jax.profiler.trace(tdir):
        for _ in range(n):
            out, cache = call(cache)
        jax.block_until_ready((out, cache))
    evs, on_device = ps.kernel_events(tdir)
    by = ps.op_table(evs, ps.scope_map(DUMP) if DUMP else {})
    tot_n, tot_t = sum(v[0] for v in by.values()), sum(v[1] for v in by.values())
    print(f"== profile {label}: {tot_n / n:.0f} kernels, {tot_t / 1e3 / n:.1f} us per forward "
          f"({'GPU kernels' if on_device else 'CPU ops'})", flush=True)
    print("| op | kernel | kernels / fwd | us / fwd |\n|---|---|---|---|")
    for (op, kname), (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {op} | {kname} | {c / n:.1f} | {t / 1e3 / n:.1f} |", flush=True)
    return cache


if __name__ == "__main__":
    main()
