"""Top-k over the last axis as ONE variadic reduction (`top_k_reduce`), beside its reference `lax.top_k`.

The draft grows a tree level by level, and each level takes the k best of a few rows of draft logits
([B, F, Vd], F <= 8 rows of Vd = 16 384 for the shipped head). XLA's TopK custom call costs ~15 us per
such call on an H200 (75 us of a 1.3 ms SmolLM2 fused step; profile in docs/benchmarks.md), and it
grows with Vd. Here the k best are the result of a reduction whose accumulator is a sorted list of k
(value, index) pairs: an element is a list of one real entry padded with (-inf, V); two lists merge
into the k best of both (the first of two bitonic merge stages of their concatenation, then a bitonic
sort of the k survivors). Merging is associative and commutative under the total order "larger value
first, ties to the lower index", so XLA may reduce in any order and tree shape, and the result equals
lax.top_k's exactly: the same values and indices, ties to the lower index (tests/test_topk.py).
k is rounded up to a power of two inside (the merge network needs one) and the extra entries dropped.
`top_k_log_softmax` adds a running (max, sum of exponentials) pair to the accumulator (an online
log-sum-exp: associative up to float rounding), so a tree level's log-softmax and top-k are one reduction.

A long row is reduced in two stages: chunks of CHUNK entries first ([..., V] -> [..., V / CHUNK] lists,
padded with (-inf, V) to whole chunks), then the lists of the chunks. XLA gives a row reduction one block
per row, so a tree level's few rows (4 of 16 384) ran on 4 blocks: 11 us per level on an H200 (44 of the
draft's 270 us per fused step); in chunks the first stage has rows x chunks blocks: 3.6 + 1.5 us per level,
the fused step 1 243 -> 1 206 us (docs/benchmarks.md, 2026-11-28). The same merges in another order: the
same result (top-k exactly, log-sum-exp up to float rounding).

    top_k_reduce(x [..., V], k) -> (values [..., k] x.dtype, indices [..., k] int32)

Which one a program runs is a static kernel choice (specjax.kernels.Kernels.draft_topk), chosen once
at engine start.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("xla", "reduce")  # lax.top_k (XLA's TopK), top_k_reduce
CHUNK = 256  # entries per first-stage chunk of a long row (0: one stage); 256-2048 within ~1 us on an H200


def _better(va, ia, vb, ib):
    """a before b: larger value, ties to the lower index (NaN-free inputs)."""
    return (va > vb) | ((va == vb) & (ia < ib))


def _exchange(v, i, a: int, b: int):
    """Compare-exchange of entries a < b of the lists v, i (python lists of scalars): the better one to a."""
    keep = _better(v[a], i[a], v[b], i[b])
    v[a], v[b] = lax.select(keep, v[a], v[b]), lax.select(keep, v[b], v[a])
    i[a], i[b] = lax.select(keep, i[a], i[b]), lax.select(keep, i[b], i[a])


def _merge(kp: int, lse: bool = False):
    """The reducer: two sorted lists of kp (value..., index...) -> the kp best of both, sorted; with lse,
    two more entries (running max m, sum of exp(x - m)) merged as an online log-sum-exp."""
    def reducer(a, b):
        extra = ()
        if lse:
            (ma, sa), (mb, sb), a, b = a[-2:], b[-2:], a[:-2], b[:-2]
            m = jnp.maximum(ma, mb)
            def part(mx, sx):  # sx * exp(mx - m); an empty part (mx = -inf) adds 0 (no -inf - -inf)
                return jnp.where(mx == -jnp.inf, jnp.zeros_like(sx), sx * jnp.exp(mx - jnp.where(m == -jnp.inf, 0, m)))
            extra = (m, part(ma, sa) + part(mb, sb))
        va, ia, vb, ib = list(a[:kp]), list(a[kp:]), list(b[:kp]), list(b[kp:])
        # a sorted best-first, b reversed: the entrywise better of a[j] and b[kp-1-j] are the kp best
        # of the 2 kp, as a bitonic sequence (Batcher's first merge stage)
        v, i = [], []
        for j in range(kp):
            keep = _better(va[j], ia[j], vb[kp - 1 - j], ib[kp - 1 - j])
            v.append(lax.select(keep, va[j], vb[kp - 1 - j]))
            i.append(lax.select(keep, ia[j], ib[kp - 1 - j]))
        half = kp // 2
        while half:  # bitonic sort of the kp survivors, best first
            for j in range(kp):
                if j & half == 0:
                    _exchange(v, i, j, j + half)
            half //= 2
        return tuple(v) + tuple(i) + extra
    return reducer


def _reduce(x, k: int, lse: bool, chunk: int = CHUNK):
    if lse:  # one precision in a reduction: the log-sum-exp's float32
        x = x.astype(jnp.float32)
    V = x.shape[-1]
    if not 0 < k <= V:
        raise ValueError(f"top_k_reduce: k={k} must be in 1..{V} (the last axis)")
    kp = 1 << (k - 1).bit_length()
    low = jnp.array(-jnp.inf, x.dtype)
    idx = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    init = (low,) * kp + (jnp.int32(V),) * kp
    if lse:
        init += (jnp.float32(-jnp.inf), jnp.float32(0.0))
    merge = _merge(kp, lse)
    staged = 0 < chunk < V
    if staged:  # [..., V] -> [..., nc, chunk], the tail padded with entries that come after every real one
        nc = -(-V // chunk)
        pad = [(0, 0)] * (x.ndim - 1) + [(0, nc * chunk - V)]
        x = jnp.pad(x, pad, constant_values=-jnp.inf).reshape(x.shape[:-1] + (nc, chunk))
        idx = jnp.pad(idx, pad, constant_values=V).reshape(x.shape)
    pad_v = jnp.broadcast_to(low, x.shape)
    pad_i = jnp.broadcast_to(jnp.int32(V), x.shape)  # after every real index
    ops = (x,) + (pad_v,) * (kp - 1) + (idx,) + (pad_i,) * (kp - 1)
    if lse:  # an element is (m = x, s = 1)
        ops += (x, jnp.where(x == -jnp.inf, 0.0, 1.0).astype(jnp.float32))
    out = lax.reduce(ops, init, merge, (x.ndim - 1,))
    if staged:  # the chunks' lists, merged
        out = lax.reduce(tuple(out), init, merge, (x.ndim - 2,))
    vals, ids = jnp.stack(out[:k], axis=-1), jnp.stack(out[kp:kp + k], axis=-1)
    if not lse:
        return vals, ids
    m, tot = out[2 * kp], out[2 * kp + 1]
    return vals, ids, jnp.where(m == -jnp.inf, m, m + jnp.log(tot))


def top_k_reduce(x, k: int, chunk: int = CHUNK):
    """(values, indices) of the k largest entries of x's last axis, best first, ties to the lower index:
    lax.top_k's result, computed as a variadic reduction (module doc; rows longer than chunk in two
    stages). x: float, no NaN."""
    return _reduce(x, k, False, chunk)


def top_k_log_softmax(x, k: int, impl: str = "xla", chunk: int = CHUNK):
    """(log-probs [..., k] float32, indices [..., k] int32) of the k best entries of log_softmax(x) over the
    last axis (ties to the lower index). "reduce": the top-k and the log-sum-exp in the same one
    reduction (online: running max and rescaled sum), so the [..., V] log-probs are never written; its
    log-probs equal log_softmax's up to float rounding (the sum of V exponentials in another order;
    tests: within 1e-4). "xla": lax.top_k of jax.nn.log_softmax of x in float32 (the tree growth's
    own "xla" path takes the log-softmax in the logits' dtype). A row of -inf only: -inf log-probs."""
    if impl == "xla":
        return top_k(jax.nn.log_softmax(x.astype(jnp.float32), axis=-1), k, "xla")
    if impl != "reduce":
        raise ValueError(f"top-k implementation must be one of {IMPLS}, got {impl!r}")
    vals, ids, lse = _reduce(x, k, True, chunk)
    lse = lse[..., None]
    return jnp.where(lse == -jnp.inf, -jnp.inf, vals.astype(jnp.float32) - lse), ids


def top_k(x, k: int, impl: str = "xla"):
    """The k best of x's last axis by the named implementation (IMPLS); same results."""
    if impl == "xla":
        vals, ids = lax.top_k(x, k)
        return vals, ids.astype(jnp.int32)
    if impl == "reduce":
        return top_k_reduce(x, k)
    raise ValueError(f"top-k implementation must be one of {IMPLS}, got {impl!r}")
