"""Paged attention as a generic `pallas_call` (Triton on GPU; the Pallas interpreter on CPU).

Same contract as `paged_attention_reference` (pallas_kernels/paged_attention.py, where the data
flow of all the kernels is written). One program per (row b, KV head h, query block, split s):

    q block [BQ, D] (rows t * G + g of head h)         from group_queries
    for each key block j of the split (BK keys):       only blocks below the row's visible end
        rows  = page_table[b, k // ps] * ps + k % ps   gather of BK cache entries: any page size
        s     = q k^T * scale, masked (row_bounds)     [BQ, BK] f32
        online softmax update of (m, l, acc)
    o = acc / l, lse = m + log l                       partial of split s

The cache is viewed as [N * ps, 2, Hkv, D] (a free reshape) and each key block is one gathered
load, so every page size (1 .. 64 and beyond) runs the same code.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import NEG, Geometry, geometry, key_range, run_paged, split_range, visible

__all__ = ["paged_attention_pallas", "auto_splits"]


def _kernel(g: Geometry, BK: int, S: int, prec, bounds_ref, pt_ref, q_ref, kv_ref, o_ref, lse_ref):
    """bounds_ref [B, 4], pt_ref [B, P] int32 (whole); q_ref [BQ, D]; kv_ref [N * ps, 2, Hkv, D]
    (whole); o_ref [BQ, D] f32; lse_ref [BQ] f32."""
    b, h, qb, s = (pl.program_id(i) for i in range(4))
    BQ = g.block_q
    bnd = (bounds_ref[b, 0], bounds_ref[b, 1], bounds_ref[b, 2])
    r = qb * BQ + jax.lax.broadcasted_iota(jnp.int32, (BQ, 1), 0)  # [BQ, 1] query row t * G + g
    t_lo = jax.lax.div(qb * BQ, g.G)
    t_hi = jnp.minimum(jax.lax.div(qb * BQ + BQ - 1, g.G), g.T - 1)
    lo, hi = key_range(bnd, t_lo, t_hi, g.window)
    j0, j1 = split_range(lo, hi, BK, s, S)
    q = q_ref[...]
    koff = jax.lax.broadcasted_iota(jnp.int32, (1, BK), 1)

    def body(j, carry):
        m, l, acc = carry
        kidx = j * BK + koff  # [1, BK]
        col = jnp.minimum(kidx[0] // g.ps, g.P - 1)
        rows = pt_ref[b, col] * g.ps + kidx[0] % g.ps  # [BK] flat cache entries
        k = kv_ref[rows, 0, h, :]  # [BK, D]
        v = kv_ref[rows, 1, h, :]
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32) * g.scale  # [BQ, BK]
        ok = visible(kidx, r, bnd, g.G, g.window)
        sc = jnp.where(ok, sc, NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.where(ok, jnp.exp(sc - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((BQ, 1), NEG, jnp.float32), jnp.zeros((BQ, 1), jnp.float32),
            jnp.zeros((BQ, g.D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(j0, j1, body, init)
    live = l > 0
    safe = jnp.where(live, l, 1.0)
    o_ref[...] = acc / safe
    lse_ref[...] = jnp.where(live, m + jnp.log(safe), -jnp.inf)[:, 0]


MAX_SPLITS = 32


def auto_splits(g: Geometry, target_programs: int = 264, max_splits: int | None = None) -> int:
    """Splits of each row's key range so that about target_programs programs run (2 per SM on an
    H100 / H200), at most max_splits (None: MAX_SPLITS); independent of the capacity (a split past
    a row's live blocks ends at once)."""
    programs = g.B * g.Hkv * g.num_q_blocks
    return int(max(1, min(-(-target_programs // max(programs, 1)), max_splits or MAX_SPLITS)))


def _triton_params():
    try:
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    except Exception:  # noqa: BLE001 - no Triton backend in this jax: default lowering
        return None


def _paged(qg, kv_pages, page_table, bounds, g: Geometry, *, block_kv: int, num_splits, interpret: bool,
           max_splits: int | None = None):
    N = kv_pages.shape[0]
    flat = kv_pages.reshape(N * g.ps, 2, g.Hkv, g.D)
    S = num_splits or auto_splits(g, max_splits=max_splits)
    BQ = g.block_q

    def whole(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    o, lse = pl.pallas_call(
        functools.partial(_kernel, g, block_kv, S, jax.lax.Precision.HIGHEST if qg.dtype == jnp.float32 else None),
        out_shape=[jax.ShapeDtypeStruct((g.B, g.Hkv, S, g.Rp, g.D), jnp.float32),
                   jax.ShapeDtypeStruct((g.B, g.Hkv, S, g.Rp), jnp.float32)],
        grid=(g.B, g.Hkv, g.num_q_blocks, S),
        in_specs=[whole(bounds), whole(page_table),
                  pl.BlockSpec((None, None, BQ, g.D), lambda b, h, qb, s: (b, h, qb, 0)),
                  whole(flat)],
        out_specs=[pl.BlockSpec((None, None, None, BQ, g.D), lambda b, h, qb, s: (b, h, s, qb, 0)),
                   pl.BlockSpec((None, None, None, BQ), lambda b, h, qb, s: (b, h, s, qb))],
        interpret=interpret,
        compiler_params=None if interpret else _triton_params(),
        name="paged_attention",
    )(bounds, page_table, qg, flat)
    return o, lse


def paged_attention_pallas(q, kv_pages, page_table, q_start, kv_len, block_mask=None, *, sliding_window=None,
                           scale=None, mask_start=None, block_q: int | None = None, block_kv: int = 32,
                           num_splits: int | None = None, interpret: bool = False, max_splits: int | None = None):
    """Same contract as `paged_attention_reference`; reads only the live key blocks of each row.

    block_q: query rows (t * G + g) per program (default: all rows of a KV head up to 64, at least
    16, a power of two); block_kv: keys per loop step (a power of two >= 16 for Triton's dot);
    num_splits: splits of each row's key range (None: enough programs to fill a GPU, see
    auto_splits, at most max_splits); interpret: run in the Pallas interpreter (CPU tests).
    """
    B, T, H, _ = q.shape
    R = T * (H // kv_pages.shape[3])
    if block_q is None:
        block_q = max(16, min(64, pl.next_power_of_2(R)))
    g = geometry(q, kv_pages, page_table, block_q, sliding_window, scale)
    fn = functools.partial(_paged, block_kv=block_kv, num_splits=num_splits, interpret=interpret,
                           max_splits=max_splits)
    return run_paged(fn, q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, g)
