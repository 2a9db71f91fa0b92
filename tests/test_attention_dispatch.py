"""The attention dispatch point: the implementation is chosen once at start (resolve), logged, held
as static configuration by the model's Attention modules (configure) and so part of every
program's jit key. Implementations that need a GPU (cuDNN) are checked on the GPU machine only."""
from __future__ import annotations

import dataclasses
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.paged_attention import paged_attention_reference
from specjax import attention, decode
from specjax.attention import AttnImpl
from specjax.kv_cache import init_cache
from specjax.models.llama import Attention
from helpers import tiny_config, tiny_model


def _case(rng, B=3, T=4, H=8, Hkv=2, D=64, ps=16, P=8, dtype=jnp.bfloat16, tree=False):
    N = B * P + 1
    kv_pages = jnp.asarray(rng.normal(size=(N, ps, 2, Hkv, D)), dtype)
    page_table = jnp.asarray(1 + rng.permutation(B * P).reshape(B, P), jnp.int32)
    q_start = jnp.asarray(rng.integers(0, P * ps - T, size=B), jnp.int32)
    kv_len = q_start + T
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    block_mask = None
    if tree:  # random tree: node i's parent is a random earlier node
        m = np.zeros((B, T, T), bool)
        for b in range(B):
            parent = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
            for i in range(T):
                j = i
                while j >= 0:
                    m[b, i, j] = True
                    j = parent[j]
        block_mask = jnp.asarray(m)
    return q, kv_pages, page_table, q_start, kv_len, block_mask


@pytest.mark.parametrize("tree,T", [(False, 4), (True, 4), (False, 1)])
def test_cudnn_matches_reference(tree, T):
    if jax.default_backend() != "gpu":
        pytest.skip("cuDNN attention needs a GPU")
    rng = np.random.default_rng(0)
    args = _case(rng, T=T, tree=tree)
    want = np.asarray(paged_attention_reference(*args), np.float32)
    got = np.asarray(attention.paged_attention_cudnn(*args), np.float32)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 2e-2, err


def test_resolve_auto_per_backend(monkeypatch, caplog):
    def auto(**kw):
        impl, choice = attention.resolve("auto", **kw)
        return impl.name, choice.note

    bf16 = dict(dtype=jnp.bfloat16, page_size=16, head_dim=128)
    with caplog.at_level(logging.INFO, logger="specjax"):
        assert auto(backend="cpu", **bf16) == ("reference", "auto")
    assert "attention: reference (auto)" in caplog.text  # the choice is logged
    # TPU: the Mosaic TPU kernel where it can serve, else the reference with the reason
    assert auto(backend="tpu", **bf16)[0] == "tpu"
    name, note = auto(backend="tpu", dtype=jnp.bfloat16, page_size=8, head_dim=128)
    assert name == "reference" and "page_size 8 is not a multiple of 16" in note
    name, note = auto(backend="tpu", dtype=jnp.float32, page_size=16, head_dim=64)
    assert name == "reference" and "head_dim 64" in note
    # GPU (Hopper): the Mosaic GPU kernel for bf16 / fp16 (cuDNN first for plain decoding of one row),
    # the reference for f32
    monkeypatch.setattr(attention, "_gpu_kind", lambda: "9.0")
    assert auto(backend="gpu", **bf16)[0] == "mosaic_gpu"
    assert auto(backend="gpu", plain_batch=8, **bf16)[0] == "mosaic_gpu"
    assert auto(backend="gpu", plain_batch=1, **bf16)[0] == "cudnn"
    name, note = auto(backend="gpu", dtype=jnp.bfloat16, page_size=4, head_dim=128)
    assert name == "cudnn" and "page_size 4" in note  # where the kernel cannot serve: cuDNN, with the reason
    name, note = auto(backend="gpu", dtype=jnp.float32, page_size=16, head_dim=128)
    assert name == "reference" and "bf16 / fp16" in note
    # forced kernels still check what they need (Hopper, page sizes), with the reason
    assert attention.resolve("mosaic_gpu", backend="gpu", **bf16)[0].name == "mosaic_gpu"
    with pytest.raises(Exception, match="page_size 4"):
        attention.resolve("mosaic_gpu", backend="gpu", dtype=jnp.bfloat16, page_size=4, head_dim=128)
    monkeypatch.setattr(attention, "_gpu_kind", lambda: "8.0")
    with pytest.raises(Exception, match="Hopper"):
        attention.resolve("mosaic_gpu", backend="gpu", **bf16)
    assert auto(backend="gpu", **bf16)[0] == "cudnn"  # not a Hopper GPU
    # tensor parallelism: no kernels yet, said so by the order (cuDNN, reference)
    assert auto(backend="gpu", mesh=object(), **bf16)[0] == "cudnn"
    assert auto(backend="gpu", mesh=object(), dtype=jnp.float32, page_size=16, head_dim=128)[0] == "reference"


def test_resolve_forced_and_errors():
    kw = dict(dtype=jnp.float32, page_size=16, head_dim=8, backend="cpu")
    with pytest.raises(ValueError, match="unknown attention implementation 'nope'"):
        attention.resolve("nope", **kw)
    with pytest.raises(ValueError, match="'pallas' cannot serve.*Triton"):
        attention.resolve("pallas", **kw)  # no Triton on CPU; interpret=True would run it
    with pytest.raises(ValueError, match="'mosaic_gpu' cannot serve.*bf16 / f16"):
        attention.resolve("mosaic_gpu", **dict(kw, interpret=True))
    impl, choice = attention.resolve("pallas", interpret=True, num_splits=2, **kw)
    assert impl == AttnImpl("pallas", interpret=True, num_splits=2) and choice.note == "forced"
    impl, _ = attention.resolve("reference", interpret=True, **kw)
    assert impl == attention.REFERENCE  # interpret means nothing for the reference: same jit key


def test_configure_is_static_and_leaves_the_model_alone():
    cfg = tiny_config()
    model = tiny_model(cfg)
    impl = AttnImpl("pallas", interpret=True)
    conf = attention.configure(model, impl)
    mods = [m for _, m in nnx.iter_modules(conf) if isinstance(m, Attention)]
    assert len(mods) == cfg.num_layers and all(m.attn_impl == impl for m in mods)
    assert all(m.attn_impl == attention.REFERENCE for _, m in nnx.iter_modules(model) if isinstance(m, Attention))
    g0, p0 = nnx.split(model)
    g1, p1 = nnx.split(conf)
    assert g0 != g1  # the choice is in the graph definition, hence in the programs' jit key
    assert all(a is b for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))  # weights shared, not copied


def test_attend_dispatches_on_the_static_impl():
    rng = np.random.default_rng(1)
    q, kv, pt, qs, kl, _ = _case(rng, T=1, dtype=jnp.float32, D=16)
    meta = type("M", (), dict(page_table=pt, q_start=qs, kv_len=kl, block_mask=None, mask_start=None))
    ref = attention.attend(q, kv, meta)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(paged_attention_reference(q, kv, pt, qs, kl)))
    got = attention.attend(q, kv, meta, AttnImpl("pallas", interpret=True))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_plain_steps_run_the_configured_kernel(monkeypatch):
    """The kernel a model was configured with is what its programs trace (no global state), once for
    all the layers (one shared lowering)."""
    from pallas_kernels import paged_attention_pallas as pap
    calls = []
    real = pap.paged_attention_pallas
    monkeypatch.setattr(pap, "paged_attention_pallas", lambda *a, **k: calls.append(k) or real(*a, **k))
    attention.implementation.cache_clear()  # built again with the patched kernel
    try:
        cfg = tiny_config()
        model = attention.configure(tiny_model(cfg), AttnImpl("pallas", interpret=True, block_kv=16))
        steps, w = decode.compile_steps(*nnx.split(model))
        cache = init_cache(cfg, num_pages=9, page_size=4, max_slots=2, max_seq_len=16, dtype=jnp.float32)
        cache.page_table = jnp.asarray(np.arange(1, 9, dtype=np.int32).reshape(2, 4))
        state = decode.DecodeState(cache, jnp.zeros((2,), jnp.int32))
        tokens = jnp.asarray([[5, 6, 7, 0], [8, 9, 0, 0]], jnp.int32)
        out, state = steps.prefill(w, state, tokens, jnp.asarray([3, 2], jnp.int32),
                                   jnp.arange(2, dtype=jnp.int32), None, stochastic=False)
    finally:
        attention.implementation.cache_clear()  # the patched kernel is not kept for other tests
    assert cfg.num_layers > 1 and len(calls) == 1
    assert calls[0].get("block_kv") == 16 and calls[0].get("interpret")
    assert np.asarray(out.tokens).shape == (2,)


def test_engine_chooses_for_target_and_draft_models_only():
    """The engine resolves the attention once for the target and for a draft model of its own; the
    n-gram drafter has no model and no KV cache: nothing to choose for it."""
    import dataclasses

    from specjax.drafter import DraftInfo
    from specjax.engine import BatchOptions, CacheOptions, Draft, Engine
    from specjax.tree import SpecConfig
    cfg = tiny_config()
    model = tiny_model(cfg)
    opts = (CacheOptions(page_size=4, max_seq_len=32), BatchOptions(max_batch=2), jnp.float32)
    eng = Engine(model, cfg, *opts, draft=Draft(None, None, DraftInfo("ngram"), SpecConfig(method="ngram", num_steps=3)))
    assert eng.attention_choice == {"attention": "attention: reference (auto)"}
    dcfg = dataclasses.replace(cfg, num_layers=1)
    draft = Draft(tiny_model(dcfg, seed=1), dcfg, DraftInfo("draft"), SpecConfig(method="draft", num_steps=2))
    eng = Engine(model, cfg, *opts, draft=draft, attention="reference")
    assert eng.attention_choice == {"attention": "attention: reference (forced)",
                                    "draft attention": "attention: reference (forced)"}
    assert all(m.attn_impl == attention.REFERENCE for _, m in nnx.iter_modules(eng.draft.model)
               if isinstance(m, Attention))


def test_splits_at_most_caps_the_splitting_kernels_while_tracing(monkeypatch):
    """Under splits_at_most(n) attend hands the kernels that split a row's keys a cap of n (unless the
    impl fixes its own num_splits); other implementations and calls outside the scope are unchanged."""
    seen = []
    monkeypatch.setattr(attention, "implementation", lambda impl: seen.append(impl) or (lambda *a, **k: None))
    meta = types.SimpleNamespace(page_table=None, q_start=None, kv_len=None, block_mask=None, mask_start=None)
    pallas, fixed, mosaic = AttnImpl("pallas", interpret=True), AttnImpl("pallas", num_splits=16), AttnImpl("mosaic_gpu")
    with attention.splits_at_most(4):
        for impl in (pallas, fixed, mosaic, attention.REFERENCE):
            attention.attend(None, None, meta, impl)
    attention.attend(None, None, meta, pallas)
    assert seen == [dataclasses.replace(pallas, max_splits=4), fixed, dataclasses.replace(mosaic, max_splits=4),
                    attention.REFERENCE, pallas]


def test_write_and_attend_fuses_the_write_for_block_masked_calls():
    """write_and_attend: the Mosaic GPU impl takes a block-masked call's write into its kernel (one launch,
    the scatter gone): a tree verify, a draft level whose meta knows q_start - mask_start (offset); a growth
    meta without it, causal calls (prefill, decode) and other impls write with write_kv then attend. The
    values of the two ways: test_mosaic_interpreted_write_and_attend (verify and growth)."""
    from specjax.kv_cache import write_kv
    rng = np.random.default_rng(4)
    q, kv, pt, qs, kl, mask = _case(rng, T=5, tree=True)
    k, v = (jnp.asarray(rng.normal(size=(3, 5, 2, 64)), jnp.bfloat16) for _ in range(2))
    widx = jnp.asarray(rng.permutation(kv.shape[0] * kv.shape[1])[:15].reshape(3, 5), jnp.int32)

    def meta(block_mask, mask_start=None, offset=None):
        return types.SimpleNamespace(page_table=pt, q_start=qs, kv_len=kl, write_idx=widx, block_mask=block_mask,
                                     mask_start=mask_start, offset=offset)

    def text(impl, m):
        return str(jax.make_jaxpr(lambda *a: attention.write_and_attend(*a, m, impl))(q, k, v, kv))
    mosaic = AttnImpl("mosaic_gpu", interpret=True, fuse_write=True)
    assert "paged_attention_write_mosaic" in text(mosaic, meta(mask))
    assert "paged_attention_write_mosaic" in text(mosaic, meta(mask, mask_start=qs, offset=0))
    for impl, m in [(mosaic, meta(mask, mask_start=qs)), (mosaic, meta(None)), (AttnImpl(), meta(mask)),
                    (dataclasses.replace(mosaic, fuse_write=False), meta(mask))]:
        t = text(impl, m)
        assert "paged_attention_write_mosaic" not in t and "scatter" in t
    o, pages = attention.write_and_attend(q, k, v, kv, meta(mask))  # reference: write_kv, then attend
    np.testing.assert_array_equal(np.asarray(pages, np.float32), np.asarray(write_kv(kv, k, v, widx), np.float32))
    want = paged_attention_reference(q, pages, pt, qs, kl, mask)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(want, np.float32))


def test_fuse_write_follows_the_environment(monkeypatch):
    """resolve's fuse_write: $SPECJAX_FUSE_KV_WRITE (1 / 0) over the default; other values are an error."""
    kw = dict(dtype=jnp.bfloat16, page_size=16, head_dim=64, backend="cpu")
    monkeypatch.delenv(attention.FUSE_WRITE_ENV, raising=False)
    assert attention.resolve(**kw)[0].fuse_write is attention.FUSE_WRITE_DEFAULT
    for v, want in (("1", True), ("0", False)):
        monkeypatch.setenv(attention.FUSE_WRITE_ENV, v)
        assert attention.resolve(**kw)[0].fuse_write is want
    monkeypatch.setenv(attention.FUSE_WRITE_ENV, "yes")
    with pytest.raises(ValueError, match="SPECJAX_FUSE_KV_WRITE must be 0 or 1"):
        attention.resolve(**kw)
