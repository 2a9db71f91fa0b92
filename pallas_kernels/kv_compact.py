"""Compaction of an accepted draft path inside a paged KV cache.

Speculative decoding writes the K/V of a draft tree's N nodes to cache indices start[b] + n
(node n = 0..N-1; node 0 is the root, the last accepted token). After verification, the accepted
path accept_idx[b, 0..num_accepted[b]-1] (node indices, strictly increasing, accept_idx[b, j] >= j)
must end up contiguous:

    cache[b, start[b] + j] <- cache[b, start[b] + accept_idx[b, j]]      for j < num_accepted[b]

The cache is a list of per-layer page arrays [num_pages, page_size, ...], normally
[N, page_size, 2, Hkv, D] with K and V of a token side by side, so one move copies one contiguous
"entry" of 2 * Hkv * D elements. Layers of the target and of a draft model may be mixed in the list
(other Hkv / D / dtype) as long as they share num_pages and page_size: layers are grouped by
trailing shape and dtype and each group is handled by one kernel launch.

Cache index i of row b lives at page page_table[b, i // page_size], offset i % page_size.
Entries past the path keep whatever they held (garbage). A move is skipped (no write at all) when

  * j >= num_accepted[b] (padding, usually accept_idx == -1),
  * accept_idx[b, j] < 0,
  * source or destination lies past the row's capacity (P * page_size),
  * source == destination (accept_idx[b, j] == j: nothing to do).

All sources of a row are read before any destination is written, so overlapping source and
destination ranges are safe. (Because accept_idx[b, j] >= j and it is strictly increasing, even the
in-order "read j, write j" sequence would be safe, like a forward memmove.)

Implementations, all with the same contract:

  * `kv_compact_reference`: pure jnp, one gather + one scatter per layer.
  * `kv_compact_pallas`: a generic `pallas_call` (Triton lowering on GPU, or the Pallas
    interpreter), grid (row, layer-of-group), the page arrays aliased to the outputs.
  * `kv_compact_mosaic`: a Mosaic GPU kernel (Hopper TMA): per (row, layer) one CTA copies each
    valid source entry GMEM -> SMEM, waits for all of them, then copies SMEM -> GMEM into the
    destinations. The pages are passed as mutable refs (or aliased pallas_call operands), so with
    donated pages only the moved entries are touched.

`kv_compact` validates and runs the implementation its caller names; it never chooses one. Which
one runs is decided once, outside traced code, by the caller (specjax.kernels at engine start, with
`compile_error` to probe whether an implementation compiles for the engine's shapes).

Inside the kernels every entry is viewed as an [R, C] slab (`_slab_shape`): the trailing dims are
flattened and split so that rows are 16-byte multiples and both sides are <= 256 elements, which
is what a TMA box accepts and gives full-width vector loads elsewhere.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu import interpret_params, plgpu as _plgpu

__all__ = [
    "IMPLS",
    "compact_moves",
    "compile_error",
    "kv_compact",
    "kv_compact_mosaic",
    "kv_compact_pallas",
    "kv_compact_reference",
]

IMPLS = ("reference", "pallas", "mosaic", "mosaic:pallas_call")  # "mosaic" = the pl.kernel entry
MOSAIC_ENTRIES = ("kernel", "pallas_call")
_SMEM_BUDGET = 160 * 1024  # bytes of staging SMEM one CTA may use (H100/H200 allow ~227 KiB)


# ----------------------------------------------------------------------------- index math

def compact_moves(page_table, start, accept_idx, num_accepted, page_size: int):
    """Flat (page * page_size + offset) source / destination indices of every move.

    page_table: [B, P] int32; start: [B] int32; accept_idx: [B, A] int32; num_accepted: [B] int32.
    Returns (src [B, A] int32, dst [B, A] int32, valid [B, A] bool). Invalid moves (see the module
    docstring) have valid == False and clipped, in-range src / dst.
    """
    P = page_table.shape[1]
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


def _kernel_moves(page_table, start, accept_idx, num_accepted, page_size: int):
    """(src [B, A], dst [B, A]) int32 flat entry indices for the kernels; dst == -1: skip the move."""
    src, dst, valid = compact_moves(page_table, start, accept_idx, num_accepted, page_size)
    return src, jnp.where(valid, dst, -1).astype(jnp.int32)


def _slab_shape(f: int, itemsize: int) -> tuple[int, int]:
    """[R, C] view of one entry of f elements: C <= 256 with (C * itemsize) % 16 == 0 and
    R = f // C <= 256 (largest such C); (1, f) when f has no such split."""
    for c in range(min(f, 256), 0, -1):
        if f % c == 0 and (c * itemsize) % 16 == 0 and f // c <= 256:
            return f // c, c
    return 1, f


def _groups(pages):
    """Layer indices grouped by (trailing shape, dtype), in first-seen order."""
    groups: dict = {}
    for i, p in enumerate(pages):
        groups.setdefault((tuple(p.shape[2:]), jnp.dtype(p.dtype)), []).append(i)
    return list(groups.values())


def _flat_group(pages, idx):
    """Layers idx of pages as [N * ps, R, C] slabs (free reshapes of row-major arrays)."""
    n, ps = pages[idx[0]].shape[:2]
    f = int(np.prod(pages[idx[0]].shape[2:]))
    r, c = _slab_shape(f, jnp.dtype(pages[idx[0]].dtype).itemsize)
    return [pages[i].reshape(n * ps, r, c) for i in idx]


def _per_group(pages, run_group):
    """Apply run_group(flat_pages [G x [N*ps, R, C]]) -> list per shape/dtype group and put the
    results back in layer order with the original shapes."""
    out = list(pages)
    for idx in _groups(pages):
        res = run_group(_flat_group(pages, idx))
        for i, r in zip(idx, res):
            out[i] = r.reshape(pages[i].shape)
    return out


# ----------------------------------------------------------------------------- reference

def kv_compact_reference(pages, page_table, start, accept_idx, num_accepted):
    """pages: list (one per layer) of [N, page_size, ...] (typically [N, ps, 2, Hkv, D]);
    page_table: [B, P] int32; start: [B] int32; accept_idx: [B, A] int32 (node indices, -1 padded);
    num_accepted: [B] int32. Returns a new list with cache[start + j] <- cache[start + accept_idx[j]]."""
    pages = list(pages)
    n, ps = pages[0].shape[:2]
    src, dst, valid = compact_moves(page_table, start, accept_idx, num_accepted, ps)
    src = src.reshape(-1)  # [B * A]
    dst = jnp.where(valid, dst, n * ps).reshape(-1)  # out of bounds -> dropped by the scatter

    def move(p):
        flat = p.reshape(n * ps, -1)  # [N * ps, F]
        vals = flat[src]  # [B * A, F]: every source gathered before any write
        return flat.at[dst].set(vals, mode="drop", unique_indices=False).reshape(p.shape)

    return [move(p) for p in pages]


# ----------------------------------------------------------------------------- generic Pallas

def _pallas_kernel(A: int, G: int, src_ref, dst_ref, *refs):
    """Grid (row b, layer g of the group). refs = G aliased input slabs (unused: the current
    contents are read through the outputs) then the G output slabs [N * ps, R, C]."""
    out_refs = refs[G:]
    b = pl.program_id(0)
    layer = pl.program_id(1)
    srcs = [src_ref[b, j] for j in range(A)]  # A is small (tree depth): unrolled
    dsts = [dst_ref[b, j] for j in range(A)]
    for g, o_ref in enumerate(out_refs):
        @pl.when(layer == g)
        def _(o_ref=o_ref):
            vals = [o_ref[s] for s in srcs]  # phase 1: A x [R, C], every source of the row
            for d, v in zip(dsts, vals):  # phase 2: the destinations of valid moves
                @pl.when(d >= 0)
                def _(d=d, v=v):
                    o_ref[jnp.maximum(d, 0)] = v


def _triton_params():
    try:
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams()
    except Exception:  # noqa: BLE001 - no Triton backend in this jax: default lowering
        return None


def kv_compact_pallas(pages, page_table, start, accept_idx, num_accepted, *, interpret=False):
    """Same contract as `kv_compact_reference`, one pallas_call per shape/dtype group of layers.

    The page arrays are aliased to the outputs (input_output_aliases), so with donated pages the
    update happens in place. On GPU the Triton lowering is requested explicitly (the default
    pallas_call lowering is Mosaic GPU, for which see `kv_compact_mosaic`).
    """
    pages = list(pages)
    B = page_table.shape[0]
    A = accept_idx.shape[1]
    if A == 0 or B == 0:
        return pages
    src, dst = _kernel_moves(page_table, start, accept_idx, num_accepted, pages[0].shape[1])
    params = None if interpret else _triton_params()

    def whole(shape):  # the whole array as one block, the same for every grid point
        return pl.BlockSpec(shape, lambda b, g: (0,) * len(shape))

    def run_group(flat):
        G = len(flat)
        outs = pl.pallas_call(
            functools.partial(_pallas_kernel, A, G),
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
            grid=(B, G),
            in_specs=[whole(src.shape), whole(dst.shape)] + [whole(x.shape) for x in flat],
            out_specs=[whole(x.shape) for x in flat],
            input_output_aliases={2 + i: i for i in range(G)},
            interpret=interpret,
            compiler_params=params,
            name="kv_compact",
        )(src, dst, *flat)
        return list(outs)

    return _per_group(pages, run_group)


# ----------------------------------------------------------------------------- Mosaic GPU

def _mosaic_body(A: int, row, layer, src_ref, dst_ref, page_refs, *scratch):
    """One CTA (one warpgroup) per (row b, layer g). src_ref, dst_ref: [B, A] int32 in GMEM
    (dst -1 = skip); page_refs: G x [N * ps, R, C] in GMEM; scratch: A SMEM slabs [R, C] and A
    single-arrival barriers. Reads all valid sources into SMEM, waits for them, then writes."""
    plgpu = _plgpu()
    bufs, bar = scratch[:A], scratch[A]
    b = row()
    g_id = layer()
    srcs = [src_ref[b, j] for j in range(A)]  # scalar GMEM loads, uniform over the warpgroup
    dsts = [dst_ref[b, j] for j in range(A)]
    oob = _promise_in_bounds(plgpu)
    for g, ref in enumerate(page_refs):
        @pl.when(g_id == g)
        def _(ref=ref):
            for j in range(A):  # phase 1: TMA loads of every valid source
                @pl.when(dsts[j] >= 0)
                def _(j=j):
                    plgpu.copy_gmem_to_smem(ref.at[srcs[j]], bufs[j], bar.at[j], **oob)
            for j in range(A):
                @pl.when(dsts[j] >= 0)
                def _(j=j):
                    plgpu.barrier_wait(bar.at[j])
            plgpu.commit_smem()  # cheap fence before the async proxy reads the staged slabs
            for j in range(A):  # phase 2: TMA stores, only after every read has landed
                @pl.when(dsts[j] >= 0)
                def _(j=j):
                    plgpu.copy_smem_to_gmem(bufs[j], ref.at[dsts[j]])
    plgpu.wait_smem_to_gmem(0)  # stores done before the CTA (and its SMEM) goes away


def _promise_in_bounds(plgpu) -> dict:
    """Loads stay in bounds (src is clipped): ask for the plain bulk copy (no tensor map) when this
    jax's copy_gmem_to_smem has the option."""
    try:
        if "oob_mode" in inspect.signature(plgpu.copy_gmem_to_smem).parameters:
            return {"oob_mode": plgpu.OOBFillMode.PROMISE_IN_BOUNDS}
    except (AttributeError, TypeError, ValueError):
        pass
    return {}


def _mosaic_check(flat, A: int):
    x = flat[0]
    _, r, c = x.shape
    itemsize = jnp.dtype(x.dtype).itemsize
    if (c * itemsize) % 16 or r > 256 or c > 256:
        raise ValueError(f"kv_compact_mosaic: an entry of {r * c} x {x.dtype} has no [R, C] split with "
                         "16-byte rows and R, C <= 256 (needed by TMA)")
    if A * r * c * itemsize > _SMEM_BUDGET:
        raise ValueError(f"kv_compact_mosaic: {A} staged entries of {r * c * itemsize} bytes exceed "
                         f"the SMEM budget of {_SMEM_BUDGET} bytes")


def kv_compact_mosaic(pages, page_table, start, accept_idx, num_accepted, *, entry="kernel",
                      interpret=False):
    """Same contract as `kv_compact_reference`, as Mosaic GPU kernels (Hopper or newer), one launch
    per shape/dtype group of layers over a grid (row, layer of the group).

    entry: "kernel" (pl.kernel over a plgpu.Mesh, the pages passed as mutable GMEM refs) or
    "pallas_call" (pallas_call with Mosaic GPU compiler params and input_output_aliases; the older
    entry point, deprecated upstream). Both are in place for donated pages. interpret=True runs the
    kernel in the Mosaic GPU interpreter on CPU (slow; for tests).
    """
    if entry not in MOSAIC_ENTRIES:
        raise ValueError(f"entry must be one of {MOSAIC_ENTRIES}, got {entry!r}")
    plgpu = _plgpu()
    pages = list(pages)
    B = page_table.shape[0]
    A = accept_idx.shape[1]
    if A == 0 or B == 0:
        return pages
    src, dst = _kernel_moves(page_table, start, accept_idx, num_accepted, pages[0].shape[1])
    interp = interpret_params("kv_compact_mosaic") if interpret else None

    def scratch(x):
        _, r, c = x.shape
        return [plgpu.SMEM((r, c), x.dtype) for _ in range(A)] + [
            plgpu.Barrier(num_arrivals=1, num_barriers=A)]

    def run_group(flat):
        _mosaic_check(flat, A)
        G = len(flat)
        kw = {} if interp is None else {"interpret": interp}
        if entry == "kernel":
            def body(src_ref, dst_ref, *page_refs):
                pl.run_scoped(
                    functools.partial(_mosaic_body, A, lambda: jax.lax.axis_index("row"),
                                      lambda: jax.lax.axis_index("layer"), src_ref, dst_ref, page_refs),
                    *scratch(flat[0]))

            refs = [jax.new_ref(x, memory_space=plgpu.GMEM) for x in flat]
            mesh = plgpu.Mesh(grid=(B, G), grid_names=("row", "layer"))
            pl.kernel(body, out_type=(), mesh=mesh, name="kv_compact_mosaic", **kw)(src, dst, *refs)
            return [r[...] for r in refs]

        def call_body(src_ref, dst_ref, *refs):
            pl.run_scoped(
                functools.partial(_mosaic_body, A, lambda: pl.program_id(0), lambda: pl.program_id(1),
                                  src_ref, dst_ref, refs[G:]),
                *scratch(flat[0]))

        gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
        outs = pl.pallas_call(
            call_body,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
            grid=(B, G),
            in_specs=[gmem] * (2 + G),
            out_specs=[gmem] * G,
            input_output_aliases={2 + i: i for i in range(G)},
            compiler_params=plgpu.CompilerParams(),
            name="kv_compact_mosaic",
            **kw,
        )(src, dst, *flat)
        return list(outs)

    return _per_group(pages, run_group)


# ----------------------------------------------------------------------------- wrapper

def _validate(pages, page_table, start, accept_idx, num_accepted):
    if isinstance(pages, (jax.Array, np.ndarray)):
        raise ValueError("pages must be a list of per-layer page arrays, not an array")
    pages = list(pages)
    if not pages:
        raise ValueError("pages is empty: need at least one layer")
    ref_shape = tuple(pages[0].shape)
    for i, p in enumerate(pages):
        shape = tuple(p.shape)
        if len(shape) < 3:
            raise ValueError(f"pages must be [num_pages, page_size, ...] (e.g. [num_pages, page_size, 2, "
                             f"Hkv, D]), got shape {shape} for pages[{i}]")
        if shape[:2] != ref_shape[:2]:
            raise ValueError(f"page counts / page sizes differ: pages[{i}] has shape {shape}, "
                             f"pages[0] has {ref_shape}")
        if min(shape) < 1:
            raise ValueError(f"pages[{i}] has an empty dimension: shape {shape}")
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
    return pages


def kv_compact(pages, page_table, start, accept_idx, num_accepted, *, impl="reference", interpret=False):
    """Validate shapes / dtypes and run implementation `impl`. Returns the list of updated pages.

    impl: "reference" (pure jnp), "pallas" (generic pallas_call: Triton on GPU; `interpret` runs it
    in the Pallas interpreter), "mosaic" / "mosaic:pallas_call" (Mosaic GPU kernel through pl.kernel /
    pallas_call; GPU only, or its CPU interpreter with `interpret=True`). No implementation is chosen
    here (and none replaced by another when it fails): the caller picks one, outside traced code.
    Donate the pages to update them in place.
    """
    pages = _validate(pages, page_table, start, accept_idx, num_accepted)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r} (an \"auto\" choice is made once by "
                         "the caller, outside traced code: specjax.kernels)")
    args = (pages, page_table, start, accept_idx, num_accepted)
    if impl == "reference":
        return kv_compact_reference(*args)
    if impl == "pallas":
        return kv_compact_pallas(*args, interpret=interpret)
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f'impl="{impl}" needs a GPU backend (or interpret=True for the Mosaic GPU '
                         f"interpreter); the default backend is {jax.default_backend()!r}")
    entry = "pallas_call" if impl == "mosaic:pallas_call" else "kernel"
    return kv_compact_mosaic(*args, entry=entry, interpret=interpret)


def compile_error(impl: str, pages, page_table, start, accept_idx, num_accepted) -> str | None:
    """None if `impl` lowers and compiles on the default backend for these shapes (arrays or
    jax.ShapeDtypeStruct), else why not. Compiles a program: call it outside traced code, once."""
    args = (list(pages), page_table, start, accept_idx, num_accepted)
    structs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    try:
        jax.jit(functools.partial(kv_compact, impl=impl)).lower(*structs).compile()
    except Exception as e:  # noqa: BLE001 - any lowering / compile failure is the answer, with its message
        return f"{type(e).__name__}: {e}"
    return None
