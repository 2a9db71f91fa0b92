"""kv_compact: moving an accepted draft path to contiguous cache positions in a paged KV cache.

Reference against a brute-force numpy loop, the Pallas kernel (interpret mode) against the
reference, untouched entries, overlapping / identity paths, and input validation.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_compact import kv_compact, kv_compact_pallas, kv_compact_reference

HKV, D = 2, 4

_ref_jit = jax.jit(kv_compact_reference)
_pallas_jit = jax.jit(functools.partial(kv_compact_pallas, interpret=True))


def tree_path(rng, n_nodes: int) -> list[int]:
    """Root-to-node path (strictly increasing node indices, starting at 0) in a random tree."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n_nodes)]
    node = int(rng.integers(0, n_nodes))
    path = []
    while node >= 0:
        path.append(node)
        node = parent[node]
    return path[::-1]


def make_case(rng, *, B, L, page_size, A, dtype, n_nodes=None, aligned=False, trash_tail=False):
    """Random pages (garbage everywhere), per-row non-contiguous page tables, starts and accepted paths."""
    n_nodes = n_nodes or int(rng.integers(8, 17))
    max_start = 3 * page_size + 1
    P = -(-(max_start + n_nodes) // page_size) + 1
    num_pages = B * P + 3  # + trash page + spare pages that belong to nobody
    perm = rng.permutation(np.arange(1, num_pages))
    table = perm[: B * P].reshape(B, P).astype(np.int32)
    start = np.zeros(B, np.int32)
    acc = np.full((B, A), -1, np.int32)
    nacc = np.zeros(B, np.int32)
    for b in range(B):
        start[b] = 0 if aligned else int(rng.integers(0, max_start + 1))
        path = tree_path(rng, n_nodes)[:A]
        nacc[b] = int(rng.integers(0, len(path) + 1))
        acc[b, : nacc[b]] = path[: nacc[b]]
        if trash_tail:  # columns past what the row can reach point at the trash page
            last = (start[b] + n_nodes - 1) // page_size
            table[b, last + 1:] = 0
    shape = (num_pages, page_size, HKV, D)
    k = [rng.normal(0, 10, shape).astype(np.float32) for _ in range(L)]
    v = [rng.normal(0, 10, shape).astype(np.float32) for _ in range(L)]
    k = [jnp.asarray(x, dtype) for x in k]
    v = [jnp.asarray(x, dtype) for x in v]
    return k, v, jnp.asarray(table), jnp.asarray(start), jnp.asarray(acc), jnp.asarray(nacc)


def brute_force(pages, table, start, acc, nacc):
    """Per row, per j: copy the entry at flat cache position start + acc[j] to start + j.
    All sources are read from the original pages (gather first, then scatter)."""
    pages = np.asarray(pages.astype(jnp.float32))
    table, start, acc, nacc = map(np.asarray, (table, start, acc, nacc))
    ps = pages.shape[1]
    cap = table.shape[1] * ps
    out = pages.copy()
    for b in range(table.shape[0]):
        for j in range(int(nacc[b])):
            src, dst = int(start[b] + acc[b, j]), int(start[b] + j)
            if acc[b, j] < 0 or src >= cap or dst >= cap:
                continue
            out[table[b, dst // ps], dst % ps] = pages[table[b, src // ps], src % ps]
    return out


def destinations(table, start, nacc, ps):
    """Set of (page, offset) written by the compaction (the destinations of valid moves)."""
    table, start, nacc = map(np.asarray, (table, start, nacc))
    return {(int(table[b, (start[b] + j) // ps]), int((start[b] + j) % ps))
            for b in range(table.shape[0]) for j in range(int(nacc[b]))}


def as_f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


CASES = [  # (B, L, page_size, A, dtype, seed)
    (1, 1, 1, 6, jnp.float32, 0),
    (2, 2, 4, 5, jnp.float32, 1),
    (3, 3, 16, 8, jnp.float32, 2),
    (4, 2, 4, 6, jnp.bfloat16, 3),
    (4, 1, 1, 4, jnp.bfloat16, 4),
    (2, 3, 16, 6, jnp.bfloat16, 5),
]


@pytest.mark.parametrize("B,L,page_size,A,dtype,seed", CASES)
def test_reference_matches_brute_force(B, L, page_size, A, dtype, seed):
    rng = np.random.default_rng(seed)
    for trial in range(4):
        k, v, table, start, acc, nacc = make_case(rng, B=B, L=L, page_size=page_size, A=A, dtype=dtype,
                                                  aligned=trial == 0, trash_tail=trial == 3)
        k2, v2 = _ref_jit(k, v, table, start, acc, nacc)
        assert len(k2) == L and len(v2) == L
        for before, after in zip(k + v, k2 + v2):
            assert after.dtype == before.dtype and after.shape == before.shape
            np.testing.assert_array_equal(as_f32(after), brute_force(before, table, start, acc, nacc))


@pytest.mark.parametrize("B,L,page_size,A,dtype,seed", CASES)
def test_pallas_matches_reference(B, L, page_size, A, dtype, seed):
    rng = np.random.default_rng(100 + seed)
    for trial in range(2):
        k, v, table, start, acc, nacc = make_case(rng, B=B, L=L, page_size=page_size, A=A, dtype=dtype,
                                                  trash_tail=trial == 1)
        kr, vr = _ref_jit(k, v, table, start, acc, nacc)
        kp, vp = _pallas_jit(k, v, table, start, acc, nacc)
        assert len(kp) == L and len(vp) == L
        for r, p in zip(kr + vr, kp + vp):
            assert p.dtype == r.dtype and p.shape == r.shape
            np.testing.assert_array_equal(as_f32(p), as_f32(r))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_only_destinations_change(impl):
    rng = np.random.default_rng(7)
    fn = _ref_jit if impl == "reference" else _pallas_jit
    for page_size in (1, 4, 16):
        k, v, table, start, acc, nacc = make_case(rng, B=3, L=2, page_size=page_size, A=6,
                                                  dtype=jnp.float32, trash_tail=True)
        nacc = nacc.at[1].set(0)  # a row with nothing accepted changes nothing
        k2, v2 = fn(k, v, table, start, acc, nacc)
        dest = destinations(table, start, nacc, page_size)
        assert not any(page == 0 for page, _ in dest)
        keep = np.ones(k[0].shape[:2], bool)
        for page, off in dest:
            keep[page, off] = False
        assert keep[0].all()  # the trash page is untouched
        for before, after in zip(k + v, k2 + v2):
            np.testing.assert_array_equal(as_f32(after)[keep], as_f32(before)[keep])
            # row 1's pages (num_accepted 0) are fully unchanged
            rows1 = np.asarray(table[1])
            np.testing.assert_array_equal(as_f32(after)[rows1], as_f32(before)[rows1])


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_identity_and_overlap(impl, page_size):
    rng = np.random.default_rng(11)
    fn = _ref_jit if impl == "reference" else _pallas_jit
    k, v, table, start, _, _ = make_case(rng, B=3, L=2, page_size=page_size, A=6, dtype=jnp.float32,
                                         n_nodes=16)
    acc = jnp.array([[0, 1, 2, 3, 4, 5],  # identity: nothing moves
                     [0, 1, 3, 4, 5, 7],  # overlapping: sources 3,4,5 are also destinations 3,4
                     [0, 2, 3, 4, 6, -1]], jnp.int32)  # shifted run; source 3 -> 2, 4 -> 3 ...
    nacc = jnp.array([6, 6, 5], jnp.int32)
    start = start.at[0].set(page_size - 1)  # unaligned, spills into the next page
    k2, v2 = fn(k, v, table, start, acc, nacc)
    tab, st = np.asarray(table), np.asarray(start)
    ps = page_size

    def entry(pages, b, pos):
        pos = int(st[b] + pos)
        return as_f32(pages)[tab[b, pos // ps], pos % ps]

    for before, after in zip(k + v, k2 + v2):
        for j in range(6):  # row 0: identity
            np.testing.assert_array_equal(entry(after, 0, j), entry(before, 0, j))
        for j, src in enumerate([0, 1, 3, 4, 5, 7]):
            np.testing.assert_array_equal(entry(after, 1, j), entry(before, 1, src))
        for j, src in enumerate([0, 2, 3, 4, 6]):
            np.testing.assert_array_equal(entry(after, 2, j), entry(before, 2, src))
        np.testing.assert_array_equal(as_f32(after), brute_force(before, table, start, acc, nacc))

    # all-identity batch: the whole cache is unchanged
    acc_id = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (3, 6))
    k3, v3 = fn(k, v, table, start, acc_id, jnp.array([6, 3, 0], jnp.int32))
    for before, after in zip(k + v, k3 + v3):
        np.testing.assert_array_equal(as_f32(after), as_f32(before))


def test_out_of_capacity_moves_are_dropped():
    rng = np.random.default_rng(3)
    k, v, table, _, acc, _ = make_case(rng, B=2, L=1, page_size=4, A=4, dtype=jnp.float32, n_nodes=8)
    cap = table.shape[1] * 4
    start = jnp.array([cap - 2, cap - 6], jnp.int32)  # row 0: path source runs past the capacity
    acc = jnp.array([[0, 1, 3, 5], [0, 2, 4, 7]], jnp.int32)
    nacc = jnp.array([4, 4], jnp.int32)
    kr, vr = _ref_jit(k, v, table, start, acc, nacc)
    kp, vp = _pallas_jit(k, v, table, start, acc, nacc)
    for before, r, p in zip(k + v, kr + vr, kp + vp):
        np.testing.assert_array_equal(as_f32(r), brute_force(before, table, start, acc, nacc))
        np.testing.assert_array_equal(as_f32(p), as_f32(r))


@pytest.mark.parametrize("impl", ["reference", "pallas", "auto"])
def test_wrapper_dispatch_and_jit(impl):
    rng = np.random.default_rng(5)
    k, v, table, start, acc, nacc = make_case(rng, B=2, L=2, page_size=4, A=5, dtype=jnp.bfloat16)
    fn = jax.jit(functools.partial(kv_compact, impl=impl, interpret=True), donate_argnums=())
    k2, v2 = fn(k, v, table, start, acc, nacc)
    for before, after in zip(k + v, k2 + v2):
        np.testing.assert_array_equal(as_f32(after), brute_force(before, table, start, acc, nacc))


def test_validation_errors():
    rng = np.random.default_rng(9)
    k, v, table, start, acc, nacc = make_case(rng, B=2, L=2, page_size=4, A=5, dtype=jnp.float32)

    def err(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            kv_compact(*args, **kw)

    err("page shapes differ", [k[0], k[1][:-1]], v, table, start, acc, nacc)
    err("page shapes differ", k, [v[0], v[1][:, :2]], table, start, acc, nacc)
    err("page dtypes differ", k, [v[0], v[1].astype(jnp.bfloat16)], table, start, acc, nacc)
    err("layers", k, v[:1], table, start, acc, nacc)
    err("at least one layer", [], [], table, start, acc, nacc)
    err("lists", k[0], v[0], table, start, acc, nacc)
    err(r"\[num_pages, page_size, Hkv, D\]", [x[0] for x in k], [x[0] for x in v], table, start, acc, nacc)
    err("page_table must be rank 2", k, v, table[0], start, acc, nacc)
    err("start must be", k, v, table, start[:1], acc, nacc)
    err("accept_idx must be", k, v, table, start, acc[:1], nacc)
    err("accept_idx must be", k, v, table, start, acc[0], nacc)
    err("num_accepted must be", k, v, table, start, acc, nacc[None])
    err("integer", k, v, table, start.astype(jnp.float32), acc, nacc)
    err("impl must be", k, v, table, start, acc, nacc, impl="triton")
