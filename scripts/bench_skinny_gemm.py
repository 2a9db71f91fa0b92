"""Skinny GEMMs of a verify / draft forward: XLA's dot against pallas_kernels.skinny_matmul, GPU machine.

    python scripts/bench_skinny_gemm.py --shape llama3.1-8b --rows 1,2,4,17,32 --sweep 17

For each weight group of one layer of the shape (q|k|v, o, gate|up, down; the lm_head) and of an EAGLE-3
head for it (q|k|v over 2E, its lm_head over a 32 000-token draft vocabulary), random bf16 weights:
`copies` distinct weight sets (enough to pass 600 MB, so L2 holds none of them) are multiplied by
`copies` distinct inputs x [M, K] in one jitted program (distinct inputs: XLA would merge dots that
share an operand into one). Prints us per weight group and the weights' GB/s for XLA ("xla", the dots
as the model writes them) and for the kernel (auto tiles); `--sweep M` also times every (tn, splits,
stages) of the kernel at M rows. One JSON object per line.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.skinny_matmul import auto_tiles, skinny_matmul, why_not_skinny  # noqa: E402
from specjax.shapes import shape_config  # noqa: E402

DRAFT_VOCAB = 32000


def groups(cfg):
    E, F, H, Kv, D, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.vocab_size)
    return {"qkv": (E, [H * D, Kv * D, Kv * D]), "o": (H * D, [E]), "gate_up": (E, [F, F]), "down": (F, [E]),
            "lm_head": (E, [V]), "draft_qkv": (2 * E, [H * D, Kv * D, Kv * D]), "draft_lm_head": (E, [DRAFT_VOCAB])}


def timed(fn, args, steps):
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(2):
        out = fn(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3.1-8b")
    p.add_argument("--rows", default="1,2,4,8,17,32,64")
    p.add_argument("--groups", default="qkv,o,gate_up,down,lm_head,draft_qkv,draft_lm_head")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sweep", type=int, default=0, help="also sweep the kernel's tiles at this many rows")
    p.add_argument("--budget-mb", type=int, default=600)
    p.add_argument("--quant", default="", help="also time XLA's dot over weights stored as int8 / float8_e4m3fn "
                   "(per-column scales, converted in the dot): comma list of int8,fp8")
    p.add_argument("--no-kernel", action="store_true")
    a = p.parse_args()
    quant = [q for q in a.quant.split(",") if q]
    if set(quant) - {"int8", "fp8"}:
        p.error(f"--quant takes int8 and / or fp8, got {a.quant!r}")
    unknown = set(a.groups.split(",")) - set(groups(shape_config(a.shape)))
    if unknown:
        p.error(f"--groups: unknown {sorted(unknown)}; known: {sorted(groups(shape_config(a.shape)))}")
    cfg = shape_config(a.shape)
    dt = jnp.bfloat16
    key = jax.random.PRNGKey(0)
    rows = [int(r) for r in a.rows.split(",")]
    for name in a.groups.split(","):
        K, Ns = groups(cfg)[name]
        nbytes = K * sum(Ns) * 2
        copies = max(2, math.ceil(a.budget_mb * 1e6 / nbytes))
        ws = [[(jax.random.normal(jax.random.fold_in(key, 7 * c + i), (K, n), jnp.float32) * 0.02).astype(dt)
               for i, n in enumerate(Ns)] for c in range(copies)]

        def xla(xs, ws):
            return [[jnp.einsum("te,ef->tf", x, w, preferred_element_type=jnp.float32).astype(dt) for w in wc]
                    for x, wc in zip(xs, ws)]

        def quantize(w, qn):  # per output column: w ~= q * scale
            amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0)
            if qn == "int8":
                sc = jnp.maximum(amax, 1e-12) / 127.0
                return jnp.clip(jnp.round(w / sc), -127, 127).astype(jnp.int8), sc.astype(dt)
            sc = jnp.maximum(amax, 1e-12) / 448.0
            return (w / sc).astype(jnp.float8_e4m3fn), sc.astype(dt)

        qws = {qn: [[quantize(w, qn) for w in wc] for wc in ws] for qn in quant}

        def xla_q(xs, qws):
            return [[(jnp.einsum("te,ef->tf", x, q.astype(dt), preferred_element_type=jnp.float32) * sc).astype(dt)
                     for q, sc in wc] for x, wc in zip(xs, qws)]

        def kern(xs, ws, **kw):
            return [skinny_matmul(x, tuple(wc), **kw) for x, wc in zip(xs, ws)]

        for M in rows:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 + c), (M, K), jnp.float32).astype(dt)
                  for c in range(copies)]
            res = {"group": name, "K": K, "N": Ns, "M": M, "copies": copies, "weights_mb": round(nbytes / 1e6, 1)}
            t = timed(jax.jit(xla), (xs, ws), a.steps) / copies
            res["xla_us"], res["xla_gbs"] = round(t * 1e6, 2), round(nbytes / t / 1e9, 1)
            for qn in quant:
                t = timed(jax.jit(xla_q), (xs, qws[qn]), a.steps) / copies
                res[f"xla_{qn}_us"] = round(t * 1e6, 2)
                res[f"xla_{qn}_gbs_bf16_equiv"] = round(nbytes / t / 1e9, 1)
                y_q, y_x = xla_q(xs[:1], qws[qn][:1])[0], xla(xs[:1], ws[:1])[0]
                res[f"{qn}_rel_err"] = max(float(jnp.linalg.norm((u - v).astype(jnp.float32)) /
                                                 jnp.linalg.norm(v.astype(jnp.float32))) for u, v in zip(y_q, y_x))
            why = "--no-kernel" if a.no_kernel else why_not_skinny(dt, M, K, Ns)
            if why is None:
                tn, sp = auto_tiles(K, Ns)
                try:
                    t = timed(jax.jit(kern), (xs, ws), a.steps) / copies
                    res.update(kernel_us=round(t * 1e6, 2), kernel_gbs=round(nbytes / t / 1e9, 1), tn=tn, splits=sp)
                    y_k, y_x = kern(xs[:1], ws[:1])[0], xla(xs[:1], ws[:1])[0]
                    res["max_abs_diff"] = max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
                                              for u, v in zip(y_k, y_x))
                except Exception as e:  # report and go on: one failing configuration is a finding
                    res["kernel_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            else:
                res["kernel"] = why
            print(json.dumps(res), flush=True)
            if M == a.sweep and why is None:
                tn_a, sp_a = auto_tiles(K, Ns)
                grid = [(tn, sp, 4) for tn in (64, 128) if not any(n % tn for n in Ns)
                        for sp in (1, 2, 4, 8) if sp <= K // 64] + [(tn_a, sp_a, st) for st in (2, 3, 6)]
                for tn, sp, st in grid:
                    r = {"group": name, "M": M, "tn": tn, "splits": sp, "stages": st}
                    try:
                        fn = jax.jit(lambda xs, ws, tn=tn, sp=sp, st=st: kern(xs, ws, tn=tn, splits=sp, stages=st))
                        t = timed(fn, (xs, ws), a.steps) / copies
                        r.update(us=round(t * 1e6, 2), gbs=round(nbytes / t / 1e9, 1))
                    except Exception as e:  # report and go on
                        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(json.dumps({"sweep": r}), flush=True)

if __name__ == "__main__":
    main()
