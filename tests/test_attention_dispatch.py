"""Every attention implementation at the dispatch point against the jnp reference.
Implementations that need a GPU (cuDNN) are skipped on CPU; run this file on the GPU machine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
from specjax import attention


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


def test_auto_dispatch_picks_reference_on_cpu_and_f32():
    rng = np.random.default_rng(1)
    args = _case(rng, dtype=jnp.float32)
    meta = type("M", (), dict(page_table=args[2], q_start=args[3], kv_len=args[4], block_mask=None, mask_start=None))
    out = attention.attend(args[0], args[1], meta)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(paged_attention_reference(*args[:5])))
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention.set_impl("nope")
