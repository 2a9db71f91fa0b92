"""The Mosaic GPU and Mosaic TPU paged-attention kernels in their CPU interpreters against the jnp
reference (bf16 within tolerance, f32 tight): ragged and empty rows, decode with several splits,
tree verify (two 64-row query blocks, or one of 128 rows), draft growth, chunked prefill at an offset, sliding windows,
and that they read no page outside the rows' live key blocks. The interpreters are slow: few, small cases.

What the Mosaic GPU interpreter checks: the TMA page gathers into the SMEM slots, the barriers and
the multi-stage pipeline, bounds, splits, masks and the online softmax. Its wgmma takes neither a
transposed nor a register operand, so there the two products run as plain dots; the wgmma calls
are checked by lowering for CUDA (test_paged_attention_kernels.py) and run on the GPU."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic_gpu import interpreter_available
from pallas_kernels.paged_attention import paged_attention_reference
from paged_cases import assert_valid_close, make_case, poison_dead_pages


needs_gpu_interpreter = pytest.mark.skipif(not interpreter_available(),
                                           reason="no Mosaic GPU interpreter in this jax")


def _ref(case):
    return jax.jit(paged_attention_reference, static_argnames=("sliding_window",))(*case.args, **case.kwargs)


def _run(fn, case, **kw):
    return jax.jit(functools.partial(fn, interpret=True, **kw), static_argnames=("sliding_window",))(
        *case.args, **case.kwargs)


MOSAIC_CASES = [  # (mode, page_size, num_splits, T, H, window, seed, block_q); bf16, head_dim 64 (the minimum)
    ("decode", 16, 3, 1, 4, None, 0, None),
    ("verify", 8, 1, 17, 8, None, 1, None),  # 17 nodes x 4 query heads per KV head = 68 rows: two 64-row blocks
    ("verify", 8, 2, 17, 8, None, 3, 128),  # the same in one 128-row block
    ("grow", 16, 2, 3, 4, 21, 2, None),  # with a sliding window
]


@needs_gpu_interpreter
@pytest.mark.parametrize("mode,page_size,num_splits,T,H,window,seed,block_q", MOSAIC_CASES)
def test_mosaic_interpreted_matches_reference(mode, page_size, num_splits, T, H, window, seed, block_q):
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    case = make_case(np.random.default_rng(seed), mode, page_size=page_size, B=3, T=T, H=H, D=64,
                     dtype=jnp.bfloat16, P=20 if mode == "decode" else None, window=window)
    want = _ref(case)
    if mode == "decode":  # pages outside the live 64-key blocks must not be read
        case = poison_dead_pages(case, block=64)
        assert np.isnan(np.asarray(case.kv_pages.astype(jnp.float32))).any()
    got = _run(paged_attention_mosaic, case, num_splits=num_splits, block_q=block_q)
    assert got.dtype == jnp.bfloat16
    assert_valid_close(got, want, case.num_new, atol=3e-2)


@needs_gpu_interpreter
@pytest.mark.parametrize("T,block_in_kernel,seed", [(40, True, 7), (17, False, 8)])
def test_mosaic_interpreted_tree_mask_in_kernel_and_dense(T, block_in_kernel, seed):
    """Tree verify with the block mask applied inside the kernel over two 32-bit words per query row
    (a 40-node tree), and the dense block path (block_partial + combine) that the kernel replaced."""
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    case = make_case(np.random.default_rng(seed), "verify", page_size=16, B=3, T=T, H=4, D=64, dtype=jnp.bfloat16)
    assert case.block_mask is not None and case.block_mask.shape[2] > (32 if T > 32 else 0)
    want = _ref(case)
    got = _run(paged_attention_mosaic, case, block_in_kernel=block_in_kernel)
    assert_valid_close(got, want, case.num_new, atol=3e-2)


@needs_gpu_interpreter
@pytest.mark.parametrize("mode,T,page_size,num_splits,window,seed,B,P", [
    ("verify", 17, 8, 1, None, 1, 3, None), ("verify", 17, 16, 2, None, 4, 3, None),
    ("prefill", 20, 16, 2, 9, 5, 3, None),  # causal rows and a sliding window
    # a prompt piece at offset 39: block 0 (tokens 0-15) sees keys < 55, block 1 (16-31) keys < 71, in the
    # next 64-key block: the CTA must read the union of the blocks' ranges (fails if it reads block 0's)
    ("prefill", 32, 16, 2, None, 8, 4, 10)])
def test_mosaic_interpreted_paired_query_blocks(mode, T, page_size, num_splits, window, seed, B, P):
    """Two 64-row query blocks (4 query heads per KV head: a 17-node tree has 68 rows, a 20-token
    prompt piece 80) in one CTA of two warpgroups that share each key slab (warpgroup 0 loads it,
    both must free it), as the engine runs them from about 17 rows on (8 KV heads); the CTA reads the
    union of the blocks' key ranges, each block masks its own rows; one split and two. The interpreter
    takes no aliased SMEM refs in copies, so here the outputs get their own buffers instead of reusing
    the key slabs' (that aliasing runs on the GPU only: scripts/sweep_mosaic_attention.py --pair-only)."""
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    case = make_case(np.random.default_rng(seed), mode, page_size=page_size, B=B, T=T, H=8, D=64, P=P,
                     dtype=jnp.bfloat16, window=window)
    assert (case.block_mask is not None) == (mode == "verify")
    if P:
        assert int(case.q_start[2]) == 39
    want = _ref(case)
    got = _run(paged_attention_mosaic, case, num_splits=num_splits, pair_blocks=True)
    assert_valid_close(got, want, case.num_new, atol=3e-2)


SMOLLM2_CASES = [  # (mode, T, seed): SmolLM2-135M's geometry (9 query heads, 3 KV heads: G = 3; head_dim 64),
    # page size 16, 2 rows as the speculative engine runs batch 1 (row 1: a padding row with row 0's pages
    # and no keys), num_splits auto (32 splits at 2 rows: most CTAs find no key block)
    ("verify", 17, 5),  # 51 query rows per KV head: one 64-row block, 56 rows written back
    ("prefill", 64, 6),  # a prompt piece at an offset: 192 rows, two 128-row blocks
]


@needs_gpu_interpreter
@pytest.mark.parametrize("mode,T,seed", SMOLLM2_CASES)
def test_mosaic_interpreted_smollm2_geometry(mode, T, seed):
    import dataclasses

    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    case = make_case(np.random.default_rng(seed), mode, page_size=16, B=2, T=T, H=9, Hkv=3, D=64,
                     dtype=jnp.bfloat16, P=66)
    table = np.asarray(case.page_table).copy()
    q_start = np.asarray(case.q_start).copy()
    table[1], q_start[1] = table[0], q_start[0]  # the padding row reads row 0's slot, with kv_len 0
    case = dataclasses.replace(case, page_table=jnp.asarray(table), q_start=jnp.asarray(q_start))
    assert int(case.kv_len[1]) == 0 and case.num_new[1] == 0
    want = _ref(case)
    got = _run(paged_attention_mosaic, case)
    assert_valid_close(got, want, case.num_new, atol=3e-2)


WRITE_CASES = [  # (mode, T, H, Hkv, num_splits, seed, write_at): block-masked calls whose K / V the kernel writes
    ("verify", 17, 4, 2, 2, 11, "end"),  # two 64-row query blocks
    ("verify", 32, 9, 3, None, 12, "end"),  # SmolLM2's geometry, the engine's batch-1 tree (7/4/24 + a branch of 7)
    ("verify", 32, 9, 3, 2, 15, "start"),  # the rows stored before the key loop
    ("verify", 40, 4, 1, 1, 13, "end"),  # two mask words per row, one page split
    ("grow", 4, 9, 3, 2, 14, "end"),  # a draft level: earlier levels' entries from the pages, its own from the call
]


@needs_gpu_interpreter
@pytest.mark.parametrize("mode,T,H,Hkv,num_splits,seed,write_at", WRITE_CASES)
def test_mosaic_interpreted_write_and_attend(mode, T, H, Hkv, num_splits, seed, write_at):
    """paged_attention_write_mosaic = write_kv then the reference: the new tokens' keys come from the call's
    own rows (the pages at those slots hold other values, make_case's garbage), the rows land on their
    pages (every page but the trash page equal to write_kv's), padding tokens and the empty row included."""
    from pallas_kernels.paged_attention_mosaic import paged_attention_write_mosaic
    from specjax.kv_cache import write_indices, write_kv
    rng = np.random.default_rng(seed)
    case = make_case(rng, mode, page_size=16, B=3, T=T, H=H, Hkv=Hkv, D=64, dtype=jnp.bfloat16)
    k_new, v_new = (jnp.asarray(rng.normal(0, 1, (3, T, Hkv, 64)), jnp.bfloat16) for _ in range(2))
    widx = write_indices(case.page_table, case.q_start, jnp.asarray(case.num_new, jnp.int32), T, 16)
    want_pages = write_kv(case.kv_pages, k_new, v_new, widx)
    want = _ref(dataclasses.replace(case, kv_pages=want_pages))
    offset = None if case.mask_start is None else int(case.q_start[0] - case.mask_start[0])  # 3 earlier levels
    assert case.mask_start is None or (np.asarray(case.q_start - case.mask_start) == offset).all()
    got, pages = jax.jit(functools.partial(paged_attention_write_mosaic, interpret=True, num_splits=num_splits,
                                           offset=offset, write_at=write_at))(
        case.q, k_new, v_new, case.kv_pages, case.page_table, case.q_start, case.kv_len, case.block_mask,
        mask_start=case.mask_start)
    assert got.dtype == jnp.bfloat16 and pages.shape == case.kv_pages.shape
    assert_valid_close(got, want, case.num_new, atol=3e-2)
    np.testing.assert_array_equal(np.asarray(pages.astype(jnp.float32))[1:],
                                  np.asarray(want_pages.astype(jnp.float32))[1:])
    stale = _ref(case)  # what the pages held at those slots would have given: the test can tell
    assert not np.allclose(np.asarray(stale[0], np.float32), np.asarray(got[0], np.float32), atol=3e-2)


TPU_CASES = [  # (mode, page_size, dtype, window, seed); head_dim 128 (full lanes)
    ("prefill", 16, jnp.bfloat16, 6, 3),  # with a sliding window
    ("grow", 8, jnp.float32, None, 4),
]


@pytest.mark.parametrize("mode,page_size,dtype,window,seed", TPU_CASES)
def test_tpu_interpreted_matches_reference(mode, page_size, dtype, window, seed):
    from pallas_kernels.paged_attention_tpu import paged_attention_tpu
    case = make_case(np.random.default_rng(seed), mode, page_size=page_size, B=3, D=128, dtype=dtype,
                     T=5 if mode == "prefill" else None, P=40 if mode == "grow" else None, window=window)
    want = _ref(case)
    if mode == "grow":  # pages outside the live 128-key blocks must not be read
        case = poison_dead_pages(case, block=128)
        assert np.isnan(np.asarray(case.kv_pages)).any()
    got = _run(paged_attention_tpu, case)
    assert got.dtype == dtype
    if dtype == jnp.float32:
        assert_valid_close(got, want, case.num_new, atol=2e-5, rtol=1e-5)
    else:
        assert_valid_close(got, want, case.num_new, atol=3e-2)
