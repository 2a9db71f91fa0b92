"""kv_compact: moving an accepted draft path to contiguous cache positions in a paged KV cache.

Pages are per-layer [N, page_size, 2, Hkv, D] arrays (K and V side by side); a list may mix target
and draft layers of other shapes / dtypes. Checked: the reference against a brute-force numpy loop,
the generic Pallas kernel (interpret mode) and the Mosaic GPU kernel (its CPU interpreter) against
the reference bitwise, untouched entries, overlapping / identity paths, dispatch order, the Mosaic
GPU lowering for CUDA (cross-platform export, no GPU needed) and input validation.
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_compact as kvc
from pallas_kernels.kv_compact import (
    kv_compact,
    kv_compact_mosaic,
    kv_compact_pallas,
    kv_compact_reference,
)
from pallas_kernels.mosaic_gpu import interpreter_available

# trailing page shapes [2, Hkv, D] and dtypes of target / draft layers
T32 = ((2, 2, 8), jnp.float32)
T16 = ((2, 2, 8), jnp.bfloat16)
D32 = ((2, 1, 4), jnp.float32)  # a draft model with fewer heads and a smaller head dim
D16 = ((2, 1, 4), jnp.bfloat16)
MAX_NODES = 16  # draft tree size bound

_ref_jit = jax.jit(kv_compact_reference)
_pallas_jit = jax.jit(functools.partial(kv_compact_pallas, interpret=True))
_mosaic_jit = jax.jit(functools.partial(kv_compact_mosaic, interpret=True))


needs_gpu_interpreter = pytest.mark.skipif(not interpreter_available(),
                                           reason="no Mosaic GPU interpreter in this jax")


def tree_path(rng, n_nodes: int) -> list[int]:
    """Root-to-node path (strictly increasing node indices, starting at 0) in a random tree."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n_nodes)]
    node = int(rng.integers(0, n_nodes))
    path = []
    while node >= 0:
        path.append(node)
        node = parent[node]
    return path[::-1]


def make_case(rng, *, B, layers, page_size, A, n_nodes=None, aligned=False, trash_tail=False):
    """Random pages (garbage everywhere) for each (trailing shape, dtype) in `layers`, per-row
    non-contiguous page tables, starts (paths spill into partly filled next pages) and accepted
    paths of random trees."""
    n_nodes = n_nodes or int(rng.integers(8, 17))
    max_start = 3 * page_size + 1
    P = -(-(max_start + MAX_NODES) // page_size) + 1  # shapes independent of the tree: one compile
    num_pages = B * P + 3  # + trash page + spare pages that belong to nobody
    perm = rng.permutation(np.arange(1, num_pages))
    table = perm[: B * P].reshape(B, P).astype(np.int32)
    start = np.zeros(B, np.int32)
    acc = np.full((B, A), -1, np.int32)
    nacc = np.zeros(B, np.int32)
    for b in range(B):
        start[b] = 0 if aligned else int(rng.integers(0, max_start + 1))
        path = tree_path(rng, n_nodes)[:A]
        assert path[0] == 0 and all(x >= j for j, x in enumerate(path))
        assert all(x < y for x, y in itertools.pairwise(path))
        nacc[b] = int(rng.integers(0, len(path) + 1))
        acc[b, : nacc[b]] = path[: nacc[b]]
        if trash_tail:  # columns past what the row can reach point at the trash page
            last = (start[b] + n_nodes - 1) // page_size
            table[b, last + 1:] = 0
    pages = [jnp.asarray(rng.normal(0, 10, (num_pages, page_size) + tail).astype(np.float32), dtype)
             for tail, dtype in layers]
    return pages, jnp.asarray(table), jnp.asarray(start), jnp.asarray(acc), jnp.asarray(nacc)


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


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


CASES = [  # (B, page_size, A, layers, seed)
    (1, 1, 6, [T32, T32], 0),
    (2, 4, 5, [T32, D32, T32], 1),
    (3, 16, 8, [T32], 2),
    (4, 4, 6, [T16, T16, D16], 3),
    (4, 1, 4, [T16, D32], 4),  # mixed dtypes: target bf16, draft f32
    (2, 16, 6, [T16, D16, T16], 5),
]


@pytest.mark.parametrize("B,page_size,A,layers,seed", CASES)
def test_reference_matches_brute_force(B, page_size, A, layers, seed):
    rng = np.random.default_rng(seed)
    for trial in range(3):
        pages, table, start, acc, nacc = make_case(rng, B=B, layers=layers, page_size=page_size, A=A,
                                                   aligned=trial == 0, trash_tail=trial == 2)
        out = _ref_jit(pages, table, start, acc, nacc)
        assert len(out) == len(layers)
        for before, after in zip(pages, out):
            assert after.dtype == before.dtype and after.shape == before.shape
            np.testing.assert_array_equal(as_f32(after), brute_force(before, table, start, acc, nacc))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_in_place_on_this_backend(dtype):
    """The reference as the engine runs it: jitted with the pages donated (so the scatter may update
    them in place), a SmolLM2-sized entry (2 x 3 heads x 64), paths whose moves overlap (an entry
    read by one move is written by another). Runs on whatever backend jax has (the GPU's fusion of
    the gather into an in-place scatter is what it checks there; the CPU passes either way)."""
    rng = np.random.default_rng(7)
    fn = jax.jit(kv_compact_reference, donate_argnums=0)
    for trial in range(4):
        pages, table, start, acc, nacc = make_case(rng, B=4, layers=[((2, 3, 64), dtype)] * 2, page_size=16,
                                                   A=8, n_nodes=16)
        acc = np.asarray(acc).copy()
        for b in range(acc.shape[0]):  # move j reads the entry that move 2j writes
            acc[b] = [0] + [2 * j - (trial % 2) * (j > 1) for j in range(1, acc.shape[1])]
        nacc = jnp.full_like(nacc, acc.shape[1])
        want = [brute_force(p, table, start, acc, nacc) for p in pages]
        got = fn(pages, table, start, jnp.asarray(acc), nacc)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(as_f32(g), w)


@pytest.mark.parametrize("B,page_size,A,layers,seed", CASES)
def test_pallas_matches_reference(B, page_size, A, layers, seed):
    rng = np.random.default_rng(100 + seed)
    for trial in range(2):
        args = make_case(rng, B=B, layers=layers, page_size=page_size, A=A, trash_tail=trial == 1)
        assert_bitwise(_pallas_jit(*args), _ref_jit(*args))


MOSAIC_CASES = [  # (B, page_size, A, layers, seed): the interpreter is slow, keep these few
    (2, 4, 5, [T32, D16, T32], 20),
    (3, 1, 6, [T16], 21),
    (4, 16, 6, [T32, D32], 22),
]


@needs_gpu_interpreter
@pytest.mark.parametrize("B,page_size,A,layers,seed", MOSAIC_CASES)
def test_mosaic_interpreted_matches_reference(B, page_size, A, layers, seed):
    rng = np.random.default_rng(seed)
    args = make_case(rng, B=B, layers=layers, page_size=page_size, A=A, trash_tail=seed % 2 == 0)
    assert_bitwise(_mosaic_jit(*args), _ref_jit(*args))


@needs_gpu_interpreter
def test_mosaic_pallas_call_entry_interpreted():
    # jax 0.10.2's Mosaic GPU interpreter runs every pallas_call grid point with program_id 0, so
    # the pallas_call entry can only be checked here on a one-program grid (B = 1, one layer).
    rng = np.random.default_rng(23)
    fn = jax.jit(functools.partial(kv_compact_mosaic, entry="pallas_call", interpret=True))
    args = make_case(rng, B=1, layers=[T16], page_size=4, A=6, n_nodes=12)
    assert_bitwise(fn(*args), _ref_jit(*args))


@pytest.mark.parametrize("entry", ["kernel", "pallas_call"])
def test_mosaic_lowers_for_cuda(entry):
    """The Mosaic GPU lowering itself (Python side: TMA / barrier / aliasing) for CUDA, through a
    cross-platform export; compiling to a cubin and running need a GPU."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from jax import export
    B, P, A, L = 4, 8, 6, 3
    def i32(*s):
        return jax.ShapeDtypeStruct(s, jnp.int32)

    pages = [jax.ShapeDtypeStruct((256, 16, 2, 8, 128), jnp.bfloat16) for _ in range(L)]
    pages.append(jax.ShapeDtypeStruct((256, 16, 2, 2, 64), jnp.float32))  # a draft layer: 2nd group
    fn = jax.jit(functools.partial(kv_compact_mosaic, entry=entry), donate_argnums=(0,))
    text = export.export(fn, platforms=["cuda"])(pages, i32(B, P), i32(B), i32(B, A), i32(B)).mlir_module()
    assert text.count("mosaic_gpu_v2(") == 2  # one launch per shape/dtype group
    assert text.count("output_operand_alias<") == L + 1  # every layer updated in place


def test_mosaic_rejects_unsupported_entries():
    rng = np.random.default_rng(24)
    pages, table, start, acc, nacc = make_case(rng, B=1, layers=[T32], page_size=4, A=3)
    odd = [jnp.zeros((pages[0].shape[0], 4, 2, 1, 3), jnp.bfloat16)]  # 12 bytes per entry
    with pytest.raises(ValueError, match="16-byte rows"):
        jax.eval_shape(kv_compact_mosaic, odd, table, start, acc, nacc)
    with pytest.raises(ValueError, match="entry must be"):
        kv_compact_mosaic(pages, table, start, acc, nacc, entry="triton")


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_only_destinations_change(impl):
    rng = np.random.default_rng(7)
    fn = _ref_jit if impl == "reference" else _pallas_jit
    for page_size in (1, 16):
        pages, table, start, acc, nacc = make_case(rng, B=3, layers=[T32, D16], page_size=page_size,
                                                   A=6, trash_tail=True)
        nacc = jnp.asarray(np.asarray(nacc) * np.array([1, 0, 1], np.int32))  # row 1: nothing accepted
        out = fn(pages, table, start, acc, nacc)
        dest = destinations(table, start, nacc, page_size)
        assert not any(page == 0 for page, _ in dest)
        keep = np.ones(pages[0].shape[:2], bool)
        for page, off in dest:
            keep[page, off] = False
        assert keep[0].all()  # the trash page is untouched
        for before, after in zip(pages, out):
            np.testing.assert_array_equal(as_f32(after)[keep], as_f32(before)[keep])
            # row 1's pages (num_accepted 0) are fully unchanged
            rows1 = np.asarray(table[1])
            np.testing.assert_array_equal(as_f32(after)[rows1], as_f32(before)[rows1])
            # and the destinations hold exactly the brute-force result
            np.testing.assert_array_equal(as_f32(after), brute_force(before, table, start, acc, nacc))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_identity_and_overlap(impl, page_size):
    rng = np.random.default_rng(11)
    fn = _ref_jit if impl == "reference" else _pallas_jit
    pages, table, start, _, _ = make_case(rng, B=3, layers=[T32, D32], page_size=page_size, A=6,
                                          n_nodes=16)
    acc = jnp.array([[0, 1, 2, 3, 4, 5],  # identity: nothing moves
                     [0, 1, 3, 4, 5, 7],  # overlapping: sources 3,4,5 are also destinations 3,4
                     [0, 2, 3, 4, 6, -1]], jnp.int32)  # shifted run; source 3 -> 2, 4 -> 3 ...
    nacc = jnp.array([6, 6, 5], jnp.int32)
    start = start.at[0].set(page_size - 1)  # unaligned, spills into the next page
    out = fn(pages, table, start, acc, nacc)
    tab, st = np.asarray(table), np.asarray(start)
    ps = page_size

    def entry(p, b, pos):
        pos = int(st[b] + pos)
        return as_f32(p)[tab[b, pos // ps], pos % ps]

    for before, after in zip(pages, out):
        for j in range(6):  # row 0: identity
            np.testing.assert_array_equal(entry(after, 0, j), entry(before, 0, j))
        for j, src in enumerate([0, 1, 3, 4, 5, 7]):
            np.testing.assert_array_equal(entry(after, 1, j), entry(before, 1, src))
        for j, src in enumerate([0, 2, 3, 4, 6]):
            np.testing.assert_array_equal(entry(after, 2, j), entry(before, 2, src))
        np.testing.assert_array_equal(as_f32(after), brute_force(before, table, start, acc, nacc))

    # all-identity batch: the whole cache is unchanged
    acc_id = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (3, 6))
    out3 = fn(pages, table, start, acc_id, jnp.array([6, 3, 0], jnp.int32))
    for before, after in zip(pages, out3):
        np.testing.assert_array_equal(as_f32(after), as_f32(before))


def test_out_of_capacity_moves_are_dropped():
    rng = np.random.default_rng(3)
    pages, table, _, acc, _ = make_case(rng, B=2, layers=[T32], page_size=4, A=4, n_nodes=8)
    cap = table.shape[1] * 4
    start = jnp.array([cap - 2, cap - 6], jnp.int32)  # row 0: path source runs past the capacity
    acc = jnp.array([[0, 1, 3, 5], [0, 2, 4, 7]], jnp.int32)
    nacc = jnp.array([4, 4], jnp.int32)
    ref = _ref_jit(pages, table, start, acc, nacc)
    for before, r in zip(pages, ref):
        np.testing.assert_array_equal(as_f32(r), brute_force(before, table, start, acc, nacc))
    assert_bitwise(_pallas_jit(pages, table, start, acc, nacc), ref)
    if interpreter_available():
        assert_bitwise(_mosaic_jit(pages, table, start, acc, nacc), ref)


@pytest.mark.parametrize("impl", ["reference", "pallas", "mosaic"])
def test_wrapper_dispatch_and_jit(impl):
    if impl == "mosaic" and not interpreter_available():
        pytest.skip("no Mosaic GPU interpreter in this jax")
    rng = np.random.default_rng(5)
    pages, table, start, acc, nacc = make_case(rng, B=2, layers=[T16, D32], page_size=4, A=5)
    fn = jax.jit(functools.partial(kv_compact, impl=impl, interpret=True), donate_argnums=(0,))
    want = [brute_force(p, table, start, acc, nacc) for p in pages]
    out = fn([jnp.array(p) for p in pages], table, start, acc, nacc)  # copies: the inputs are donated
    assert [o.dtype for o in out] == [p.dtype for p in pages]
    for w, after in zip(want, out):
        np.testing.assert_array_equal(as_f32(after), w)


def test_the_wrapper_never_chooses(monkeypatch):
    """kv_compact runs the implementation it is given: no "auto", no probe, no fallback in a trace."""
    rng = np.random.default_rng(6)
    args = make_case(rng, B=2, layers=[T32], page_size=4, A=4)
    with pytest.raises(ValueError, match="made once"):
        jax.jit(functools.partial(kv_compact, impl="auto"))(*args)
    # the name given is the function that runs (here a stand-in for the Triton kernel)
    monkeypatch.setattr(kvc, "kv_compact_pallas", lambda *a, **kw: "pallas ran")
    assert kv_compact(*args, impl="pallas") == "pallas ran"


def test_compile_error_reports_instead_of_raising():
    rng = np.random.default_rng(8)
    args = make_case(rng, B=1, layers=[T32], page_size=4, A=3)
    assert kvc.compile_error("reference", *args) is None
    # on CPU a Mosaic GPU kernel cannot compile: the probe says why instead of raising
    if jax.default_backend() != "gpu":
        assert "needs a GPU backend" in kvc.compile_error("mosaic", *args)


def test_validation_errors():
    rng = np.random.default_rng(9)
    case = make_case(rng, B=2, layers=[T32, D16], page_size=4, A=5)
    pages = [np.asarray(p) for p in case[0]]  # numpy: slicing below runs no jax ops
    table, start, acc, nacc = map(np.asarray, case[1:])

    def err(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            kv_compact(*args, **kw)

    err("page counts / page sizes differ", [pages[0], pages[1][:-1]], table, start, acc, nacc)
    err("page counts / page sizes differ", [pages[0], pages[1][:, :2]], table, start, acc, nacc)
    err("at least one layer", [], table, start, acc, nacc)
    err("list", pages[0], table, start, acc, nacc)
    err(r"\[num_pages, page_size, \.\.\.\]", [x[0, 0, 0] for x in pages], table, start, acc, nacc)
    err("empty dimension", [pages[0][:, :, :0]], table, start, acc, nacc)
    err("page_table must be rank 2", pages, table[0], start, acc, nacc)
    err("start must be", pages, table, start[:1], acc, nacc)
    err("accept_idx must be", pages, table, start, acc[:1], nacc)
    err("accept_idx must be", pages, table, start, acc[0], nacc)
    err("num_accepted must be", pages, table, start, acc, nacc[None])
    err("integer", pages, table, start.astype(np.float32), acc, nacc)
    err("impl must be", pages, table, start, acc, nacc, impl="triton")
    err("needs a GPU backend", pages, table, start, acc, nacc, impl="mosaic")
    # mixed trailing shapes and dtypes are fine (grouped internally)
    out = jax.eval_shape(functools.partial(kv_compact, impl="reference"), *case)
    assert [(o.shape, o.dtype) for o in out] == [(p.shape, p.dtype) for p in case[0]]
