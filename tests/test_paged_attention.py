"""paged_attention_reference against naive dense attention, and the KV write path."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
from specjax.kv_cache import TRASH_PAGE, write_indices, write_kv

H, HKV, D = 4, 2, 8
G = H // HKV


def tree_mask(rng, T: int) -> np.ndarray:
    """[T, T] bool: token i sees itself and its ancestors in a random tree (root parent = prefix)."""
    parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, T)]
    m = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def dense_attention(q, k, v, prefix: int, num_new: int, visible_new, window=None):
    """Naive per-query loop. q: [T, H, D]; k, v: [S_row, Hkv, D] contiguous row (prefix + new tokens).
    visible_new(i, j): new token i may see new token j. Returns [num_new, H, D] (valid queries)."""
    out = np.zeros((num_new, H, D))
    for i in range(num_new):
        qpos = prefix + i
        keys = [kk for kk in range(prefix + num_new)
                if (kk < prefix or visible_new(i, kk - prefix)) and (window is None or qpos - kk < window)]
        for h in range(H):
            kh = h // G  # query head h reads kv head h // G
            s = np.array([q[i, h] @ k[kk, kh] for kk in keys]) / np.sqrt(D)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(pj * v[kk, kh] for pj, kk in zip(p, keys))
    return out


def scatter_rows(rng, rows_k, rows_v, page_size: int, num_pages: int, pages_per_row: int):
    """Put each row's contiguous K/V into random, non-contiguous pages. Everything else (unused pages,
    the trash page, the tail of a row's last page) holds large garbage that must never be read."""
    k_pages = rng.normal(0, 100.0, (num_pages, page_size, HKV, D))
    v_pages = rng.normal(0, 100.0, (num_pages, page_size, HKV, D))
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(rows_k), pages_per_row), np.int32)  # unused columns -> trash page 0
    used = 0
    for b, (rk, rv) in enumerate(zip(rows_k, rows_v)):
        n = len(rk)
        npages = -(-n // page_size)
        table[b, :npages] = perm[used: used + npages]
        used += npages
        for t in range(n):
            page, off = table[b, t // page_size], t % page_size
            k_pages[page, off] = rk[t]
            v_pages[page, off] = rv[t]
    return k_pages, v_pages, table


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mode", ["causal", "tree", "window", "tree_window"])
def test_reference_matches_dense(page_size, mode):
    rng = np.random.default_rng(page_size * 7 + len(mode))
    T = 6
    prefix = [0, 5, 11]  # q_start per row
    num_new = [6, 3, 1]  # ragged: rows 1 and 2 have padding queries
    window = 4 if "window" in mode else None
    B = len(prefix)
    max_len = max(p + T for p in prefix)
    pages_per_row = -(-max_len // page_size) + 1  # one spare (trash) column
    num_pages = B * pages_per_row + 3
    q = rng.normal(size=(B, T, H, D))
    rows_k = [rng.normal(size=(p + n, HKV, D)) for p, n in zip(prefix, num_new)]
    rows_v = [rng.normal(size=(p + n, HKV, D)) for p, n in zip(prefix, num_new)]
    k_pages, v_pages, table = scatter_rows(rng, rows_k, rows_v, page_size, num_pages, pages_per_row)
    block = np.stack([tree_mask(rng, T) for _ in range(B)]) if "tree" in mode else None
    if block is not None:
        assert not np.array_equal(block[0], np.tril(np.ones((T, T), bool))), "tree should not be causal"
    out = paged_attention_reference(
        jnp.asarray(q, jnp.float32), jnp.asarray(np.stack([k_pages, v_pages], 2), jnp.float32),
        jnp.asarray(table), jnp.asarray(prefix, jnp.int32), jnp.asarray(np.add(prefix, num_new), jnp.int32),
        None if block is None else jnp.asarray(block), sliding_window=window)
    out = np.asarray(out, np.float64)
    assert out.shape == (B, T, H, D)
    for b in range(B):
        if block is None:
            vis = lambda i, j: j <= i  # noqa: E731
        else:
            vis = lambda i, j, m=block[b]: bool(m[i, j])  # noqa: E731
        want = dense_attention(q[b], rows_k[b], rows_v[b], prefix[b], num_new[b], vis, window)
        np.testing.assert_allclose(out[b, : num_new[b]], want, atol=2e-5, rtol=1e-5,
                                   err_msg=f"row {b} page_size {page_size} {mode}")


def test_reference_bf16_close():
    rng = np.random.default_rng(3)
    T, page_size = 5, 4
    prefix, num_new = [3, 7], [5, 2]
    q = rng.normal(size=(2, T, H, D))
    rows_k = [rng.normal(size=(p + n, HKV, D)) for p, n in zip(prefix, num_new)]
    rows_v = [rng.normal(size=(p + n, HKV, D)) for p, n in zip(prefix, num_new)]
    k_pages, v_pages, table = scatter_rows(rng, rows_k, rows_v, page_size, 12, 4)
    out = paged_attention_reference(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(np.stack([k_pages, v_pages], 2), jnp.bfloat16),
        jnp.asarray(table), jnp.asarray(prefix, jnp.int32), jnp.asarray(np.add(prefix, num_new), jnp.int32))
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float64)
    for b in range(2):
        want = dense_attention(q[b], rows_k[b], rows_v[b], prefix[b], num_new[b], lambda i, j: j <= i)
        np.testing.assert_allclose(out[b, : num_new[b]], want, atol=5e-2)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_write_indices_and_write_kv(page_size):
    rng = np.random.default_rng(page_size)
    B, T, P = 3, 7, 8
    num_pages = B * P + 1
    perm = rng.permutation(np.arange(1, num_pages))
    table = perm[: B * P].reshape(B, P).astype(np.int32)
    start = np.array([0, 5, 2 * page_size + 1], np.int32)
    num_new = np.array([7, 2, 0], np.int32)  # row 2: only padding
    idx = np.asarray(write_indices(jnp.asarray(table), jnp.asarray(start), jnp.asarray(num_new), T, page_size))
    assert idx.shape == (B, T) and idx.dtype == np.int32
    for b in range(B):
        for t in range(T):
            if t < num_new[b]:
                pos = start[b] + t
                assert idx[b, t] == table[b, pos // page_size] * page_size + pos % page_size, (b, t)
            else:
                assert idx[b, t] // page_size == TRASH_PAGE, (b, t)

    k0 = rng.normal(size=(num_pages, page_size, HKV, D)).astype(np.float32)
    v0 = rng.normal(size=(num_pages, page_size, HKV, D)).astype(np.float32)
    k_new = rng.normal(size=(B, T, HKV, D)).astype(np.float32)
    v_new = rng.normal(size=(B, T, HKV, D)).astype(np.float32)
    kvp = write_kv(jnp.asarray(np.stack([k0, v0], 2)), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(idx))
    kp, vp = np.asarray(kvp[:, :, 0]), np.asarray(kvp[:, :, 1])
    want_k, want_v = k0.copy(), v0.copy()
    for b in range(B):
        for t in range(num_new[b]):
            pos = start[b] + t
            page, off = table[b, pos // page_size], pos % page_size
            want_k[page, off] = k_new[b, t]
            want_v[page, off] = v_new[b, t]
    # every page but the trash page is exactly: old content + real tokens where the table says
    np.testing.assert_array_equal(kp[1:], want_k[1:])
    np.testing.assert_array_equal(vp[1:], want_v[1:])
    # padding tokens went to the trash page only; several of them share an entry there, and write_kv
    # declares its indices unique, so an entry may mix their elements: each element is one of them
    assert not np.array_equal(kp[TRASH_PAGE], k0[TRASH_PAGE])
    pads = [(b, t) for b in range(B) for t in range(num_new[b], T)]
    for off in range(page_size):
        cands = [k0[TRASH_PAGE, off]] + [k_new[b, t] for b, t in pads if idx[b, t] % page_size == off]
        assert (np.stack(cands) == kp[TRASH_PAGE, off][None]).any(axis=0).all(), off


@pytest.mark.parametrize("T,G,W,block_q", [(21, 3, 21, 64), (4, 3, 16, 64), (5, 4, 40, 64), (17, 4, 70, 128)])
def test_pack_block_rows_bits(T, G, W, block_q):
    """The packed block mask: bit w % 32 of word w // 32 of query row r = t * G + g is block_mask[b, t, w],
    rows past T * G are zero (brute force, words of one and of several 32-bit groups)."""
    from pallas_kernels.paged_attention import Geometry, pack_block_rows
    B = 2
    g = Geometry(B=B, T=T, H=3 * G, Hkv=3, D=64, P=8, ps=16, block_q=block_q, window=None, scale=0.125)
    mask = np.random.default_rng(T + W).random((B, T, W)) < 0.5
    got = np.asarray(pack_block_rows(jnp.asarray(mask), g)).astype(np.int64) & 0xFFFFFFFF
    nw = -(-W // 32)
    assert got.shape == (B, nw, g.Rp)
    want = np.zeros((B, nw, g.Rp), np.int64)
    for b in range(B):
        for t in range(T):
            for gi in range(G):
                for w in range(W):
                    if mask[b, t, w]:
                        want[b, w // 32, t * G + gi] |= 1 << (w % 32)
    np.testing.assert_array_equal(got, want)
