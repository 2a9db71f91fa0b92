"""x @ [W_1 | W_2 | ...] for a few rows of x (a verify or draft forward: M <= 64 tokens), as a Mosaic
GPU kernel (Hopper: TMA weight tiles into swizzled SMEM, wgmma), with its jnp reference.

Written because the 8B verify forward over 17 tokens (a 16-node tree and its root) spent ~10 % more in
its GEMMs than the forward over two rows (docs/benchmarks.md, "The 8B fused step with one row"), although
they read the same bytes. Measured since (H200, scripts/bench_skinny_gemm.py; docs/benchmarks.md, "A
skinny-M matmul for the verify forward"): XLA's GEMMs alone lose only 2-6 % at M = 17, and this kernel is
1-13 % slower than XLA on the large weight groups (18-40 % on an EAGLE-3 head's q|k|v), so no model or
dispatch point uses it. It streams the weights once and computes on the tensor cores at M = 64 (the
unused rows cost compute that hides under the copies):

    x [M, K] -> padded to Mr = ceil(M / 8) * 8 rows (TMA lands whole 8-row SMEM tiles; the SMEM rows
                past Mr hold whatever was there: row i of a product depends on row i of x only, so
                they touch only output rows that are dropped)
    weights W_i [K, N_i] (several that share x, e.g. q / k / v or gate / up: one launch; every N_i a
                multiple of the column tile TN), column tiles numbered across all of them
    grid (column tile j, K split s): one warpgroup per CTA
        for each K block kb of split s (TK = 64 rows), `stages` blocks in flight:
            TMA  x[:, kb] -> [64, TK] slot,  W[kb, tile j] -> [TK, TN] slot  (one barrier per slot)
            wgmma  acc [64, TN] f32 += x slot @ W slot;  wait for the previous wgmma -> refill its slot
        acc rows 0..Mr -> SMEM -> TMA to out[s, :, tile j]
    y = sum over splits of out, rows 0..M, split back into the N_i columns, cast to x's dtype

Requirements (checked by `why_not_skinny`): bf16 / f16; 1 <= M <= 64; K a multiple of TK = 64; every
N_i a multiple of 64. Splits of K (`splits`) give the GPU enough CTAs when the weights have few
column tiles (e.g. an o-projection of 4096 columns: 32 tiles of 128 for 132 SMs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu import interpret_params, plgpu as _plgpu

__all__ = ["skinny_matmul", "skinny_matmul_reference", "why_not_skinny", "auto_tiles"]

TM, TK = 64, 64  # wgmma's M; the K rows of one weight tile (128 bytes of bf16: the swizzle width)
MAX_ROWS = 64
NUM_SMS = 132  # H100 / H200


def skinny_matmul_reference(x, ws, out_dtype=None):
    """x [M, K]; ws: weights [K, N_i] -> tuple of x @ W_i [M, N_i] (f32 accumulation, out_dtype or
    x's dtype)."""
    out_dtype = out_dtype or x.dtype
    return tuple(jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype) for w in ws)


def why_not_skinny(dtype, M: int, K: int, Ns) -> str | None:
    """Why the kernel cannot serve these shapes (None: it can)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"takes bf16 / f16 (wgmma), not {dtype}"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} rows: the kernel takes 1 to {MAX_ROWS}"
    if K % TK:
        return f"K = {K} is not a multiple of {TK}"
    bad = [n for n in Ns if n % 64]
    if bad:
        return f"output widths {bad} are not multiples of 64"
    return None


def auto_tiles(K: int, Ns, num_sms: int = NUM_SMS) -> tuple[int, int]:
    """(TN, splits): the column tile (128 where every width allows it, else 64) and the fewest K splits
    that give about one CTA per SM (>= 0.9 x num_sms CTAs), each split keeping >= 4 K blocks. From the
    H200 sweep (docs/benchmarks.md): more splits than that only add f32 partials to write and reduce
    (the 8B gate / up with 10 splits: 91 us, with one: 68 us)."""
    tn = 128 if all(n % 128 == 0 for n in Ns) else 64
    tiles = sum(n // tn for n in Ns)
    max_splits = max(1, K // TK // 4)
    return tn, int(min(max_splits, max(1, -(-int(0.9 * num_sms) // tiles))))


def _body(Mr, TN, S, kb_total, stages, tile_starts, x_ref, *refs):
    """x_ref [Mr, K] (GMEM); refs: the weights [K, N_i] (GMEM), out_ref [S, Mr, sum N_i] f32 (GMEM),
    then the scratch: x slots [stages, 64, TK], w slots [stages, TK, TN], o [64, TN] f32, barriers."""
    plgpu = _plgpu()
    nw = len(tile_starts) - 1
    ws, out_ref = refs[:nw], refs[nw]
    x_smem, w_smem, o_smem, bars = refs[nw + 1:]
    j = lax.axis_index("n")
    s = lax.axis_index("k")
    kb0 = lax.div(s * kb_total, S)  # this split's K blocks: kb0 .. kb1 - 1 (uneven splits allowed)
    kb1 = lax.div((s + 1) * kb_total, S)
    nk = kb1 - kb0

    def run(w_ref, c0):  # c0: this tile's first column of w_ref
        def issue(i, slot):  # TMA K block kb0 + i of x and of the weight tile into `slot`
            k0 = pl.multiple_of((kb0 + i) * TK, TK)
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, TK)], x_smem.at[slot, pl.ds(0, Mr)], bars.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, TK), pl.ds(c0, TN)], w_smem.at[slot], bars.at[slot])

        for st in range(stages):
            @pl.when(st < nk)
            def _(st=st):
                issue(st, st)

        def loop(acc_ref):
            def step(i, _):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(bars.at[slot])
                plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot])
                plgpu.wgmma_wait(1)  # the previous block's wgmma is done: its slot may be refilled

                @pl.when(jnp.logical_and(i >= 1, i - 1 + stages < nk))
                def _():
                    issue(i - 1 + stages, lax.rem(i - 1, stages))
                return 0

            lax.fori_loop(0, nk, step, 0)
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        o_smem[...] = pl.run_scoped(loop, plgpu.ACC((TM, TN), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, Mr)], out_ref.at[s, :, pl.ds(j * TN, TN)])
        plgpu.wait_smem_to_gmem(0)

    for w, w_ref in enumerate(ws):
        t0, t1 = tile_starts[w], tile_starts[w + 1]

        @pl.when(jnp.logical_and(j >= t0, j < t1))
        def _(w_ref=w_ref, t0=t0):
            run(w_ref, pl.multiple_of((j - t0) * TN, TN))


@functools.partial(jax.jit, static_argnames=("tn", "splits", "stages", "out_dtype", "interpret"))
def skinny_matmul(x, ws, *, tn: int | None = None, splits: int | None = None, stages: int = 4, out_dtype=None,
                  interpret: bool = False):
    """x [M, K] bf16 / f16, ws: a tuple of weights [K, N_i] -> tuple of x @ W_i [M, N_i] (f32
    accumulation; out_dtype or x's dtype). tn: column tile (64 or 128; None: auto_tiles), splits: K
    splits (None: auto_tiles), stages: K blocks in flight per CTA; interpret: run in the Mosaic GPU
    interpreter on CPU (slow; for tests)."""
    plgpu = _plgpu()
    ws = tuple(ws)
    M, K = x.shape
    Ns = [w.shape[1] for w in ws]
    why = why_not_skinny(x.dtype, M, K, Ns)
    if why is None and any(w.shape[0] != K or w.dtype != x.dtype for w in ws):
        why = f"weights {[(w.shape, str(w.dtype)) for w in ws]} do not all take x [{M}, {K}] {x.dtype}"
    if why is not None:
        raise ValueError(f"skinny_matmul: {why}")
    a_tn, a_splits = auto_tiles(K, Ns)
    TN, S = tn or a_tn, splits or a_splits
    if TN not in (64, 128) or any(n % TN for n in Ns) or not 1 <= S <= K // TK:
        raise ValueError(f"skinny_matmul: tn {TN} must be 64 or 128 and divide every width {Ns}; splits {S} "
                         f"must be 1..{K // TK}")
    Mr = -(-M // 8) * 8
    xp = jnp.pad(x, ((0, Mr - M), (0, 0))) if Mr != M else x
    starts = [0]
    for n in Ns:
        starts.append(starts[-1] + n // TN)
    swz = 128
    tr = (plgpu.TilingTransform((8, swz // jnp.dtype(x.dtype).itemsize)), plgpu.SwizzleTransform(swz))
    scratch = [plgpu.SMEM((stages, TM, TK), x.dtype, transforms=tr),
               plgpu.SMEM((stages, TK, TN), x.dtype, transforms=tr),
               plgpu.SMEM((TM, TN), jnp.float32),
               plgpu.Barrier(num_arrivals=2, num_barriers=stages)]

    def entry(x_ref, *refs):
        pl.run_scoped(lambda *sc: _body(Mr, TN, S, K // TK, stages, tuple(starts), x_ref, *refs, *sc), *scratch)

    kw = {} if not interpret else {"interpret": interpret_params("skinny_matmul")}
    out = pl.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((S, Mr, starts[-1] * TN), jnp.float32),
        mesh=plgpu.Mesh(grid=(starts[-1], S), grid_names=("n", "k")),
        name="skinny_matmul",
        **kw,
    )(xp, *ws)
    y = out.sum(0)[:M].astype(out_dtype or x.dtype)  # [M, sum N_i]
    cols = [0]
    for n in Ns:
        cols.append(cols[-1] + n)
    return tuple(y[:, a:b] for a, b in zip(cols[:-1], cols[1:]))
