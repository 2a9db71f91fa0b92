"""Paged attention as a Mosaic TPU kernel (Pallas TPU: scalar prefetch + manual page DMAs).

Same contract as `paged_attention_reference` (pallas_kernels/paged_attention.py, where the data
flow of all the kernels is written). Grid (row b, KV head h, query block); a TensorCore runs its
grid in order, so a row's key range is not split:

    SMEM (scalar prefetch)  bounds [B * 4], page_table [B * P]      (flat: 1-D SMEM arrays)
    VMEM  q block [BQ, D] of head h (BlockSpec)
    for each key block j (BK = max(128, ps) keys = BK / ps pages), double-buffered:
        DMA  kv[page, :, 0 | 1, h, :] ([ps, D] each) -> VMEM slot (j - j0) % 2, rows i * ps ..
        start the DMAs of block j + 1 into the other slot, wait for block j
        s = q k^T [BQ, BK] f32 (MXU), masked (row_bounds), online softmax, acc += p v
    o = acc / l, lse = m + log l

Requirements (checked by `why_not_tpu`): the page size is a multiple of the sublane tile (8 rows
for 4-byte, 16 for 2-byte dtypes) and divides 128 or is a multiple of it, so page copies land on
whole VMEM tiles; head_dim a multiple of 128 (full lanes). Elsewhere the reference serves on TPU
(specjax.attention.resolve says so). Checked here without a TPU: the kernel against the reference
in the TPU interpreter, and its lowering to Mosaic TPU by jax.export(platforms=("tpu",)); the final
Mosaic compilation happens on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import NEG, Geometry, geometry, key_range, run_paged, split_range, visible

__all__ = ["paged_attention_tpu", "why_not_tpu"]


def _pltpu():
    from jax.experimental.pallas import tpu as pltpu
    return pltpu


def _sublanes(dtype) -> int:
    return 32 // jnp.dtype(dtype).itemsize  # rows of one VMEM tile: 8 (f32), 16 (bf16)


def why_not_tpu(dtype, page_size: int, head_dim: int) -> str | None:
    """Why the Mosaic TPU kernel cannot serve this configuration (None: it can)."""
    tile = _sublanes(dtype)
    if page_size % tile or (128 % page_size and page_size % 128):
        return (f"page_size {page_size} is not a multiple of {tile} (the {jnp.dtype(dtype)} sublane tile) "
                "dividing 128 (or a multiple of 128)")
    if head_dim % 128:
        return f"head_dim {head_dim} is not a multiple of 128 (lanes)"
    return None


def _block_kv(ps: int) -> int:
    return max(128, ps)


def _kernel(g: Geometry, prec, bounds_ref, pt_ref, q_ref, kv_hbm, o_ref, lse_ref, k_buf, v_buf, sem):
    """bounds_ref [B * 4], pt_ref [B * P] int32 (SMEM); q_ref [BQ, D] (VMEM); kv_hbm
    [N, ps, 2, Hkv, D] (HBM); o_ref [BQ, D] f32, lse_ref [BQ, 1] f32; k_buf, v_buf [2, BK, D]
    (VMEM); sem: DMA semaphores [2 (K, V), 2 (slot)]."""
    pltpu = _pltpu()
    b, h, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    BQ, BK, ps = g.block_q, _block_kv(g.ps), g.ps
    ppb = BK // ps
    kend, diag, qpos = bounds_ref[4 * b], bounds_ref[4 * b + 1], bounds_ref[4 * b + 2]
    r0 = qb * BQ
    t_lo = lax.div(r0, g.G)
    t_hi = jnp.minimum(lax.div(r0 + BQ - 1, g.G), g.T - 1)
    lo, hi = key_range((kend, diag, qpos), t_lo, t_hi, g.window)
    j0, j1 = split_range(lo, hi, BK, 0, 1)

    def copies(j, slot):  # the DMAs of key block j into `slot`
        out = []
        for i in range(ppb):
            page = pt_ref[b * g.P + jnp.minimum(j * ppb + i, g.P - 1)]
            rows = pl.ds(i * ps, ps)
            out.append(pltpu.make_async_copy(kv_hbm.at[page, :, 0, h, :], k_buf.at[slot, rows], sem.at[0, slot]))
            out.append(pltpu.make_async_copy(kv_hbm.at[page, :, 1, h, :], v_buf.at[slot, rows], sem.at[1, slot]))
        return out

    @pl.when(j0 < j1)
    def _():
        for c in copies(j0, 0):
            c.start()

    q = q_ref[...]
    row = r0 + lax.broadcasted_iota(jnp.int32, (BQ, BK), 0)  # query row t * G + g
    col = lax.broadcasted_iota(jnp.int32, (BQ, BK), 1)

    def step(j, carry):
        m, l, acc = carry
        slot = lax.rem(j - j0, 2)

        @pl.when(j + 1 < j1)
        def _():
            for c in copies(j + 1, 1 - slot):
                c.start()

        for c in copies(j, slot):
            c.wait()
        k = k_buf[slot]  # [BK, D]
        v = v_buf[slot]
        sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32) * g.scale  # [BQ, BK]
        ok = visible(col + j * BK, row, (kend, diag, qpos), g.G, g.window)
        sc = jnp.where(ok, sc, NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.where(ok, jnp.exp(sc - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                            preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((BQ, 1), NEG, jnp.float32), jnp.zeros((BQ, 1), jnp.float32),
            jnp.zeros((BQ, g.D), jnp.float32))
    m, l, acc = lax.fori_loop(j0, j1, step, init)
    live = l > 0
    safe = jnp.where(live, l, 1.0)
    o_ref[...] = acc / safe
    lse_ref[...] = jnp.where(live, m + jnp.log(safe), -jnp.inf)


def _paged(qg, kv_pages, page_table, bounds, g: Geometry, *, interpret: bool):
    pltpu = _pltpu()
    BQ, BK = g.block_q, _block_kv(g.ps)
    dtype = kv_pages.dtype
    prec = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(g.B, g.Hkv, g.num_q_blocks),
        in_specs=[pl.BlockSpec((None, None, BQ, g.D), lambda b, h, qb, *_: (b, h, qb, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, None, BQ, g.D), lambda b, h, qb, *_: (b, h, qb, 0)),
                   pl.BlockSpec((None, None, BQ, 1), lambda b, h, qb, *_: (b, h, qb, 0))],
        scratch_shapes=[pltpu.VMEM((2, BK, g.D), dtype), pltpu.VMEM((2, BK, g.D), dtype),
                        pltpu.SemaphoreType.DMA((2, 2))],
    )
    o, lse = pl.pallas_call(
        functools.partial(_kernel, g, prec),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((g.B, g.Hkv, g.Rp, g.D), jnp.float32),
                   jax.ShapeDtypeStruct((g.B, g.Hkv, g.Rp, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_attention_tpu",
    )(bounds.reshape(-1), page_table.reshape(-1), qg, kv_pages)
    return o[:, :, None], lse[:, :, None, :, 0]


def paged_attention_tpu(q, kv_pages, page_table, q_start, kv_len, block_mask=None, *, sliding_window=None,
                        scale=None, mask_start=None, block_q: int | None = None, block_kv: int | None = None,
                        interpret: bool = False):
    """Same contract as `paged_attention_reference`, as a Mosaic TPU kernel that reads only the live
    key blocks of each row. block_q: query rows per program (default: all of a KV head's rows up to
    128, a multiple of 16); block_kv is max(128, page_size) (other values are an error);
    interpret: run in the TPU interpreter on CPU (tests)."""
    ps = kv_pages.shape[1]
    why = why_not_tpu(kv_pages.dtype, ps, q.shape[3])
    if why is not None:
        raise ValueError(f"paged_attention_tpu: {why}")
    if block_kv not in (None, _block_kv(ps)):
        raise ValueError(f"paged_attention_tpu: block_kv is max(128, page_size) = {_block_kv(ps)}, got {block_kv}")
    R = q.shape[1] * (q.shape[2] // kv_pages.shape[3])
    if block_q is None:
        block_q = min(128, -(-R // 16) * 16)
    if block_q % 8:
        raise ValueError(f"paged_attention_tpu: block_q must be a multiple of 8, got {block_q}")
    g = geometry(q, kv_pages, page_table, block_q, sliding_window, scale)
    return run_paged(functools.partial(_paged, interpret=interpret), q, kv_pages, page_table, q_start, kv_len,
                     block_mask, mask_start, g)
