"""Paged-attention kernels against the jnp reference (the oracle; itself checked against dense
attention in test_paged_attention.py): the generic Pallas kernel in the Pallas interpreter over
decode / chunked prefill at an offset / tree verify / draft growth / sliding window, page sizes 1, 4
and 16, f32 (tight) and bf16, ragged and empty rows, one or several splits; that it reads no page
outside a row's live key blocks; the shared split/combine plumbing; and the lowering of the
generic kernel for Triton and of the Mosaic GPU kernel for CUDA (cross-platform export, no GPU).
The Mosaic GPU and TPU kernels run in their interpreters in test_paged_attention_interpreters.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.paged_attention_pallas import auto_splits, paged_attention_pallas
from paged_cases import assert_valid_close, make_case, poison_dead_pages


def _ref(case):
    return jax.jit(paged_attention_reference, static_argnames=("sliding_window",))(*case.args, **case.kwargs)


def _pallas(case, **kw):
    fn = functools.partial(paged_attention_pallas, interpret=True, **kw)
    return jax.jit(fn, static_argnames=("sliding_window",))(*case.args, **case.kwargs)


CASES = [  # (mode, page_size, dtype, window, num_splits, block_kv, seed)
    ("decode", 1, jnp.float32, None, 3, 16, 0),
    ("decode", 16, jnp.float32, None, None, 16, 1),
    ("prefill", 4, jnp.float32, None, 1, 8, 2),
    ("verify", 16, jnp.float32, None, 2, 16, 3),
    ("grow", 1, jnp.float32, None, 2, 8, 4),
    ("prefill", 4, jnp.float32, 5, 2, 8, 5),  # sliding window: blocks below the window are skipped
    ("decode", 16, jnp.bfloat16, None, 2, 32, 6),
    ("verify", 1, jnp.bfloat16, None, 1, 16, 7),
]


@pytest.mark.parametrize("mode,page_size,dtype,window,num_splits,block_kv,seed", CASES)
def test_pallas_matches_reference(mode, page_size, dtype, window, num_splits, block_kv, seed):
    case = make_case(np.random.default_rng(seed), mode, page_size=page_size, dtype=dtype, window=window)
    want = _ref(case)
    got = _pallas(case, num_splits=num_splits, block_kv=block_kv)
    assert got.dtype == dtype and got.shape == want.shape
    atol = 2e-5 if dtype == jnp.float32 else 3e-2
    assert_valid_close(got, want, case.num_new, atol=atol, rtol=1e-5 if dtype == jnp.float32 else 0)


@pytest.mark.parametrize("mode,page_size", [("decode", 4), ("verify", 16)])
def test_pallas_reads_only_live_blocks(mode, page_size):
    """NaN in every page outside the rows' live key blocks: the kernel's output stays finite and
    equal to the reference on clean pages (the reference itself reads every page)."""
    case = make_case(np.random.default_rng(10), mode, page_size=page_size, P=24)
    poisoned = poison_dead_pages(case, block=16)
    assert np.isnan(np.asarray(poisoned.kv_pages)).any()
    got = _pallas(poisoned, num_splits=3, block_kv=16)
    assert_valid_close(got, _ref(case), case.num_new, atol=2e-5, rtol=1e-5)
    with np.errstate(invalid="ignore"):
        assert np.isnan(np.asarray(_ref(poisoned))).any()  # the poison is there to be read


def test_combine_is_exact_softmax_over_partials():
    """Splitting a row's keys into partials and combining them = one softmax over all keys; rows
    that see nothing anywhere give zeros (no NaN)."""
    rng = np.random.default_rng(2)
    B, K, S, R, D = 2, 2, 4, 5, 3
    s = rng.normal(size=(B, K, R, S * 7))
    v = rng.normal(size=(B, K, S * 7, D))
    s[0, 0, 1] = -np.inf  # a row that sees nothing
    s[1, 1, 2, 7:14] = -np.inf  # a split that sees nothing of a row that sees other keys
    parts = []
    for i in range(S):
        si, vi = s[..., i * 7:(i + 1) * 7], v[:, :, i * 7:(i + 1) * 7]
        m = si.max(-1, keepdims=True)
        w = np.where(np.isfinite(si), np.exp(si - np.where(np.isfinite(m), m, 0)), 0)
        lse = np.where(w.sum(-1) > 0, np.log(np.maximum(w.sum(-1), 1e-300)) + m[..., 0], -np.inf)
        o = np.einsum("bkrs,bksd->bkrd", w, vi) / np.maximum(w.sum(-1), 1e-300)[..., None]
        parts.append((jnp.asarray(o[:, :, None], jnp.float32), jnp.asarray(lse[:, :, None], jnp.float32)))
    got = np.asarray(pa.combine(parts))
    top = np.where(np.isfinite(s), s, -1e300).max(-1, keepdims=True)
    full = np.where(np.isfinite(s), np.exp(s - top), 0)
    with np.errstate(invalid="ignore"):
        want = np.einsum("bkrs,bksd->bkrd", full, v) / full.sum(-1, keepdims=True)
    want[0, 0, 1] = 0.0
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_auto_splits_fill_the_gpu_and_ignore_the_capacity():
    from pallas_kernels import paged_attention_mosaic as pam
    g = pa.Geometry(B=1, T=1, H=32, Hkv=8, D=128, P=64, ps=16, block_q=64, window=None, scale=1.0)
    for split in (auto_splits, pam.auto_splits):
        assert split(g) == 32  # 264 programs / 8 heads = 33, at most 32
        assert split(pa.Geometry(**{**g.__dict__, "P": 512})) == 32  # the capacity does not matter
        assert split(pa.Geometry(**{**g.__dict__, "B": 4})) == 9
        assert split(pa.Geometry(**{**g.__dict__, "B": 64})) == 1
        assert split(g, max_splits=8) == 8  # a caller's cap (attention.split_cap: short rows)
        assert split(pa.Geometry(**{**g.__dict__, "B": 4}), max_splits=16) == 9  # a cap above the count


def test_two_query_blocks_pair_only_where_the_ctas_overflow_the_gpu():
    from pallas_kernels import paged_attention_mosaic as pam
    tree = pa.Geometry(B=32, T=17, H=32, Hkv=8, D=128, P=64, ps=16, block_q=64, window=None, scale=1.0)
    assert tree.num_q_blocks == 2 and pam.can_pair(tree) and pam.auto_pair(tree)  # 512 CTAs unpaired
    assert pam.auto_splits(tree) == 1  # a paired CTA holds two blocks' work
    assert not pam.auto_pair(pa.Geometry(**{**tree.__dict__, "B": 1}))  # 16 CTAs: more splits instead
    assert not pam.can_pair(pa.Geometry(**{**tree.__dict__, "T": 1}))  # one block
    assert not pam.can_pair(pa.Geometry(**{**tree.__dict__, "block_q": 128}))
    case = make_case(np.random.default_rng(0), "decode", page_size=16, B=2, H=4, D=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="pair_blocks needs two 64-row query blocks"):
        jax.eval_shape(functools.partial(pam.paged_attention_mosaic, pair_blocks=True), *case.args)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _engine_shapes(dtype, T, tree):
    B, H, Hkv, D, ps, P, N = 4, 32, 8, 128, 16, 64, 300
    return [_sds((B, T, H, D), dtype), _sds((N, ps, 2, Hkv, D), dtype), _sds((B, P), jnp.int32),
            _sds((B,), jnp.int32), _sds((B,), jnp.int32), _sds((B, T, T), jnp.bool_) if tree else None]


@pytest.mark.parametrize("dtype,T,tree", [(jnp.bfloat16, 1, False), (jnp.float32, 17, True)])
def test_pallas_lowers_for_triton(dtype, T, tree):
    """The generic kernel's Triton lowering (Python side) for CUDA; compiling needs a GPU."""
    pytest.importorskip("jax.experimental.pallas.triton")
    exp = export.export(jax.jit(paged_attention_pallas), platforms=("cuda",),
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    assert "xla.gpu.triton" in exp(*_engine_shapes(dtype, T, tree)).mlir_module()


@pytest.mark.parametrize("T,tree,window,pair", [(1, False, None, None), (17, True, None, None), (17, True, None, True),
                                                 (40, True, None, None), (300, False, 64, None)])
def test_mosaic_lowers_for_cuda(T, tree, window, pair):
    """The Mosaic GPU kernel's lowering (TMA page copies into swizzled SMEM, wgmma with 64 and 128
    rows, barriers, masks; two warpgroups over paired query blocks with the outputs in the key slabs'
    SMEM) for CUDA: decode, tree verify, prefill with a sliding window; compiling to a cubin and
    running need a GPU."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    fn = functools.partial(paged_attention_mosaic, sliding_window=window, pair_blocks=pair)
    text = export.export(jax.jit(fn), platforms=("cuda",))(*_engine_shapes(jnp.bfloat16, T, tree)).mlir_module()
    assert "mosaic_gpu" in text


def test_layers_share_one_kernel_lowering():
    """The dispatch point's kernel is lowered once for all the call sites of a program with the same
    shapes (a model's layers): the module of 4 layers holds the kernel's body once, as the module of
    1 layer does (inlined at each call site, each layer had its own copy, and the engine's programs
    took tens of seconds to compile on the GPU)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from specjax import attention
    kernel = attention.implementation(attention.AttnImpl("mosaic_gpu"))
    assert attention.implementation(attention.AttnImpl("mosaic_gpu")) is kernel

    def layers(n):
        def f(q, kv, pt, q_start, kv_len):
            for _ in range(n):
                q = kernel(q, kv, pt, q_start, kv_len, None, sliding_window=None, mask_start=None).astype(q.dtype)
            return q
        return export.export(jax.jit(f), platforms=("cuda",))(*_engine_shapes(jnp.bfloat16, 1, False)[:5]).mlir_module()

    one, four = layers(1), layers(4)
    assert one.count("mosaic_gpu") > 0
    assert four.count("mosaic_gpu") == one.count("mosaic_gpu")
    assert len(four) < 1.2 * len(one)


def test_kernels_reject_what_they_cannot_serve():
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    from pallas_kernels.paged_attention_tpu import paged_attention_tpu
    case = make_case(np.random.default_rng(0), "decode", page_size=4)
    with pytest.raises(ValueError, match="bf16 / f16"):
        jax.eval_shape(paged_attention_mosaic, *case.args)
    with pytest.raises(ValueError, match="page_size 4 is not a multiple of 8"):
        jax.eval_shape(paged_attention_tpu, *case.args)
    with pytest.raises(ValueError, match="does not fit kv_pages"):
        jax.eval_shape(paged_attention_pallas, case.q[..., :8], *case.args[1:])


def test_write_kernel_lowers_for_cuda():
    """The verify kernel that writes its tokens' K / V (one more split reads them from the call's rows; row
    copies to the pages) lowers for CUDA; running it needs a GPU (its values: the interpreter's test)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from pallas_kernels.paged_attention_mosaic import paged_attention_write_mosaic
    q, kv, pt, qs, kl, mask = _engine_shapes(jnp.bfloat16, 17, True)
    new = _sds((4, 17, 8, 128), jnp.bfloat16)
    exp = export.export(jax.jit(paged_attention_write_mosaic), platforms=("cuda",))(q, new, new, kv, pt, qs, kl, mask)
    assert "mosaic_gpu" in exp.mlir_module()
    assert [a.shape for a in exp.out_avals] == [q.shape, kv.shape]


def test_write_kernel_takes_block_masked_calls_only():
    """why_not_write names why it cannot take a call (causal ones, too many tokens, paired blocks); the
    kernel refuses those calls."""
    from pallas_kernels.paged_attention_mosaic import paged_attention_write_mosaic, why_not_write
    bf = jnp.bfloat16
    kv, pt = _sds((300, 16, 2, 2, 64), bf), _sds((4, 8), jnp.int32)
    rows = _sds((4,), jnp.int32)

    def q(T):
        return _sds((4, T, 8, 64), bf)
    assert why_not_write(q(17), kv, pt, _sds((4, 17, 17), jnp.bool_)) is None  # tree verify
    assert why_not_write(q(3), kv, pt, _sds((4, 3, 12), jnp.bool_)) is None  # draft growth
    assert "causal calls" in why_not_write(q(17), kv, pt, None)  # prefill / decode
    assert "is not [B, T = 3, W]" in why_not_write(q(3), kv, pt, _sds((4, 4, 12), jnp.bool_))
    assert "one key block of 64" in why_not_write(q(65), kv, pt, _sds((4, 65, 65), jnp.bool_))
    big = _sds((40, 17, 32, 128), bf), _sds((300, 16, 2, 8, 128), bf), _sds((40, 8), jnp.int32)
    assert "paired" in why_not_write(*big, _sds((40, 17, 17), jnp.bool_))  # 640 CTAs: the blocks pair
    new = _sds((4, 3, 2, 64), bf)
    with pytest.raises(ValueError, match="causal calls"):
        jax.eval_shape(paged_attention_write_mosaic, q(3), new, new, kv, pt, rows, rows, None)
    with pytest.raises(ValueError, match=r"must be \[B, T, Hkv, D\]"):
        jax.eval_shape(paged_attention_write_mosaic, q(3), _sds((4, 3, 1, 64), bf), new, kv, pt, rows, rows,
                       _sds((4, 3, 3), jnp.bool_))
    with pytest.raises(ValueError, match="without mask_start the offset is 0"):
        jax.eval_shape(functools.partial(paged_attention_write_mosaic, offset=2), q(3), new, new, kv, pt, rows, rows,
                       _sds((4, 3, 3), jnp.bool_))
    grow = _sds((4, 3, 12), jnp.bool_)
    with pytest.raises(ValueError, match="offset = q_start - mask_start must be a static int"):  # growth, no offset
        jax.eval_shape(functools.partial(paged_attention_write_mosaic, mask_start=rows), q(3), new, new, kv, pt,
                       rows, rows, grow)
    with pytest.raises(ValueError, match="write_at is one of"):
        jax.eval_shape(functools.partial(paged_attention_write_mosaic, write_at="later"), q(3), new, new, kv, pt,
                       rows, rows, _sds((4, 3, 3), jnp.bool_))


def _hopper() -> bool:
    return jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") >= "9.0"


@pytest.mark.parametrize("mode,T,H,Hkv,P,write_at", [
    ("verify", 32, 9, 3, None, "end"), ("verify", 17, 32, 8, None, "end"), ("verify", 32, 9, 3, 160, "end"),
    ("grow", 4, 9, 3, 160, "end"), ("verify", 32, 9, 3, 160, "start")])
def test_write_kernel_on_gpu(mode, T, H, Hkv, P, write_at):
    """On a Hopper GPU, compiled (not interpreted): the kernel that writes its tokens' K / V gives write_kv's
    pages and the reference's attention over them (SmolLM2's batch-1 tree, an 8B-shaped one; rows of up to
    2 560 keys (32 splits); a draft level after three others; the rows stored before the key loop)."""
    if not _hopper():
        pytest.skip("runs the Mosaic GPU kernel: needs a Hopper GPU")
    from pallas_kernels.paged_attention_mosaic import paged_attention_write_mosaic
    from specjax.kv_cache import write_indices, write_kv
    rng = np.random.default_rng(T + (P or 0))
    case = make_case(rng, mode, page_size=16, B=3, T=T, H=H, Hkv=Hkv, D=64, dtype=jnp.bfloat16, P=P)
    k_new, v_new = (jnp.asarray(rng.normal(0, 1, (3, T, Hkv, 64)), jnp.bfloat16) for _ in range(2))
    widx = write_indices(case.page_table, case.q_start, jnp.asarray(case.num_new, jnp.int32), T, 16)
    want_pages = write_kv(case.kv_pages, k_new, v_new, widx)
    want = paged_attention_reference(case.q, want_pages, case.page_table, case.q_start, case.kv_len, case.block_mask)
    offset = None if case.mask_start is None else int(case.q_start[0] - case.mask_start[0])
    got, pages = jax.jit(functools.partial(paged_attention_write_mosaic, offset=offset, write_at=write_at))(
        case.q, k_new, v_new, case.kv_pages, case.page_table, case.q_start, case.kv_len, case.block_mask,
        mask_start=case.mask_start)
    assert_valid_close(got, want, case.num_new, atol=3e-2)
    np.testing.assert_array_equal(np.asarray(pages.astype(jnp.float32))[1:],
                                  np.asarray(want_pages.astype(jnp.float32))[1:])
