"""GPU check and timing of the paged-attention kernels against the jnp reference.

For each config (mode, page size, dtype, batch, context, capacity) and each implementation it

  1. runs the implementation on a random case (ragged rows, one empty row, non-contiguous pages,
     garbage in every page a row does not own) and compares the valid queries with the reference
     (max abs error; bf16 passes below 3e-2, f32 below 1e-4),
  2. times it: jitted, 3 warmup calls, then the median of 20 calls each followed by
     block_until_ready (one layer's attention; a model step runs it once per layer),

and prints one JSON line per config. Modes: decode (T = 1), verify (a 17-node tree), grow (draft
growth: 4 nodes over 12 scratch entries + the prefix), prefill (256 new tokens at an offset).
Implementations: "mosaic_gpu" (bf16 / f16), "pallas" (Triton), "reference". A failing
implementation is reported under "errors"; each config runs in its own subprocess (a kernel that
faults cannot take the later configs with it); --inline runs them in this process.

    python3 scripts/check_paged_attention_gpu.py                 # all configs
    python3 scripts/check_paged_attention_gpu.py --only decode   # configs whose name contains it
    python3 scripts/check_paged_attention_gpu.py --smollm2       # SmolLM2-135M's geometry (9 query heads,
        # 3 KV heads, head_dim 64) in the shapes its engine runs at batch 1 (2 rows, one empty)
    python3 scripts/check_paged_attention_gpu.py --small --inline --interpret --only decode
        # CPU smoke run (interpreters; the Mosaic GPU one takes ~30 s per call)
The process exits non-zero when any implementation mismatches or fails.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WARMUP, REPS = 3, 20
T_OF = {"decode": 1, "verify": 17, "grow": 4, "prefill": 256}


def smollm2_configs():
    """SmolLM2-135M (H 9, Hkv 3: G = 3; D 64) as the speculative engine at max_batch 1 runs it: 2 rows
    (the second a padding row without keys), page size 16, 66 pages per slot; tree verify (17 nodes: 51
    query rows in one 64-row block), draft growth (4 nodes), draft extend (6), a 64-token prompt
    piece (192 rows: two 128-row blocks) and plain decoding; contexts of 40 to 1000 keys."""
    out = []
    for mode, T in (("verify", 17), ("grow", 4), ("extend", 6), ("prefill", 64), ("decode", 1)):
        for context in (40, 170, 1000 - T - 16):
            out.append(dict(name=f"smollm2-{mode}-ctx{context}", mode=mode, T=T, ps=16, dtype="bfloat16", batch=2,
                            context=context, cap=1056, heads=[9, 3], D=64, clamped_pad=True))
    return out


def configs(small: bool):
    out = []
    shapes = [(4, 64, 128)] if small else [(1, 512, 1024), (32, 512, 8192), (32, 4096, 8192)]
    modes = ["decode", "verify", "grow"] + ([] if small else ["prefill"])
    for mode in modes:
        for ps in (16,) if small else (8, 16, 64):
            for dtype in ("bfloat16",) if small else ("bfloat16", "float32"):
                for batch, context, cap in shapes:
                    if mode == "prefill" and batch > 4:
                        continue
                    out.append(dict(name=f"{mode}-ps{ps}-{dtype}-b{batch}-ctx{context}-cap{cap}", mode=mode, ps=ps,
                                    dtype=dtype, batch=batch, context=context, cap=cap))
    return out


def make(cfg):
    import jax.numpy as jnp
    import numpy as np

    from tests.paged_cases import Case, ancestors
    rng = np.random.default_rng(0)
    H, Hkv = cfg.get("heads", (32, 8))
    D = cfg.get("D", 128)
    B, ps, T = cfg["batch"], cfg["ps"], cfg.get("T", T_OF.get(cfg["mode"]))
    dtype = jnp.dtype(cfg["dtype"])
    P = cfg["cap"] // ps
    W = {"verify": T, "grow": 12 + T}.get(cfg["mode"], 0)
    N = B * P + 1
    kv = jnp.asarray(rng.normal(size=(N, ps, 2, Hkv, D)).astype(np.float32), dtype)
    table = (1 + rng.permutation(N - 1)[: B * P]).reshape(B, P).astype(np.int32)
    ctx = np.minimum(rng.integers(cfg["context"] // 2, cfg["context"] + 1, size=B), cfg["cap"] - T - W)
    ctx[0] = min(cfg["context"], cfg["cap"] - T - W)
    num_new = np.full(B, T)
    if B > 1:
        ctx[-1], num_new[-1] = 0, 0  # an empty row
    block_mask = mask_start = None
    q_start = ctx.copy()
    if cfg["mode"] == "verify":
        block_mask = np.stack([ancestors(rng, T) for _ in range(B)])
    elif cfg["mode"] == "grow":
        mask_start, q_start = ctx.copy(), ctx + 12
        block_mask = rng.random((B, T, W)) < 0.3
        block_mask[:, :, 12:] = np.eye(T, dtype=bool)[None]
    if cfg.get("clamped_pad") and B > 1:  # the engine's padding row (slot >= max_slots): row 0's pages, no keys
        table[-1], q_start[-1] = table[0], q_start[0]
    kv_len = np.where(num_new > 0, q_start + num_new, 0)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)).astype(np.float32), dtype)
    return Case(q=q, kv_pages=kv, page_table=jnp.asarray(table), q_start=jnp.asarray(q_start, jnp.int32),
                kv_len=jnp.asarray(kv_len, jnp.int32), block_mask=None if block_mask is None else jnp.asarray(block_mask),
                mask_start=None if mask_start is None else jnp.asarray(mask_start, jnp.int32), num_new=num_new)


def run_config(cfg, interpret: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax import attention
    case = make(cfg)
    row = dict(cfg)
    ref = jax.jit(attention.implementation(attention.REFERENCE))
    want = np.asarray(ref(*case.args, mask_start=case.mask_start).astype(jnp.float32))
    impls = ["reference", "pallas"] + (["mosaic_gpu"] if cfg["dtype"] != "float32" else [])
    tol = 1e-4 if cfg["dtype"] == "float32" else 3e-2
    errors, ok = {}, True
    for name in impls:
        try:
            impl, _ = attention.resolve(name, dtype=case.q.dtype, page_size=cfg["ps"], head_dim=case.q.shape[3],
                                        interpret=interpret)
            fn = jax.jit(functools.partial(attention.implementation(impl), mask_start=case.mask_start))
            got = np.asarray(fn(*case.args).astype(jnp.float32))
            err = max((float(np.abs(got[b, :n] - want[b, :n]).max()) for b, n in enumerate(case.num_new) if n),
                      default=0.0)
            row[f"{name}_max_err"] = err
            ok &= bool(err < tol)
            warmup, reps = (1, 1) if interpret else (WARMUP, REPS)
            for _ in range(warmup):
                jax.block_until_ready(fn(*case.args))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*case.args))
                times.append(time.perf_counter() - t0)
            row[f"{name}_ms"] = statistics.median(times) * 1e3
        except Exception as e:  # noqa: BLE001 - report and go on with the next implementation
            errors[name] = f"{type(e).__name__}: {e}"[:2000]
            ok = False
            traceback.print_exc()
    row["errors"] = errors
    row["ok"] = ok
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=None)
    p.add_argument("--small", action="store_true")
    p.add_argument("--inline", action="store_true")
    p.add_argument("--interpret", action="store_true", help="kernels in their interpreters (CPU smoke run)")
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's geometry (smollm2_configs) instead")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # one config, JSON (subprocess)
    a = p.parse_args()
    if a.config:
        print("RESULT " + json.dumps(run_config(json.loads(a.config), a.interpret)), flush=True)
        return
    failed = False
    for cfg in smollm2_configs() if a.smollm2 else configs(a.small):
        if a.only and a.only not in cfg["name"]:
            continue
        if a.inline:
            row = run_config(cfg, a.interpret)
        else:
            cmd = [sys.executable, __file__, "--config", json.dumps(cfg)] + (["--interpret"] if a.interpret else [])
            res = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
            row = json.loads(lines[-1][7:]) if lines else dict(cfg, ok=False, errors={"process": res.stderr[-2000:]})
        failed |= not row["ok"]
        print(json.dumps(row), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
