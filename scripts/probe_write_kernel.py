"""What the Mosaic verify kernel that writes its tokens' K / V costs against the engine's default (XLA's
scatter, then the kernel that only reads), at the default model's batch-1 verify shape (SmolLM2-135M: 9 query /
3 KV heads, head_dim 64, pages of 16, a 32-node tree; two rows, the second empty, as with row hand-over).

Each variant runs as a model step runs it: LAYERS dependent calls in one jitted program (each call's query
depends on the previous output, the pages are threaded through; one lowering of the kernel for all calls). Per
layer: the wall time (median of REPS programs; host launch costs included) and, on a GPU, the device's kernel
time from a profiler trace (all kernels of the program: the attention kernel, scatters, the rest):

    scatter      write_kv, then paged_attention_mosaic (the engine's default)
    write_end    paged_attention_write_mosaic, rows stored after each CTA's key loop (write_at="end")
    write_start  the same, rows stored before the key loop (write_at="start")
    read_only    paged_attention_mosaic alone (no write: the floor)

Every variant is first checked against write_kv + the jnp reference (outputs within 3e-2, pages equal).

    python3 scripts/probe_write_kernel.py --json out.json        # Hopper GPU
    python3 scripts/probe_write_kernel.py --interpret --contexts 40 --layers 2 --reps 1   # CPU smoke run
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VARIANTS = ("scatter", "write_end", "write_start", "read_only")


def make(ctx: int, T: int, H: int, Hkv: int, D: int, ps: int, seed: int = 0):
    """Row 0: ctx cached keys then T tree nodes; row 1 empty. -> dict of arrays."""
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(seed)
    B = 2
    P = -(-(ctx + T) // ps) + 1
    N = B * P + 1
    table = (1 + rng.permutation(N - 1)[: B * P]).reshape(B, P).astype(np.int32)
    table[1] = 0
    parent = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, T)]
    mask = np.zeros((B, T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parent[j]
    f = functools.partial(rng.normal, 0, 1)
    return dict(q=jnp.asarray(f((B, T, H, D)), jnp.bfloat16), k=jnp.asarray(f((B, T, Hkv, D)), jnp.bfloat16),
                v=jnp.asarray(f((B, T, Hkv, D)), jnp.bfloat16),
                pages=jnp.asarray(f((N, ps, 2, Hkv, D)), jnp.bfloat16), table=jnp.asarray(table),
                q_start=jnp.asarray([ctx, 0], jnp.int32), kv_len=jnp.asarray([ctx + T, 0], jnp.int32),
                num_new=jnp.asarray([T, 0], jnp.int32), mask=jnp.asarray(mask))


def one_call(variant: str, ps: int, interpret: bool, max_splits):
    """(q, k, v, pages, table, q_start, kv_len, num_new, mask) -> (out [B, T, H, D], pages)."""
    import jax

    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic, paged_attention_write_mosaic
    from specjax.kv_cache import write_indices, write_kv
    kw = dict(interpret=interpret, max_splits=max_splits)

    write = jax.jit(functools.partial(paged_attention_write_mosaic, offset=0, write_at=variant[len("write_"):], **kw)
                    ) if variant.startswith("write_") else None
    read = jax.jit(functools.partial(paged_attention_mosaic, **kw))  # one lowering for all layers, as the engine's

    def call(q, k, v, pages, table, q_start, kv_len, num_new, mask):
        if write is not None:
            return write(q, k, v, pages, table, q_start, kv_len, mask)
        if variant == "scatter":
            pages = write_kv(pages, k, v, write_indices(table, q_start, num_new, q.shape[1], ps))
        return read(q, pages, table, q_start, kv_len, mask), pages
    return call


def chained(call, layers: int):
    import jax
    import jax.numpy as jnp

    def run(q, k, v, pages, *rest):
        out = q
        for _ in range(layers):
            out, pages = call(q + (1e-3 * out).astype(q.dtype), k, v, pages, *rest)
        return out.astype(jnp.float32).sum(), pages
    return jax.jit(run, donate_argnums=(3,))


def device_time(f, args, layers: int, reps: int = 5) -> dict:
    """Kernel time per layer on the device (a jax.profiler trace of reps programs): all kernels, and by kind."""
    import tempfile

    import jax
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from profile_step import kernel_events
    tdir = tempfile.mkdtemp(prefix="probe_write_")
    fresh = [[jax.numpy.array(v) for v in args] for _ in range(reps)]  # the pages are donated; copied before
    jax.block_until_ready(fresh)  # the trace, so that their copy kernels are not counted as the variant's
    with jax.profiler.trace(tdir):
        for one in fresh:
            jax.block_until_ready(f(*one))
    evs, on_device = kernel_events(tdir)
    kinds: dict[str, float] = {}
    for name, ns, _module, _op in evs:
        kind = "attention" if "paged_attention" in name else "scatter" if "scatter" in name else "other"
        kinds[kind] = kinds.get(kind, 0.0) + ns / 1e3 / reps / layers
    return dict(device_us_per_layer=round(sum(kinds.values()), 2), on_device=on_device,
                **{f"{k}_us": round(v, 2) for k, v in sorted(kinds.items())},
                kernels_per_layer=round(len(evs) / reps / layers, 2))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="256,1024,2048", help="cached keys of row 0 before the tree")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--tree", type=int, default=32, help="tree nodes (the default 7/4/24 + branch 7: 32)")
    p.add_argument("--max-splits", default="auto", help="'auto': the engine's cap (attention.split_cap), or an int")
    p.add_argument("--interpret", action="store_true", help="the Mosaic GPU interpreter (CPU; slow)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    import jax
    import numpy as np

    from specjax import attention
    from pallas_kernels.paged_attention import paged_attention_reference
    from specjax.kv_cache import write_indices, write_kv
    H, Hkv, D, ps, T = 9, 3, 64, 16, a.tree
    rows = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        cap = attention.split_cap(ctx + T, 1) if a.max_splits == "auto" else int(a.max_splits)
        x = make(ctx, T, H, Hkv, D, ps)
        args = (x["q"], x["k"], x["v"], x["pages"], x["table"], x["q_start"], x["kv_len"], x["num_new"], x["mask"])
        want_pages = write_kv(x["pages"], x["k"], x["v"], write_indices(x["table"], x["q_start"], x["num_new"], T, ps))
        want = paged_attention_reference(x["q"], want_pages, x["table"], x["q_start"], x["kv_len"], x["mask"])
        for variant in a.variants.split(","):
            call = one_call(variant, ps, a.interpret, cap)
            out, pages = jax.jit(call)(*args)
            ref = want if variant != "read_only" else paged_attention_reference(  # reads the pages as they are
                x["q"], x["pages"], x["table"], x["q_start"], x["kv_len"], x["mask"])
            err = float(np.max(np.abs(np.asarray(out[0], np.float32) - np.asarray(ref[0], np.float32))))
            same = variant == "read_only" or bool(np.array_equal(np.asarray(pages[1:], np.float32),
                                                                 np.asarray(want_pages[1:], np.float32)))
            f = chained(call, a.layers)
            ts = []
            for r in range(a.reps + 3):
                fresh = [jax.numpy.array(v) for v in args]  # the pages are donated
                jax.block_until_ready(fresh)
                t0 = time.perf_counter()
                jax.block_until_ready(f(*fresh))
                if r >= 3:
                    ts.append(time.perf_counter() - t0)
            us = statistics.median(ts) * 1e6 / a.layers
            row = dict(ctx=ctx, variant=variant, max_splits=cap, wall_us_per_layer=round(us, 2), max_err=err,
                       pages_equal=same, device=str(jax.devices()[0].device_kind))
            if not a.interpret:
                row.update(device_time(f, args, a.layers))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if err > 3e-2 or not same:
                print(f"WRONG: {variant} at ctx {ctx}: max error {err:.3g}, pages equal {same}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
