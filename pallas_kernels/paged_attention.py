"""Attention of new query tokens over a paged KV cache: the contract, the jnp reference and the
plumbing shared by the kernels that read only live pages.

`paged_attention_reference` is the pure-jnp definition (it gathers every page of every row: its
cost grows with the capacity); the kernels have the same signature and read only the pages a row's
queries can see (`specjax.attention` is the one dispatch point):

  * `paged_attention_pallas` (pallas_kernels/paged_attention_pallas.py): generic `pallas_call`
    (Triton on GPU, the Pallas interpreter on CPU);
  * `paged_attention_mosaic` (pallas_kernels/paged_attention_mosaic.py): Mosaic GPU (Hopper: TMA
    page copies into swizzled SMEM, wgmma);
  * `paged_attention_tpu` (pallas_kernels/paged_attention_tpu.py): Mosaic TPU (scalar-prefetched
    page table, double-buffered page DMAs into VMEM).

Visibility rule (cache index k, row b, new token i; m = mask_start[b], q_start[b] when None):
  k < m                                           -> visible (prefix)
  m <= k < m + W                                  -> block_mask[b, i, k - m]   (block_mask [B, T, W])
                                                     (causal k - m <= i when block_mask is None)
  k >= kv_len[b]                                  -> never
  sliding window w                                -> additionally q_start[b] + i - k < w
A draft tree grown step by step uses mask_start < q_start: the new nodes see the committed prefix
and, of the tree entries written by earlier steps, only their own ancestors.
Queries that see no key (padding tokens, empty rows) have an unspecified output (the reference
averages every value; the kernels return zeros).

How the kernels split the work (data flow of one call):

    q [B, T, H, D] -> group_queries -> [B, Hkv, Rp, D]    rows r = t * G + g (G = H // Hkv query heads
                                                          per KV head: each KV page is read once for all
                                                          G heads and all T tokens of a row)
    row_bounds -> [B, 4] int32 (kend, diag, qpos, 0)      paged key k is visible to token t iff
                                                          k < kend and k <= diag + t (and the window)
    kernel: grid (row, KV head, query block, split)       loops over the row's live key blocks only;
         -> o [B, Hkv, S, R', D] f32, lse [B, Hkv, S, R']  a split (flash-decoding) takes one share of them
            (R' >= R rows; the padding rows are dropped)
    block_partial (block_mask given): the W masked block  -> one more (o, lse) partial, dense in jnp
         entries m .. m + W - 1 (tree nodes, W small)
    combine: softmax-weighted sum of the partials -> ungroup -> [B, T, H, D]

With a block mask the pages cover only the prefix k < m (every prefix entry is visible to every
query), so the kernels never gather a mask; the tree part is W <= a few dozen entries per row.
The Mosaic GPU kernel instead reads the block entries from their pages too and masks them in the
kernel (`block_bounds` + `pack_block_rows` + `visible_block`: the block mask packed to 32-bit words
per query row), which saves block_partial's and combine's small XLA kernels (SmolLM2's fused step on
an H200: 754 -> 620 kernels, docs/benchmarks.md).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

NEG = -1e30  # masked score (finite: an all-masked block must not produce NaN)


def visibility_mask(q_start, kv_len, S: int, T: int, block_mask=None, sliding_window=None, mask_start=None):
    """[B, T, S] bool mask over gathered cache entries."""
    k_idx = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    i = jnp.arange(T, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
    start = q_start[:, None, None]
    m0 = start if mask_start is None else mask_start[:, None, None]
    rel = k_idx - m0  # position of key inside the masked block
    if block_mask is None:
        in_block = rel <= i
    else:
        W = block_mask.shape[2]
        rel_c = jnp.clip(rel, 0, W - 1)
        in_block = jnp.take_along_axis(block_mask, jnp.broadcast_to(rel_c, block_mask.shape[:2] + (S,)), axis=2)
        in_block &= rel < W
    mask = jnp.where(rel < 0, True, in_block) & (k_idx < kv_len[:, None, None])
    if sliding_window is not None:
        mask &= (start + i - k_idx) < sliding_window
    return mask


def gather_kv(kv_pages, page_table):
    """kv_pages [N, page_size, 2, Hkv, D], page_table [B, P] -> k, v: [B, P * page_size, Hkv, D]."""
    B, P = page_table.shape
    _, ps, _, Hkv, D = kv_pages.shape
    kv = kv_pages[page_table].reshape(B, P * ps, 2, Hkv, D)  # one gather for K and V
    return kv[:, :, 0], kv[:, :, 1]


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # no TF32 for f32 on GPU


def paged_attention_reference(q, kv_pages, page_table, q_start, kv_len, block_mask=None,
                              *, sliding_window=None, scale=None, mask_start=None):
    """q: [B, T, H, D]; kv_pages: [N, page_size, 2, Hkv, D] (K then V); page_table: [B, P] int32;
    q_start, kv_len: [B] int32; block_mask: [B, T, W] bool or None; mask_start: [B] int32 or None.
    Returns [B, T, H, D]."""
    B, T, H, D = q.shape
    Hkv = kv_pages.shape[3]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    k, v = gather_kv(kv_pages, page_table)  # [B, S, Hkv, D]
    S = k.shape[1]
    qg = q.reshape(B, T, Hkv, G, D)
    prec = _precision(q.dtype)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=prec, preferred_element_type=jnp.float32) * scale
    mask = visibility_mask(q_start, kv_len, S, T, block_mask, sliding_window, mask_start)  # [B, T, S]
    s = jnp.where(mask[:, None, None], s, NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    return o.reshape(B, T, H, D).astype(q.dtype)


# ----------------------------------------------------------------------------- shared by the kernels

@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static facts of one call that every kernel needs."""
    B: int  # rows
    T: int  # new tokens per row
    H: int  # query heads
    Hkv: int  # KV heads
    D: int  # head dim
    P: int  # page-table columns per row
    ps: int  # page size
    block_q: int  # query rows (t * G + g) per program
    window: int | None  # sliding window (None: off)
    scale: float

    @property
    def G(self) -> int:
        return self.H // self.Hkv

    @property
    def R(self) -> int:  # query rows per (row, KV head)
        return self.T * self.G

    @property
    def num_q_blocks(self) -> int:
        return -(-self.R // self.block_q)

    @property
    def Rp(self) -> int:  # rows padded to whole query blocks
        return self.num_q_blocks * self.block_q

    @property
    def capacity(self) -> int:
        return self.P * self.ps


def geometry(q, kv_pages, page_table, block_q: int, sliding_window, scale) -> Geometry:
    B, T, H, D = q.shape
    N, ps, two, Hkv, Dk = kv_pages.shape
    if two != 2 or Dk != D or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_pages {tuple(kv_pages.shape)} "
                         "([N, page_size, 2, Hkv, D] with H a multiple of Hkv)")
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table must be [B={B}, P], got {tuple(page_table.shape)}")
    return Geometry(B=B, T=T, H=H, Hkv=Hkv, D=D, P=page_table.shape[1], ps=ps, block_q=block_q,
                    window=sliding_window, scale=float(D ** -0.5 if scale is None else scale))


def group_queries(q, g: Geometry):
    """q [B, T, H, D] -> [B, Hkv, Rp, D]: the T * G query rows of each KV head, t-major, zero padded."""
    x = q.reshape(g.B, g.T, g.Hkv, g.G, g.D).transpose(0, 2, 1, 3, 4).reshape(g.B, g.Hkv, g.R, g.D)
    return jnp.pad(x, ((0, 0), (0, 0), (0, g.Rp - g.R), (0, 0)))


def ungroup(o, g: Geometry, dtype):
    """[B, Hkv, R (or more), D] -> [B, T, H, D]."""
    o = o[:, :, : g.R].reshape(g.B, g.Hkv, g.T, g.G, g.D).transpose(0, 2, 1, 3, 4)
    return o.reshape(g.B, g.T, g.H, g.D).astype(dtype)


def row_bounds(q_start, kv_len, mask_start, has_block: bool, g: Geometry):
    """[B, 4] int32 (kend, diag, qpos, 0): paged key k is visible to token t iff k < kend,
    k <= diag + t and (window) qpos + t - k < window. With a block mask the pages cover only the
    prefix below m (the block entries go through block_partial)."""
    q_start = q_start.astype(jnp.int32)
    m = q_start if mask_start is None else mask_start.astype(jnp.int32)
    kend = jnp.clip(kv_len.astype(jnp.int32), 0, g.capacity)
    if has_block:
        kend = jnp.minimum(kend, jnp.maximum(m, 0))
        diag = jnp.full_like(kend, g.capacity)  # every prefix key is visible to every token
    else:
        diag = m
    return jnp.stack([kend, diag, q_start, jnp.zeros_like(kend)], axis=1)


def block_bounds(q_start, kv_len, mask_start, g: Geometry):
    """[B, 4] int32 (kend, diag, qpos, m) for a kernel that masks the block entries itself: the keys
    [0, kv_len) are read from the pages, the prefix k < m is visible to every token and a key
    m <= k < m + W is visible to token t iff block_mask[b, t, k - m] (`visible_block`)."""
    q_start = q_start.astype(jnp.int32)
    m = q_start if mask_start is None else mask_start.astype(jnp.int32)
    kend = jnp.clip(kv_len.astype(jnp.int32), 0, g.capacity)
    diag = jnp.full_like(kend, g.capacity)
    qpos = q_start if g.window is not None else m  # read only with a window: calls that differ only in
    # q_start (the levels of a draft tree) share one bounds array (one kernel on a GPU instead of one each)
    return jnp.stack([kend, diag, qpos, m], axis=1)


def pack_block_rows(block_mask, g: Geometry):
    """block_mask [B, T, W] -> [B, NW, Rp] int32, NW = ceil(W / 32): bit w % 32 of word w // 32 of query
    row r = t * G + g is block_mask[b, t, w] (rows past R are zero). The rows are laid out and padded
    before the bits are summed, so that XLA makes one reduction kernel of it (packing, then broadcasting
    and padding the words, was two kernels per attention call; 32 bits x 64 rows is still tiny)."""
    B, T, W = block_mask.shape
    nw = -(-W // 32)
    rows = jnp.broadcast_to(block_mask.astype(bool)[:, :, None, :], (B, T, g.G, W)).reshape(B, g.R, W)
    rows = jnp.pad(rows, ((0, 0), (0, g.Rp - g.R), (0, nw * 32 - W)))  # [B, Rp, NW * 32]
    bits = rows.reshape(B, g.Rp, nw, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)  # [B, Rp, NW]
    return words.transpose(0, 2, 1)  # NW = 1 (trees up to 33 entries): a bitcast


def visible_block(kidx, m, W: int, words):
    """Kernel-side block mask: keys kidx [BQ, BK] int32 below m are visible (the prefix); m <= k < m + W
    iff their bit is set in words[(k - m) // 32] ([BQ, BK] int32 each: the query row's packed words,
    broadcast along the keys); keys at m + W and beyond are not. Shifts and masks only."""
    rel = kidx - m
    bit = jnp.zeros_like(rel)
    idx = rel & 31
    word = jax.lax.shift_right_arithmetic(rel, jnp.full_like(rel, 5))
    for w, x in enumerate(words):
        bit = bit | jnp.where(word == w, jax.lax.shift_right_logical(x, idx), 0)
    return (rel < 0) | ((rel < W) & ((bit & 1) == 1))


def key_range(bounds_b, t_lo, t_hi, window):
    """[lo, hi) of the keys a query block (tokens t_lo..t_hi) of one row can see; scalars inside a
    kernel. bounds_b = (kend, diag, qpos)."""
    kend, diag, qpos = bounds_b
    hi = jnp.minimum(kend, diag + t_hi + 1)
    lo = jnp.int32(0) if window is None else jnp.maximum(qpos + t_lo - window + 1, 0)
    return lo, jnp.maximum(hi, lo)


def visible(kidx, row, bounds_b, G: int, window):
    """Kernel-side mask of keys kidx [1, BK] (or [BQ, BK]) for query rows row = t * G + g [BQ, 1]
    (or [BQ, BK]). Division-free (Mosaic GPU register arrays have no integer division): for r >= 0,
    x <= floor(r / G) <=> x * G <= r and floor(r / G) < y <=> r < y * G, so
        k <= diag + t            <=> (k - diag) * G <= r
        qpos + t - k < window    <=> r < (k - qpos + window) * G."""
    kend, diag, qpos = bounds_b
    ok = (kidx < kend) & ((kidx - diag) * G <= row)
    if window is not None:
        ok = ok & (row < (kidx - qpos + window) * G)
    return ok


def split_range(lo, hi, block: int, s, num_splits: int):
    """Key blocks [j0, j1) of split s when the blocks covering keys [lo, hi) are shared evenly."""
    div = jax.lax.div  # operands are >= 0: truncation == floor (and no sign op for Mosaic TPU)
    jlo = div(lo, block)
    n = jnp.maximum(div(hi + block - 1, block) - jlo, 0)
    per = div(n + num_splits - 1, num_splits)
    j0 = jlo + s * per
    return j0, jnp.minimum(jlo + n, j0 + per)


def block_partial(q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, g: Geometry):
    """(o [B, Hkv, 1, R, D] f32, lse [B, Hkv, 1, R]) of the W block entries m .. m + W - 1, dense."""
    W = block_mask.shape[2]
    m = (q_start if mask_start is None else mask_start).astype(jnp.int32)
    pos = m[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]  # [B, W] cache index of block entry j
    col = jnp.clip(pos // g.ps, 0, g.P - 1)
    page = jnp.take_along_axis(page_table, col, axis=1)
    kv = kv_pages[page, pos % g.ps]  # [B, W, 2, Hkv, D]
    k, v = kv[:, :, 0], kv[:, :, 1]
    t = jnp.arange(g.T, dtype=jnp.int32)[None, :, None]
    vis = block_mask.astype(bool) & ((pos < kv_len[:, None]) & (pos < g.capacity))[:, None, :]  # [B, T, W]
    if g.window is not None:
        vis &= (q_start[:, None, None] + t - pos[:, None, :]) < g.window
    prec = _precision(q.dtype)
    qg = q.reshape(g.B, g.T, g.Hkv, g.G, g.D)
    s = jnp.einsum("btkgd,bwkd->bktgw", qg, k, precision=prec, preferred_element_type=jnp.float32) * g.scale
    vis = vis[:, None, :, None, :]  # [B, 1, T, 1, W]
    s = jnp.where(vis, s, NEG)
    mx = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - mx), 0.0)
    l = jnp.sum(p, axis=-1)  # [B, Hkv, T, G]
    o = jnp.einsum("bktgw,bwkd->bktgd", p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, mx[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.reshape(g.B, g.Hkv, 1, g.R, g.D), lse.reshape(g.B, g.Hkv, 1, g.R)


def combine(parts):
    """Partials [(o [B, Hkv, S_i, R, D] f32, lse [B, Hkv, S_i, R])] -> [B, Hkv, R, D] f32: the
    softmax-weighted sum (rows that saw nothing anywhere: zeros).

    Written as a sum over the S splits unrolled (elementwise only) rather than reductions over the
    split axis: XLA then fuses the combine into one or two loop fusions with the ungrouping that
    follows, where max / sum / weighted-sum reductions were three more kernels per attention call.
    Measured on an H200 (docs/benchmarks.md, 2026-11-26 evening): SmolLM2's fused 5/4/16 step at
    batch 1 went from 619.8 to 554.8 kernels and 1 507 to 1 426 us of device time."""
    o = jnp.concatenate([p[0] for p in parts], axis=2)
    lse = jnp.concatenate([p[1] for p in parts], axis=2)
    S = o.shape[2]
    if S == 1:
        return o[:, :, 0]
    ls = [lse[:, :, s] for s in range(S)]  # S x [B, Hkv, R]
    top = functools.reduce(jnp.maximum, ls)
    top = jnp.where(top > -jnp.inf, top, 0.0)
    ws = [jnp.where(x > -jnp.inf, jnp.exp(x - top), 0.0) for x in ls]  # a split that saw nothing: 0
    tot = functools.reduce(jnp.add, ws)
    out = functools.reduce(jnp.add, [w[..., None] * o[:, :, s] for s, w in enumerate(ws)])  # [B, Hkv, R, D]
    return out / jnp.where(tot > 0, tot, 1.0)[..., None]


def run_paged(paged_fn, q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, g: Geometry):
    """The common driver: group queries, run paged_fn(qg, kv_pages, page_table, bounds, g) -> partials
    (o [B, Hkv, S, R', D] f32, lse [B, Hkv, S, R'], R' >= R rows), add the dense block part,
    combine, ungroup."""
    qg = group_queries(q, g)
    bounds = row_bounds(q_start, kv_len, mask_start, block_mask is not None, g)
    o, lse = paged_fn(qg, kv_pages, page_table.astype(jnp.int32), bounds, g)
    parts = [(o[:, :, :, : g.R], lse[:, :, :, : g.R])]
    if block_mask is not None:
        parts.append(block_partial(q, kv_pages, page_table, q_start, kv_len, block_mask, mask_start, g))
    return ungroup(combine(parts), g, q.dtype)
