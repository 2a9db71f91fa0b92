"""Paged attention as a Mosaic GPU kernel (Hopper: TMA page copies into swizzled SMEM, wgmma).

Same contract as `paged_attention_reference` (pallas_kernels/paged_attention.py, where the data
flow of all the kernels is written). One CTA (one warpgroup) per (row b, KV head h, split s, query
block), grid (B, Hkv, splits * query blocks); the query blocks of one split are neighbours, so a
page one of them reads is in L2 for the others:

    TMA  q block [BQ, D] of head h (rows t * G + g; BQ = 64, wgmma's M, also for up to 128 rows,
         e.g. a 17-node tree with G = 4 in two CTAs that share the pages through L2: 1.8x faster
         than one 128-row CTA on an H100, docs/benchmarks.md; 128 for more rows, e.g. prefill)
    for each key block j of the split (BK = 64 keys = BK / ps pages), `stages` blocks in flight:
        TMA  the K and V page slabs kv[page, :, 0 | 1, h, :] ([ps, D] each) into slot j % stages
        wgmma  s = q k^T          [64, BK] f32 in registers; scaled, masked (row_bounds)
        online softmax (m, l), p in bf16
        wgmma  acc += p v         [64, D] f32
        slot free -> TMA block j + stages into it
    o = acc / l, lse = m + log l  -> SMEM -> TMA to the partials of split s (only the real rows
                                     when one block holds them all: decode writes G rows, not 64)

Paired blocks (`auto_pair`: exactly two 64-row blocks and more CTAs than fit the GPU at once, e.g. a
17-node tree of the 8B shape at batch 32): one CTA of two warpgroups, grid (B, Hkv, splits), one
query block each; warpgroup 0 issues the TMAs of each key block once for both, and refills a slot
when both have arrived on its "free" barrier; the f32 outputs reuse the key slabs' SMEM after a
barrier that both pass when their loops are done (~97 KiB per CTA at head_dim 128: two CTAs per SM).

Requirements (checked by `why_not_mosaic`): bf16 / f16; page size a multiple of 8 (TMA rows land
on whole 8-row SMEM tiles) dividing 64 or a multiple of 64; head_dim a multiple of 64 (128-byte
swizzle). Masks never need a division (`visible` in paged_attention.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu import interpret_params, plgpu as _plgpu
from pallas_kernels.paged_attention import (NEG, Geometry, block_bounds, combine, geometry, group_queries, key_range,
                                            pack_block_rows, run_paged, split_range, ungroup, visible, visible_block)

__all__ = ["paged_attention_mosaic", "paged_attention_write_mosaic", "why_not_mosaic", "why_not_write"]

BLOCK_QS = (64, 128)  # wgmma M is 64; a warpgroup issues two of them for 128 rows
MAX_SPLITS = 32
TARGET_CTAS = 264  # CTAs resident at once on an H100 / H200: 132 SMs x 2 (SMEM ~100-112 KiB each)


WRITE_AT = ("end", "start")  # when the write kernel stores its rows (paged_attention_write_mosaic)


def why_not_mosaic(dtype, page_size: int, head_dim: int) -> str | None:
    """Why the Mosaic GPU kernel cannot serve this configuration (None: it can)."""
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"takes bf16 / f16 (wgmma), not {dtype}"
    if page_size % 8 or (64 % page_size and page_size % 64):
        return f"page_size {page_size} is not a multiple of 8 dividing 64 (or a multiple of 64)"
    if head_dim % 64:
        return f"head_dim {head_dim} is not a multiple of 64 (128-byte swizzle)"
    return None


def _block_kv(ps: int) -> int:
    return max(64, ps)


def _out_rows(g: Geometry) -> int:
    """Rows of the partial outputs: all padded rows, or (one query block) the real rows rounded to 8
    (32-byte TMA rows of the f32 lse)."""
    return g.Rp if g.num_q_blocks > 1 else -(-g.R // 8) * 8


def _body(g: Geometry, S: int, stages: int, dtype, interpret: bool, W: int, pair: bool, fresh: int | None,
          write_at: str, bounds_ref, pt_ref, q_ref, kv_ref, bits_ref, o_ref, lse_ref, scratch):
    """bounds_ref [B, 4], pt_ref [B, P] int32, q_ref [B, Hkv, Rp, D] (fresh: the pack
    [B, Hkv, Rp + 2 BK, D]), kv_ref [N, ps, 2, Hkv, D] (GMEM); o_ref [B, Hkv, S', R', D] f32, lse_ref
    [B, Hkv, S', R'] f32 (GMEM; R' = _out_rows; S' = S, or S + 1 with a fresh block).
    W > 0: a block of W entries from bounds_ref[b, 3] on, masked per query row by bits_ref
    [B, ceil(W / 32), Rp] int32 (pack_block_rows); W = 0: bits_ref is None.
    pair: the CTA's two warpgroups take the two query blocks ("wg" = the block) over the same key
    slabs, which warpgroup 0 loads once for both; a slot is refilled when both have read it.
    fresh (an int, `paged_attention_write_mosaic`): the call's own T tokens are the cache entries
    start + i, start = m + fresh (m = bounds_ref[b, 3]); their K / V rows come in the pack (rows Rp.. and
    Rp + BK..), not from the pages: the S page splits read the keys below start only, split S reads the
    fresh block as its one key block (keys start + c up to kend = bounds_ref[b, 0], masked by the block
    bits as any key of the block), and the CTAs of the (row, KV head) share the writes of the rows
    start + i < kend to their pages, which no CTA of this call reads unmasked."""
    plgpu = _plgpu()
    BQ, BK, ps = g.block_q, _block_kv(g.ps), g.ps
    ppb = BK // ps  # pages per key block
    b = lax.axis_index("row")
    h = lax.axis_index("head")
    if fresh is not None:
        *scratch, kvw, w_bar = scratch
    if pair:
        q_all, *mid, lse_all, q_bars, k_bar, v_bar, free_bar, done_bar = scratch
        # on the GPU the f32 outputs reuse the key slabs' SMEM once both warpgroups are done with them
        # (a RefUnion; the interpreter takes no aliased refs in copies, so there they are separate)
        (k_smem, v_smem), o_all = mid if len(mid) == 2 else mid[0]
        qb, s = lax.axis_index("wg"), lax.axis_index("qs")
        q_smem, o_smem, lse_smem, q_bar = q_all.at[qb], o_all.at[qb], lse_all.at[qb], q_bars.at[qb]
        t_lo, t_hi = 0, min((g.Rp - 1) // g.G, g.T - 1)  # the keys any row of the CTA sees
        lead = qb == 0
    else:
        q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar = scratch
        qs = lax.axis_index("qs")
        s, qb = lax.div(qs, g.num_q_blocks), lax.rem(qs, g.num_q_blocks)
        t_lo = lax.div(qb * BQ, g.G)
        t_hi = jnp.minimum(lax.div(qb * BQ + BQ - 1, g.G), g.T - 1)
        lead = True
    kend, diag, qpos = bounds_ref[b, 0], bounds_ref[b, 1], bounds_ref[b, 2]
    r0 = qb * BQ
    kend_pages = kend
    if fresh is not None:
        start = bounds_ref[b, 3] + fresh
        kend_pages = jnp.minimum(kend, start)
    lo, hi = key_range((kend_pages, diag, qpos), t_lo, t_hi, g.window)
    j0, j1 = split_range(lo, hi, BK, s, S)
    jend = j1
    if fresh is not None:
        own = s == S
        j1 = jnp.where(own, j0, j1)  # the fresh split: no page block,
        jend = j1 + own.astype(jnp.int32)  # and the fresh block as j = j0

    def issue_pages(j, slot):
        for i in range(ppb):
            page = pt_ref[b, jnp.minimum(j * ppb + i, g.P - 1)]
            rows = pl.ds(i * ps, ps)
            plgpu.copy_gmem_to_smem(kv_ref.at[page, :, 0, h], k_smem.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[page, :, 1, h], v_smem.at[slot, rows], v_bar.at[slot])

    def issue(j, slot):  # TMA the K and V slabs of key block j into `slot`
        if fresh is None:
            return issue_pages(j, slot)
        pl.when(j < j1)(lambda: issue_pages(j, slot))

        @pl.when(j >= j1)
        def _():  # the fresh block from the pack, in the same ppb pieces (the barriers count ppb arrivals)
            for i in range(ppb):
                rows = pl.ds(i * ps, ps)
                plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(g.Rp + i * ps, ps)], k_smem.at[slot, rows],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(g.Rp + BK + i * ps, ps)], v_smem.at[slot, rows],
                                        v_bar.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(r0, BQ)], q_smem, q_bar)
    for st in range(stages):
        @pl.when(jnp.logical_and(lead, j0 + st < jend))
        def _(st=st):
            issue(j0 + st, st)
    if fresh is not None:
        # the T fresh rows go to their pages by all (S + 1) * blocks CTAs of this (row, KV head), R = rows_per_cta
        # consecutive rows each (CTA c: rows c R .. c R + R - 1 below T), loaded as one R-row box per K and V (the
        # box starts at T - R at most, in the K / V regions of the pack): a few TMA stores each, after the key
        # loop or (write_at "start") before it. Measured per verify call on H100s against the kernel without a
        # fresh block: the first version (64 stores by one CTA, a page-table load per row) ~4 us longer, the
        # second (every CTA loaded all 64 K and V rows) ~2.4 us; causes not profiled. The rows, unswizzled,
        # and their pages load now
        cta = s * g.num_q_blocks + qb
        R = rows_per_cta(g, S)
        first = cta * R
        lo = jnp.minimum(first, max(g.T - R, 0))  # the box's first row
        writes = first < g.T

        @pl.when(writes)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(g.Rp + lo, R)], kvw.at[0], w_bar)
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(g.Rp + BK + lo, R)], kvw.at[1], w_bar)
        p0 = lax.div(start, ps)
        dest_pages = [pt_ref[b, jnp.minimum(p0 + j, g.P - 1)] for j in range(-(-g.T // ps) + 1)]

        def write_rows():  # no CTA of this call reads these slots from the pages unmasked (see the docstring)
            @pl.when(writes)
            def _():
                plgpu.barrier_wait(w_bar)
                for r in range(R):
                    i = first + r
                    pos = start + i
                    jrel = lax.div(pos, ps) - p0
                    page = dest_pages[0]
                    for j in range(1, len(dest_pages)):
                        page = jnp.where(jrel == j, dest_pages[j], page)

                    # tokens at or past kend (padding, rows without tokens) write nothing
                    @pl.when(jnp.logical_and(pos < kend, i < g.T))
                    def _(i=i, pos=pos, page=page):
                        for c in range(2):
                            plgpu.copy_smem_to_gmem(kvw.at[c, i - lo], kv_ref.at[page, lax.rem(pos, ps), c, h])
        if write_at == "start":  # the stores run beside the key loop (the final wait covers them)
            write_rows()
    plgpu.barrier_wait(q_bar)

    wg = plgpu.Layout.WGMMA
    if interpret:  # the interpreter has no register layouts (they do not change values)
        def iota(dim):
            return lax.broadcasted_iota(jnp.int32, (BQ, BK), dim)

        def cast(x, layout):
            return x
    else:
        def iota(dim):
            return plgpu.broadcasted_iota(jnp.int32, (BQ, BK), dim, layout=wg)
        cast = plgpu.layout_cast
    row = iota(0) + r0  # query row t * G + g
    col = iota(1)
    words = []  # the block mask bits of this CTA's query rows, broadcast along the keys
    for w in range(-(-W // 32)):
        if interpret:
            x = bits_ref[b, w, pl.ds(r0, BQ)]
        else:
            x = plgpu.load(bits_ref, (b, w, pl.ds(r0, BQ)), layout=wg.reduce(1), optimized=False)
        words.append(lax.broadcast_in_dim(x, (BQ, BK), [0]))
    m_blk = bounds_ref[b, 3]

    def step(j, carry):
        acc, m, l = carry
        slot = lax.rem(j - j0, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
            return acc_ref[...]

        if interpret:  # the interpreter's wgmma takes no transposed operand: the same product as a dot
            # (interpret mode checks the TMA page gathers, barriers, pipeline, bounds, masks and softmax;
            # the wgmma calls themselves are checked by lowering for CUDA and run on the GPU)
            sc = lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        else:
            sc = pl.run_scoped(qk, plgpu.ACC((BQ, BK), jnp.float32))
        sc = sc * g.scale
        if fresh is not None:  # the fresh block's keys are start + c, visible below kend; the pages' below start
            is_new = j >= j1
            kidx = col + jnp.where(is_new, start, j * BK)
            ok = visible(kidx, row, (jnp.where(is_new, kend, kend_pages), diag, qpos), g.G, g.window)
        else:
            kidx = col + j * BK
            ok = visible(kidx, row, (kend, diag, qpos), g.G, g.window)
        if W:
            ok = ok & visible_block(kidx, m_blk, W, words)
        sc = jnp.where(ok, sc, NEG)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.where(ok, jnp.exp(sc - lax.broadcast_in_dim(m_new, sc.shape, [0])), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=1)
        plgpu.barrier_wait(v_bar.at[slot])

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
            return acc_ref[...]  # waits for the wgmma: the slot is free

        if interpret:  # the interpreter's wgmma takes no register operand: the same product as a dot
            pv_out = jnp.dot(p.astype(dtype), v_smem[slot], preferred_element_type=jnp.float32)
        else:
            pv_out = pl.run_scoped(pv, plgpu.ACC((BQ, g.D), jnp.float32))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out
        if pair:
            plgpu.barrier_arrive(free_bar.at[slot])  # this warpgroup is done with the slot

        @pl.when(jnp.logical_and(lead, j + stages < jend))
        def _():
            if pair:
                plgpu.barrier_wait(free_bar.at[slot])  # and so is the other one
            issue(j + stages, slot)

        return acc, m_new, l

    acc = cast(jnp.zeros((BQ, g.D), jnp.float32), wg)
    m = cast(jnp.full((BQ,), NEG, jnp.float32), wg.reduce(1))
    l = cast(jnp.zeros((BQ,), jnp.float32), wg.reduce(1))
    acc, m, l = lax.fori_loop(j0, jend, step, (acc, m, l))
    if fresh is not None and write_at == "end":
        write_rows()
    if pair:  # the outputs overwrite the key slabs: both warpgroups must be past their last read
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)
    live = l > 0.0
    safe = jnp.where(live, l, 1.0)
    o_smem[...] = acc / lax.broadcast_in_dim(safe, acc.shape, [0])
    lse_smem[...] = jnp.where(live, m + jnp.log(safe), -jnp.inf)
    plgpu.commit_smem()
    n = min(BQ, _out_rows(g))  # static: a whole block, or the real rows of the only one
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, n)], o_ref.at[b, h, s, pl.ds(r0, n)])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, n)], lse_ref.at[b, h, s, pl.ds(r0, n)])
    plgpu.wait_smem_to_gmem(0)


def rows_per_cta(g: Geometry, S: int) -> int:
    """Fresh rows each CTA of a (row, KV head) writes (the write kernel: S page splits + the fresh one)."""
    return -(-g.T // ((S + 1) * g.num_q_blocks))


def auto_splits(g: Geometry, target_ctas: int = TARGET_CTAS, max_splits: int | None = None) -> int:
    """Splits of each row's key range so that about target_ctas CTAs run (2 per SM on an H100 /
    H200: 112 KiB of SMEM each at 2 stages and 64 query rows), at most max_splits (None:
    MAX_SPLITS). Independent of the capacity: a split beyond a row's live blocks exits at once, and
    the partials written do not grow with max_seq_len; but each split costs the combine, so a
    caller that knows its rows are short passes a lower max_splits (specjax.attention.split_cap)."""
    ctas = g.B * g.Hkv * g.num_q_blocks  # a paired CTA counts twice: it holds two blocks' work
    return int(max(1, min(-(-target_ctas // max(ctas, 1)), max_splits or MAX_SPLITS)))


def can_pair(g: Geometry) -> bool:
    """Two 64-row query blocks: one CTA of two warpgroups can take them over the same key slabs."""
    return g.num_q_blocks == 2 and g.block_q == 64


def auto_pair(g: Geometry) -> bool:
    """Pair the two blocks where one CTA per block would not fit the GPU at once (the 8B shape's
    17-node tree at batch 32: 512 CTAs for ~264 places; paired, each key slab is read once and the
    verify attention took 2.23 instead of 3.17 ms per step on an H200, docs/benchmarks.md). Below
    that (batch 1) the unpaired layout stays: it is the one measured in the engine's step (verify /
    decode 1.16); the kernel sweeps disagreed on pairing there (slower once, faster once)."""
    return can_pair(g) and g.B * g.Hkv * 2 > TARGET_CTAS


def _paged(qg, kv_pages, page_table, bounds, g: Geometry, *, num_splits, stages: int, interpret: bool, bits=None,
           W: int = 0, pair: bool = False, max_splits: int | None = None, fresh: int | None = None,
           write_at: str = "end"):
    """fresh (an int: the call's tokens start at m + fresh): qg is the pack, kv_pages a mutable GMEM ref that
    the kernel writes (`_body`)."""
    plgpu = _plgpu()
    dtype = qg.dtype
    extra = int(fresh is not None)  # the fresh block's split
    if extra and (pair or not W):
        raise ValueError("paged_attention_mosaic: the fresh block needs unpaired query blocks and a block mask")
    S = num_splits or auto_splits(g, max_splits=max_splits)
    BQ, BK = g.block_q, _block_kv(g.ps)
    swz = 128
    tr = (plgpu.TilingTransform((8, swz // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swz))
    kv = [plgpu.SMEM((stages, BK, g.D), dtype, transforms=tr), plgpu.SMEM((stages, BK, g.D), dtype, transforms=tr)]
    tma_bars = [plgpu.Barrier(num_arrivals=BK // g.ps, num_barriers=stages)] * 2
    if pair:  # two warpgroups, one per query block; the f32 outputs reuse the key slabs' SMEM
        scratch = [plgpu.SMEM((2, BQ, g.D), dtype, transforms=tr),
                   *([tuple(kv), plgpu.SMEM((2, BQ, g.D), jnp.float32)] if interpret else
                     [plgpu.RefUnion(tuple(kv), plgpu.SMEM((2, BQ, g.D), jnp.float32))]),
                   plgpu.SMEM((2, BQ), jnp.float32),
                   plgpu.Barrier(num_arrivals=1, num_barriers=2), *tma_bars,
                   plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_arrivals=2)]
        grid, threads = (g.B, g.Hkv, S), dict(num_threads=2, thread_name="wg")
        scoped = dict(collective_axes="wg")
    else:
        scratch = [plgpu.SMEM((BQ, g.D), dtype, transforms=tr), *kv, plgpu.SMEM((BQ, g.D), jnp.float32),
                   plgpu.SMEM((BQ,), jnp.float32), plgpu.Barrier(num_arrivals=1), *tma_bars]
        grid, threads, scoped = (g.B, g.Hkv, g.num_q_blocks * (S + extra)), {}, {}
    if extra:  # the fresh K / V rows unswizzled (row copies to the pages) and their barrier
        scratch += [plgpu.SMEM((2, rows_per_cta(g, S), g.D), dtype), plgpu.Barrier(num_arrivals=2)]

    def entry(bounds_ref, pt_ref, q_ref, kv_ref, *rest):
        rest = list(rest)
        bits_ref = rest.pop(0) if W else None
        o_ref, lse_ref = rest
        pl.run_scoped(lambda *sc: _body(g, S, stages, dtype, interpret, W, pair, fresh, write_at, bounds_ref,
                                        pt_ref, q_ref, kv_ref, bits_ref, o_ref, lse_ref, sc), *scratch, **scoped)

    kw = {} if not interpret else {"interpret": interpret_params("paged_attention_mosaic")}
    Sp = S + extra
    o, lse = pl.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct((g.B, g.Hkv, Sp, _out_rows(g), g.D), jnp.float32),
                  jax.ShapeDtypeStruct((g.B, g.Hkv, Sp, _out_rows(g)), jnp.float32)],
        mesh=plgpu.Mesh(grid=grid, grid_names=("row", "head", "qs"), **threads),
        name="paged_attention_mosaic",
        **kw,
    )(bounds, page_table, qg, kv_pages, *([bits] if W else []))
    return o, lse


def paged_attention_mosaic(q, kv_pages, page_table, q_start, kv_len, block_mask=None, *, sliding_window=None,
                           scale=None, mask_start=None, num_splits: int | None = None, stages: int = 2,
                           block_q: int | None = None, block_kv: int | None = None, interpret: bool = False,
                           block_in_kernel: bool = True, pair_blocks: bool | None = None,
                           max_splits: int | None = None):
    """Same contract as `paged_attention_reference`, as a Mosaic GPU kernel (Hopper) that reads
    only the live key blocks of each row. num_splits: splits of each row's key range (None: about
    two CTAs per SM, see auto_splits, at most max_splits); stages: key blocks in flight per CTA; block_q: 64 or 128
    query rows per CTA (None: 64 up to 128 rows per KV head (a 17-node tree: two CTAs), else 128); block_kv is
    max(64, page_size) (other values are an error); interpret: run in the Mosaic GPU interpreter
    on CPU (slow; for tests). block_in_kernel: a block mask (tree verify, draft growth) is applied
    inside the kernel, which reads the block entries from their pages like the prefix (False: the
    shared dense block_partial + combine in XLA: SmolLM2's fused step ran 754 instead of 620 kernels).
    pair_blocks: two 64-row query blocks (e.g. a 17-node tree with G = 4) in one CTA of two
    warpgroups that read each key slab once (None: `auto_pair`, where one CTA per block would not
    fit the GPU at once; False: one CTA per block, sharing the pages through L2)."""
    g = _checked_geometry("paged_attention_mosaic", q, kv_pages, page_table, block_q, block_kv, sliding_window,
                          scale)
    if pair_blocks and not can_pair(g):
        raise ValueError(f"paged_attention_mosaic: pair_blocks needs two 64-row query blocks, got {g.R} rows "
                         f"in blocks of {g.block_q}")
    pair = auto_pair(g) if pair_blocks is None else bool(pair_blocks)
    fn = functools.partial(_paged, num_splits=num_splits, stages=stages, interpret=interpret, pair=pair,
                           max_splits=max_splits)
    if block_mask is None or not block_in_kernel:
        return run_paged(fn, q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, g)
    bounds = block_bounds(q_start, kv_len, mask_start, g)
    o, lse = fn(group_queries(q, g), kv_pages, page_table.astype(jnp.int32), bounds, g,
                bits=pack_block_rows(block_mask, g), W=block_mask.shape[2])
    return ungroup(combine([(o[:, :, :, : g.R], lse[:, :, :, : g.R])]), g, q.dtype)


def _checked_geometry(name: str, q, kv_pages, page_table, block_q, block_kv, sliding_window, scale) -> Geometry:
    why = why_not_mosaic(q.dtype, kv_pages.shape[1], q.shape[3])
    if why is not None:
        raise ValueError(f"{name}: {why}")
    if block_q not in (None,) + BLOCK_QS or block_kv not in (None, _block_kv(kv_pages.shape[1])):
        raise ValueError(f"{name}: block_q is one of {BLOCK_QS} and block_kv max(64, page_size); "
                         f"got block_q={block_q}, block_kv={block_kv}")
    return geometry(q, kv_pages, page_table, block_q or _default_block_q(q, kv_pages), sliding_window, scale)


def _default_block_q(q, kv_pages) -> int:
    return 64 if q.shape[1] * (q.shape[2] // kv_pages.shape[3]) <= 128 else 128  # 17-node verify: 2 x 64


def why_not_write(q, kv_pages, page_table, block_mask, block_q: int | None = None) -> str | None:
    """Why `paged_attention_write_mosaic` cannot take this call (None: it can); shapes only."""
    g = geometry(q, kv_pages, page_table, block_q or _default_block_q(q, kv_pages), None, None)
    return _why_not_write(g, block_mask, auto_pair(g))


def _why_not_write(g: Geometry, block_mask, pair: bool) -> str | None:
    if block_mask is None:
        return "causal calls (prefill, decode) keep the scatter: the fresh block is a block-masked call's"
    if block_mask.shape[1] != g.T:
        return f"block_mask {tuple(block_mask.shape)} is not [B, T = {g.T}, W]"
    if g.T > _block_kv(g.ps):
        return f"{g.T} new tokens do not fit one key block of {_block_kv(g.ps)}"
    if pair:
        return "paired query blocks take no fresh block"
    return None


def paged_attention_write_mosaic(q, k_new, v_new, kv_pages, page_table, q_start, kv_len, block_mask, *,
                                 sliding_window=None, scale=None, mask_start=None, offset: int | None = None,
                                 num_splits: int | None = None, stages: int = 2, block_q: int | None = None,
                                 block_kv: int | None = None, interpret: bool = False, max_splits: int | None = None,
                                 write_at: str = "end"):
    """One kernel for a block-masked call (tree verify, draft growth) that writes its new tokens' K / V
    (k_new, v_new [B, T, Hkv, D]) to the pages, token i at cache entry q_start + i where that is below
    kv_len (nothing for the others), and then attends as `paged_attention_mosaic`: the same values as
    write_kv at the meta's indices (kv_cache.write_indices) then the attention. The new keys come from this
    call's array (one more split; `_body`, fresh), the pages give the keys below q_start; XLA's scatter
    (a kernel of its own per layer) is gone. offset (static): q_start - mask_start, the same for every row
    (0 without mask_start; a draft level's s * k): the kernel finds the tokens' place from the bounds that
    all calls with the same mask_start share. Returns (o [B, T, H, D], kv_pages). Calls that `why_not_write`
    refuses raise a ValueError (the dispatch point asks it first). write_at: "end" (the rows are stored after
    each CTA's key loop) or "start" (before it, the stores in flight during the loop): the same pages."""
    g = _checked_geometry("paged_attention_write_mosaic", q, kv_pages, page_table, block_q, block_kv,
                          sliding_window, scale)
    why = _why_not_write(g, block_mask, auto_pair(g))
    if why is not None:
        raise ValueError(f"paged_attention_write_mosaic: {why}")
    if k_new.shape != (g.B, g.T, g.Hkv, g.D) or v_new.shape != k_new.shape:
        raise ValueError(f"paged_attention_write_mosaic: k_new / v_new {tuple(k_new.shape)} / {tuple(v_new.shape)} "
                         f"must be [B, T, Hkv, D] = {(g.B, g.T, g.Hkv, g.D)}")
    if mask_start is None:  # the block starts at q_start
        offset = 0 if offset is None else offset
        if offset != 0:
            raise ValueError(f"paged_attention_write_mosaic: without mask_start the offset is 0, got {offset!r}")
    if offset is None or not 0 <= offset <= block_mask.shape[2]:
        raise ValueError(f"paged_attention_write_mosaic: offset = q_start - mask_start must be a static int in "
                         f"[0, W = {block_mask.shape[2]}], got {offset!r}")
    if write_at not in WRITE_AT:
        raise ValueError(f"paged_attention_write_mosaic: write_at is one of {WRITE_AT}, got {write_at!r}")
    BK = _block_kv(g.ps)
    dtype = kv_pages.dtype

    def rows(x):  # [B, T, Hkv, D] -> [B, Hkv, BK, D], zero rows past T (finite: their p is 0)
        return jnp.pad(x.astype(dtype).transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, BK - g.T), (0, 0)))
    pack = jnp.concatenate([group_queries(q, g).astype(dtype), rows(k_new), rows(v_new)], axis=2)
    kv_ref = jax.new_ref(kv_pages, memory_space=_plgpu().GMEM)
    o, lse = _paged(pack, kv_ref, page_table.astype(jnp.int32), block_bounds(q_start, kv_len, mask_start, g), g,
                    num_splits=num_splits, stages=stages, interpret=interpret, max_splits=max_splits,
                    bits=pack_block_rows(block_mask, g), W=block_mask.shape[2], fresh=offset, write_at=write_at)
    out = ungroup(combine([(o[:, :, :, : g.R], lse[:, :, :, : g.R])]), g, q.dtype)
    return out, kv_ref[...]
