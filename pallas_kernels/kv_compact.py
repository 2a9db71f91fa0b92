"""Compaction of an accepted draft path inside a paged KV cache.

Speculative decoding writes the K/V of a draft tree's N nodes to cache indices start[b] + n
(node n = 0..N-1; node 0 is the root, the last accepted token). After verification, the accepted
path accept_idx[b, 0..num_accepted[b]-1] (node indices, strictly increasing, accept_idx[b, j] >= j)
must end up contiguous:

    cache[b, start[b] + j] <- cache[b, start[b] + accept_idx[b, j]]      for j < num_accepted[b]

Cache index i of row b lives at page page_table[b, i // page_size], offset i % page_size.
Entries past the path keep whatever they held (garbage). A move is skipped (no write at all) when

  * j >= num_accepted[b] (padding, usually accept_idx == -1),
  * accept_idx[b, j] < 0,
  * source or destination lies past the row's capacity (P * page_size),
  * source == destination (accept_idx[b, j] == j: nothing to do).

All sources of a row are read before any destination is written, so overlapping source and
destination ranges are safe. (Because accept_idx[b, j] >= j and it is strictly increasing, even the
in-order "read j, write j" sequence would be safe, like a forward memmove.)

`kv_compact_reference` is the pure-jnp definition (one gather + one scatter per layer);
`kv_compact_pallas` is a Pallas kernel with the same signature that updates the pages in place
(input_output_aliases; the caller should donate the pages); `kv_compact` validates and dispatches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

__all__ = ["kv_compact", "kv_compact_reference", "kv_compact_pallas", "compact_moves"]


def compact_moves(page_table, start, accept_idx, num_accepted, page_size: int):
    """Flat (page * page_size + offset) source / destination indices of every move.

    page_table: [B, P] int32; start: [B] int32; accept_idx: [B, A] int32; num_accepted: [B] int32.
    Returns (src [B, A] int32, dst [B, A] int32, valid [B, A] bool). Invalid moves (see the module
    docstring) have valid == False and clipped, in-range src / dst.
    """
    B, P = page_table.shape
    A = accept_idx.shape[1]
    cap = P * page_size
    j = jnp.arange(A, dtype=jnp.int32)[None, :]  # [1, A]
    start = start.astype(jnp.int32)[:, None]  # [B, 1]
    acc = accept_idx.astype(jnp.int32)  # [B, A]
    src_pos = start + acc  # [B, A] cache position of the source node
    dst_pos = start + j  # [B, A] cache position it moves to
    valid = ((j < num_accepted.astype(jnp.int32)[:, None]) & (acc >= 0) & (acc != j)
             & (start >= 0) & (src_pos < cap) & (dst_pos < cap))

    def flat(pos):
        pos = jnp.clip(pos, 0, cap - 1)
        page = jnp.take_along_axis(page_table.astype(jnp.int32), pos // page_size, axis=1)
        return page * page_size + pos % page_size

    return flat(src_pos), flat(dst_pos), valid


def kv_compact_reference(k_pages, v_pages, page_table, start, accept_idx, num_accepted):
    """k_pages, v_pages: lists (one per layer) of [N, page_size, Hkv, D]; page_table: [B, P] int32;
    start: [B] int32; accept_idx: [B, A] int32 (node indices, -1 padded); num_accepted: [B] int32.
    Returns (k_pages, v_pages), new lists with cache[start + j] <- cache[start + accept_idx[j]]."""
    n, ps, hkv, d = k_pages[0].shape
    src, dst, valid = compact_moves(page_table, start, accept_idx, num_accepted, ps)
    src = src.reshape(-1)  # [B * A]
    dst = jnp.where(valid, dst, n * ps).reshape(-1)  # out of bounds -> dropped by the scatter

    def move(pages):
        flat = pages.reshape(n * ps, hkv, d)
        vals = flat[src]  # [B * A, Hkv, D]: every source gathered before any write
        return flat.at[dst].set(vals, mode="drop", unique_indices=False).reshape(n, ps, hkv, d)

    return [move(k) for k in k_pages], [move(v) for v in v_pages]


def _compact_kernel(L: int, A: int, ps: int, pt_ref, start_ref, acc_ref, nacc_ref, *refs):
    """One grid program per batch row b. refs = 2L aliased input pages (unused: their current
    contents are read through the outputs) followed by the 2L output pages [N, ps, Hkv, D]."""
    out_refs = refs[2 * L:]
    b = pl.program_id(0)
    P = pt_ref.shape[1]
    cap = P * ps
    st = start_ref[b]
    nacc = nacc_ref[b]

    moves = []
    for j in range(A):  # A is small (tree depth); unrolled
        a = acc_ref[b, j]
        sp, dp = st + a, st + j
        ok = (j < nacc) & (a >= 0) & (a != j) & (st >= 0) & (sp < cap) & (dp < cap)
        sp = jnp.clip(sp, 0, cap - 1)
        dp = jnp.clip(dp, 0, cap - 1)
        moves.append((ok, pt_ref[b, sp // ps], sp % ps, pt_ref[b, dp // ps], dp % ps))

    for o_ref in out_refs:
        # Phase 1: read every source of this row (from the output = current, aliased buffer).
        vals = [o_ref[s_page, s_off] for (_, s_page, s_off, _, _) in moves]  # A x [Hkv, D]
        # Phase 2: write the destinations.
        for (ok, _, _, d_page, d_off), val in zip(moves, vals):
            @pl.when(ok)
            def _(o_ref=o_ref, d_page=d_page, d_off=d_off, val=val):
                o_ref[d_page, d_off] = val


def kv_compact_pallas(k_pages, v_pages, page_table, start, accept_idx, num_accepted, *,
                      interpret=False):
    """Same contract as `kv_compact_reference`, as one pallas_call over a grid of batch rows.

    The 2L page arrays are aliased to the 2L outputs (input_output_aliases), so with donated pages
    the update happens in place and only the moved entries are touched. Index arrays are small
    whole-array operands read as scalars inside the kernel.
    """
    L = len(k_pages)
    pages = list(k_pages) + list(v_pages)
    n, ps, hkv, d = pages[0].shape
    B, P = page_table.shape
    A = accept_idx.shape[1]
    if A == 0 or B == 0:
        return list(k_pages), list(v_pages)
    idx_args = (page_table.astype(jnp.int32), start.astype(jnp.int32),
                accept_idx.astype(jnp.int32), num_accepted.astype(jnp.int32))

    def whole(shape):
        nd = len(shape)
        return pl.BlockSpec(shape, lambda b, nd=nd: (0,) * nd)

    in_specs = [whole(x.shape) for x in idx_args] + [whole(p.shape) for p in pages]
    out_specs = [whole(p.shape) for p in pages]
    out_shape = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages]
    outs = pl.pallas_call(
        functools.partial(_compact_kernel, L, A, ps),
        out_shape=out_shape,
        grid=(B,),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases={len(idx_args) + i: i for i in range(2 * L)},
        interpret=interpret,
        name="kv_compact",
    )(*idx_args, *pages)
    outs = list(outs)
    return outs[:L], outs[L:]


def _validate(k_pages, v_pages, page_table, start, accept_idx, num_accepted):
    if isinstance(k_pages, (jax.Array, np.ndarray)) or isinstance(v_pages, (jax.Array, np.ndarray)):
        raise ValueError("k_pages and v_pages must be lists of per-layer page arrays, not arrays")
    k_pages, v_pages = list(k_pages), list(v_pages)
    if not k_pages:
        raise ValueError("k_pages is empty: need at least one layer")
    if len(k_pages) != len(v_pages):
        raise ValueError(f"k_pages has {len(k_pages)} layers but v_pages has {len(v_pages)}")
    ref_shape, ref_dtype = tuple(k_pages[0].shape), k_pages[0].dtype
    if len(ref_shape) != 4:
        raise ValueError(f"pages must be [num_pages, page_size, Hkv, D], got shape {ref_shape}")
    for name, lst in (("k_pages", k_pages), ("v_pages", v_pages)):
        for i, p in enumerate(lst):
            if tuple(p.shape) != ref_shape:
                raise ValueError(f"page shapes differ: {name}[{i}] has shape {tuple(p.shape)}, "
                                 f"k_pages[0] has {ref_shape}")
            if p.dtype != ref_dtype:
                raise ValueError(f"page dtypes differ: {name}[{i}] is {p.dtype}, k_pages[0] is {ref_dtype}")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be rank 2 [B, P], got shape {tuple(page_table.shape)}")
    B = page_table.shape[0]
    if start.ndim != 1 or start.shape[0] != B:
        raise ValueError(f"start must be [B] = [{B}] (page_table rows), got shape {tuple(start.shape)}")
    if accept_idx.ndim != 2 or accept_idx.shape[0] != B:
        raise ValueError(f"accept_idx must be [B, A] with B = {B} (rows of start / page_table), "
                         f"got shape {tuple(accept_idx.shape)}")
    if num_accepted.ndim != 1 or num_accepted.shape[0] != B:
        raise ValueError(f"num_accepted must be [B] = [{B}], got shape {tuple(num_accepted.shape)}")
    for name, x in (("page_table", page_table), ("start", start), ("accept_idx", accept_idx),
                    ("num_accepted", num_accepted)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    return k_pages, v_pages


_PALLAS_OK: dict = {}


def _pallas_compiles(args) -> bool:
    """True if the Pallas kernel lowers and compiles for these shapes on the default backend."""
    key = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(args))
    if key not in _PALLAS_OK:
        try:
            structs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            jax.jit(kv_compact_pallas).lower(*structs).compile()
            _PALLAS_OK[key] = True
        except Exception:  # noqa: BLE001 - any lowering failure means: use the reference
            _PALLAS_OK[key] = False
    return _PALLAS_OK[key]


def kv_compact(k_pages, v_pages, page_table, start, accept_idx, num_accepted, *, impl="auto",
               interpret=False):
    """Validate shapes / dtypes and dispatch. impl: "reference" (pure jnp), "pallas" (the kernel;
    `interpret` runs it in the Pallas interpreter) or "auto" (the kernel on GPU when it compiles for
    these shapes, otherwise the reference). Returns (k_pages, v_pages) lists."""
    k_pages, v_pages = _validate(k_pages, v_pages, page_table, start, accept_idx, num_accepted)
    args = (k_pages, v_pages, page_table, start, accept_idx, num_accepted)
    if impl == "auto":
        use_pallas = jax.default_backend() == "gpu" and _pallas_compiles(args)
        impl = "pallas" if use_pallas else "reference"
    if impl == "reference":
        return kv_compact_reference(*args)
    if impl == "pallas":
        return kv_compact_pallas(*args, interpret=interpret)
    raise ValueError(f'impl must be "reference", "pallas" or "auto", got {impl!r}')
