"""GPU check and timing of pallas_kernels.kv_compact (reference vs generic Pallas vs Mosaic GPU).

For each config (page size, dtype, batch rows B; 24 layers of [N, page_size, 2, 8, 128] pages,
A = 6 accepted-path slots, paths of random draft trees) it

  1. runs every implementation once on the same random cache and compares the result with the
     reference bitwise (on device),
  2. times each one: jitted with the pages donated (in place), 3 warmup calls, then the median of
     20 calls, each followed by block_until_ready,

and prints one JSON line per config. Implementations: "reference" (jnp gather + scatter),
"pallas" (pallas_call, Triton lowering), "mosaic" (Mosaic GPU via pl.kernel + refs),
"mosaic:pallas_call" (Mosaic GPU via pallas_call + input_output_aliases). A failing implementation
is reported under "errors" with its exception text; it does not stop the run. Each config runs in
its own subprocess (a kernel that faults on the device cannot take the later configs with it);
--inline runs them in this process instead.

    python3 scripts/check_kv_compact_gpu.py                  # all configs
    python3 scripts/check_kv_compact_gpu.py --only ps16      # configs whose name contains "ps16"
    python3 scripts/check_kv_compact_gpu.py --small          # quick smoke test, tiny caches
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYERS, HKV, D, A, N_NODES = 24, 8, 128, 6, 16
WARMUP, REPS = 3, 20


def configs():
    out = []
    for ps, n in ((1, 8192), (16, 2048)):  # ps = 1: fewer tokens (8192 vs 32768) to save memory
        for dtype in ("bfloat16", "float32"):
            for B in (1, 32):
                out.append(dict(name=f"ps{ps}-{dtype}-B{B}", page_size=ps, num_pages=n, dtype=dtype, B=B,
                                layers=[[[2, HKV, D], dtype]] * LAYERS))
    # a target + draft mix: two shape/dtype groups in one call
    out.append(dict(name="ps16-mixed-B32", page_size=16, num_pages=2048, dtype="bfloat16", B=32,
                    layers=[[[2, HKV, D], "bfloat16"]] * LAYERS + [[[2, 2, 64], "float32"]] * 2))
    return out


def tree_path(rng, n_nodes):
    """Root-to-node path (strictly increasing, starts at 0) in a random tree (parent[i] < i)."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n_nodes)]
    node = int(rng.integers(1, n_nodes))
    path = []
    while node >= 0:
        path.append(node)
        node = parent[node]
    return path[::-1]


def make_indices(rng, B, page_size, num_pages):
    import numpy as np
    P = min(64, (num_pages - 1) // B)  # pages per row; page 0 is the trash page
    table = rng.permutation(np.arange(1, num_pages))[: B * P].reshape(B, P).astype(np.int32)
    cap = P * page_size
    start = rng.integers(0, cap - N_NODES + 1, size=B).astype(np.int32)
    acc = np.full((B, A), -1, np.int32)
    nacc = np.zeros(B, np.int32)
    for b in range(B):
        path = tree_path(rng, N_NODES)[:A]
        nacc[b] = int(rng.integers(1, len(path) + 1))
        acc[b, : nacc[b]] = path[: nacc[b]]
    return table, start, acc, nacc


def run_config(cfg) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import kv_compact as kvc

    rec = dict(config=cfg["name"], page_size=cfg["page_size"], num_pages=cfg["num_pages"],
               dtype=cfg["dtype"], B=cfg["B"], A=A, layers=len(cfg["layers"]), jax=jax.__version__,
               device=str(jax.devices()[0].device_kind), ok={}, ms={}, errors={})
    rng = np.random.default_rng(0)
    n, ps = cfg["num_pages"], cfg["page_size"]
    table, start, acc, nacc = make_indices(rng, cfg["B"], ps, n)
    idx = tuple(jnp.asarray(x) for x in (table, start, acc, nacc))
    rec["valid_moves_per_layer"] = int(np.asarray(kvc.compact_moves(*idx, ps)[2]).sum())
    key = jax.random.key(1)
    pages = []
    for i, (tail, dtype) in enumerate(cfg["layers"]):
        x = jax.random.normal(jax.random.fold_in(key, i), (n, ps, *tail), jnp.float32)
        pages.append(x.astype(dtype))
    jax.block_until_ready(pages)
    rec["cache_gib"] = round(sum(p.size * p.dtype.itemsize for p in pages) / 2**30, 3)
    try:  # what an engine with kv_compact_impl="auto" would choose for these shapes
        from specjax.kernels import choose_kv_compact
        rec["auto"], rec["auto_note"] = choose_kv_compact("auto", (pages, *idx))
    except Exception as e:  # noqa: BLE001
        rec["errors"]["auto"] = f"{type(e).__name__}: {e}"[:4000]

    impls = {
        "reference": kvc.kv_compact_reference,
        "pallas": kvc.kv_compact_pallas,
        "mosaic": functools.partial(kvc.kv_compact_mosaic, entry="kernel"),
        "mosaic:pallas_call": functools.partial(kvc.kv_compact_mosaic, entry="pallas_call"),
    }

    def bits(x):
        return jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])

    same = jax.jit(lambda a, b: jnp.array_equal(bits(a), bits(b)))
    want = jax.jit(kvc.kv_compact_reference)(pages, *idx)  # not donated: pages stay valid
    jax.block_until_ready(want)

    for name, fn in impls.items():
        try:
            step = jax.jit(fn, donate_argnums=(0,))
            out = step([jnp.copy(p) for p in pages], *idx)
            jax.block_until_ready(out)
            rec["ok"][name] = all(bool(same(o, w)) for o, w in zip(out, want))
            cur = out
            for _ in range(WARMUP):
                cur = step(cur, *idx)
            jax.block_until_ready(cur)
            times = []
            for _ in range(REPS):
                t0 = time.perf_counter()
                cur = step(cur, *idx)
                jax.block_until_ready(cur)
                times.append(time.perf_counter() - t0)
            rec["ms"][name] = round(statistics.median(times) * 1e3, 4)
            rec["ms"][name + ":min"] = round(min(times) * 1e3, 4)
            del cur, out
        except Exception as e:  # noqa: BLE001 - report and go on with the next implementation
            rec["errors"][name] = f"{type(e).__name__}: {e}"[:4000]
            rec["errors"][name + ":where"] = traceback.format_exc(limit=-3)[-1500:]
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="run configs whose name contains this")
    ap.add_argument("--inline", action="store_true", help="no subprocess per config")
    ap.add_argument("--small", action="store_true",
                    help="smoke test: 128 pages, 2 (+1 draft) layers per config")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode: a config as JSON
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_config(json.loads(args.one))), flush=True)
        return
    for cfg in configs():
        if args.only not in cfg["name"]:
            continue
        if args.small:
            cfg = dict(cfg, num_pages=128, layers=cfg["layers"][:2] + cfg["layers"][LAYERS:])
        if args.inline:
            print(json.dumps(run_config(cfg)), flush=True)
            continue
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)],
                              capture_output=True, text=True, cwd=REPO, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode == 0 and lines:
            print(lines[-1], flush=True)
        else:
            print(json.dumps(dict(config=cfg["name"], crashed=True, returncode=proc.returncode,
                                  stdout_tail=proc.stdout[-2000:], stderr_tail=proc.stderr[-4000:])),
                  flush=True)


if __name__ == "__main__":
    main()
