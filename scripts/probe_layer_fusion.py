"""How XLA fuses a decoder layer's norms, residual adds and MLP on the GPU, by formulation.

A stack of SmolLM2-shaped layers (bf16, T query rows, no attention: q is summed over its heads into the
O projection, which keeps the GEMM chain) in several formulations that compute the same function:

    base      the model's code: RMSNorm (f32 stats, scale after the cast) before each GEMM group
    post      the norm's row scale applied after the first GEMM (x W' * r, W' = diag(g) W folded once)
    post_g    the same, g multiplied into x before the GEMM (an elementwise prologue), W unchanged
    silu32    base with SiLU x up in f32

Reports per variant: kernels per layer and device µs per layer (profiler, command buffers off) and the
wall µs per layer of a loop of the stack (command buffers as configured), and the max |difference| of
the output against base in f32 (formulations of one function: rounding only).
Measured on an H200 (session 36, docs/benchmarks.md): none fuses into fewer kernels than base.

    python3 scripts/probe_layer_fusion.py --rows 32 --layers 30 --variants base,post,post_g,silu32
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

E, H, K, D, F = 576, 9, 3, 64, 1536
EPS = 1e-5


def _ms(x):  # mean square over the last dim, f32 [..., 1]
    xf = x.astype(jnp.float32)
    return jnp.mean(xf * xf, axis=-1, keepdims=True)


def norm(x, g):
    xf = x.astype(jnp.float32)
    return g * (xf * jax.lax.rsqrt(_ms(x) + EPS)).astype(x.dtype)


def layer_base(x, w, silu32=False):  # x [B, T, E]
    q = jnp.einsum("bte,ehd->bthd", norm(x, w["g1"]), w["wq"])
    k = jnp.einsum("bte,ekd->btkd", norm(x, w["g1"]), w["wk"])
    o = q + jnp.repeat(k, H // K, axis=2)  # stand-in for attention: keeps q and k live
    x = x + jnp.einsum("bthd,hde->bte", o, w["wo"])
    h = norm(x, w["g2"])
    gate = jnp.einsum("bte,ef->btf", h, w["wg"])
    up = jnp.einsum("bte,ef->btf", h, w["wu"])
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype) if silu32 else \
        jax.nn.silu(gate) * up
    return x + jnp.einsum("btf,fe->bte", act, w["wd"])


def layer_post(x, w, fold=True):
    r1 = jax.lax.rsqrt(_ms(x) + EPS)  # [B, T, 1] f32
    xin = x if fold else x * w["g1"]
    wq, wk = (w["wq_f"], w["wk_f"]) if fold else (w["wq"], w["wk"])
    q = (jnp.einsum("bte,ehd->bthd", xin, wq).astype(jnp.float32) * r1[..., None]).astype(x.dtype)
    k = (jnp.einsum("bte,ekd->btkd", xin, wk).astype(jnp.float32) * r1[..., None]).astype(x.dtype)
    o = q + jnp.repeat(k, H // K, axis=2)
    x = x + jnp.einsum("bthd,hde->bte", o, w["wo"])
    r2 = jax.lax.rsqrt(_ms(x) + EPS)
    hin = x if fold else x * w["g2"]
    wg, wu = (w["wg_f"], w["wu_f"]) if fold else (w["wg"], w["wu"])
    gate = (jnp.einsum("bte,ef->btf", hin, wg).astype(jnp.float32) * r2).astype(x.dtype)
    up = (jnp.einsum("bte,ef->btf", hin, wu).astype(jnp.float32) * r2).astype(x.dtype)
    return x + jnp.einsum("btf,fe->bte", jax.nn.silu(gate) * up, w["wd"])


VARIANTS = {"base": layer_base, "post": layer_post,
            "post_g": lambda x, w: layer_post(x, w, fold=False),
            "silu32": lambda x, w: layer_base(x, w, silu32=True)}


def weights(n, dtype, seed=0):
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 16 * n))
    out = []
    for _ in range(n):
        w = {"g1": 1 + 0.1 * jax.random.normal(next(ks), (E,)), "g2": 1 + 0.1 * jax.random.normal(next(ks), (E,)),
             "wq": jax.random.normal(next(ks), (E, H, D)) * E ** -0.5, "wk": jax.random.normal(next(ks), (E, K, D)) * E ** -0.5,
             "wo": jax.random.normal(next(ks), (H, D, E)) * (H * D) ** -0.5,
             "wg": jax.random.normal(next(ks), (E, F)) * E ** -0.5, "wu": jax.random.normal(next(ks), (E, F)) * E ** -0.5,
             "wd": jax.random.normal(next(ks), (F, E)) * F ** -0.5}
        w["wq_f"], w["wk_f"] = w["g1"][:, None, None] * w["wq"], w["g1"][:, None, None] * w["wk"]
        w["wg_f"], w["wu_f"] = w["g2"][:, None] * w["wg"], w["g2"][:, None] * w["wu"]
        out.append({k: v.astype(dtype) for k, v in w.items()})
    return out


def stack(variant):
    fn = VARIANTS[variant]

    def run(x, ws):
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer{i}"):
                x = fn(x, w)
        return x
    return run


def loop(variant, reps):
    body = stack(variant)

    def run(x, ws):
        return jax.lax.fori_loop(0, reps, lambda _, y: body(y, ws) * 0.5 + x * 0.5, x)
    return jax.jit(run)


def profile(variant, x, ws):
    from scripts.profile_step import kernel_events
    f = jax.jit(stack(variant))
    f(x, ws).block_until_ready()
    tdir = tempfile.mkdtemp(prefix="probe_layer_")
    with jax.profiler.trace(tdir):
        for _ in range(5):
            f(x, ws).block_until_ready()
    evs, _ = kernel_events(tdir)
    return len(evs) / 5, sum(e[1] for e in evs) / 5 / 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", default="base,post,post_g,silu32")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, a.rows, E)).astype(jnp.bfloat16)
    ws = weights(a.layers, jnp.bfloat16)
    ws32 = weights(a.layers, jnp.float32)
    ref32 = jax.jit(stack("base"))(x.astype(jnp.float32), ws32)
    rows = []
    for v in a.variants.split(","):
        n, us = profile(v, x, ws)
        f = loop(v, a.reps)
        f(x, ws).block_until_ready()
        walls = []
        for _ in range(5):
            t = time.perf_counter()
            f(x, ws).block_until_ready()
            walls.append((time.perf_counter() - t) / a.reps / a.layers * 1e6)
        diff = float(jnp.max(jnp.abs(jax.jit(stack(v))(x.astype(jnp.float32), ws32) - ref32)))
        row = dict(variant=v, kernels_per_layer=n / a.layers, us_per_layer=us / a.layers,
                   wall_us_per_layer=min(walls), f32_max_diff=diff)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
