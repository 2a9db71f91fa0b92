"""Paged-attention test cases shared by the kernel tests: ragged rows over random, non-contiguous
pages, in the shapes the engine produces (decode, chunked prefill at an offset, tree verify, draft
tree growth, sliding window)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Case:
    q: jnp.ndarray  # [B, T, H, D]
    kv_pages: jnp.ndarray  # [N, ps, 2, Hkv, D]
    page_table: jnp.ndarray  # [B, P]
    q_start: jnp.ndarray  # [B]
    kv_len: jnp.ndarray  # [B]
    block_mask: jnp.ndarray | None  # [B, T, W]
    mask_start: jnp.ndarray | None  # [B]
    num_new: np.ndarray  # [B] valid queries per row
    window: int | None = None

    @property
    def args(self):
        return (self.q, self.kv_pages, self.page_table, self.q_start, self.kv_len, self.block_mask)

    @property
    def kwargs(self):
        return dict(sliding_window=self.window, mask_start=self.mask_start)


def ancestors(rng, n: int, parent_of=None) -> np.ndarray:
    """[n, n] bool: node i sees itself and its ancestors in a random tree."""
    parent = parent_of or ([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    m = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def make_case(rng, mode: str, *, page_size: int, B: int = 4, T: int | None = None, H: int = 4, Hkv: int = 2,
              D: int = 16, P: int | None = None, dtype=jnp.float32, window: int | None = None) -> Case:
    """mode: "decode" (T = 1), "prefill" (causal, rows at offsets 0 and > 0: chunked prefill over
    cached pages), "verify" (a tree over T new nodes), "grow" (draft growth: T = k new nodes see the
    committed prefix, their ancestors among W earlier scratch entries and themselves). Row 0 is full,
    the last row is empty (no cached tokens, no new ones), the others ragged."""
    T = T or {"decode": 1, "prefill": 7, "verify": 9, "grow": 3}[mode]
    steps = 3  # grow: scratch entries of 3 earlier steps of T nodes
    W = {"verify": T, "grow": steps * T + T}.get(mode, 0)
    P = P or -(-(40 + T + W) // page_size) + 1
    cap = P * page_size
    N = B * P + 3
    # garbage everywhere a row does not own (large, so that reading it would show)
    kv = rng.normal(0, 1, (N, page_size, 2, Hkv, D)).astype(np.float32)
    kv[0] = rng.normal(0, 100, kv[0].shape)  # the trash page
    table = (1 + rng.permutation(N - 1)[: B * P]).reshape(B, P).astype(np.int32)
    prefix = rng.integers(1, cap - T - W, size=B)
    num_new = rng.integers(0, T + 1, size=B)
    prefix[0], num_new[0] = cap - T - W, T  # a full row reaching the end of its capacity
    prefix[-1], num_new[-1] = 0, 0  # an empty row
    if mode == "prefill":
        prefix[1] = 0  # a prompt from position 0; the others continue at an offset
    block_mask = mask_start = None
    q_start = prefix.copy()
    if mode == "verify":
        block_mask = np.stack([ancestors(rng, T) for _ in range(B)])
    elif mode == "grow":
        mask_start = prefix.copy()
        q_start = prefix + steps * T  # the new nodes follow the scratch entries of earlier steps
        block_mask = rng.random((B, T, W)) < 0.4  # random ancestors among the earlier entries
        block_mask[:, :, steps * T:] = np.eye(T, dtype=bool)[None]  # and themselves
    kv_len = q_start + num_new
    kv_len[-1] = 0
    for b in range(B):  # unused page-table columns point at the trash page, as the engine's do
        used = -(-int(kv_len[b]) // page_size)
        table[b, used:] = 0 if b % 2 else table[b, used:]
    q = rng.normal(0, 1, (B, T, H, D))
    return Case(q=jnp.asarray(q, dtype), kv_pages=jnp.asarray(kv, dtype), page_table=jnp.asarray(table),
                q_start=jnp.asarray(q_start, jnp.int32), kv_len=jnp.asarray(kv_len, jnp.int32),
                block_mask=None if block_mask is None else jnp.asarray(block_mask),
                mask_start=None if mask_start is None else jnp.asarray(mask_start, jnp.int32),
                num_new=num_new, window=window)


def poison_dead_pages(case: Case, block: int) -> Case:
    """NaN in every page a row's live key blocks (`block` keys each) do not touch: a kernel that
    reads only live blocks gives the same, finite, result; one that reads them gives NaN."""
    kv = np.asarray(case.kv_pages.astype(jnp.float32)).copy()
    table = np.asarray(case.page_table)
    ps = kv.shape[1]
    live = set()
    for b in range(table.shape[0]):
        end = -(-int(case.kv_len[b]) // block) * block  # keys up to the end of the last live block
        live |= {int(table[b, min(k // ps, table.shape[1] - 1)]) for k in range(0, end)}
    dead = [p for p in range(kv.shape[0]) if p not in live]
    kv[dead] = np.nan
    return dataclasses.replace(case, kv_pages=jnp.asarray(kv, case.kv_pages.dtype))


def assert_valid_close(got, want, num_new, atol, rtol=0.0):
    """Compare the valid queries (t < num_new[b]) of [B, T, H, D] outputs."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    want = np.asarray(jnp.asarray(want).astype(jnp.float32))
    assert got.shape == want.shape
    for b, n in enumerate(num_new):
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=atol, rtol=rtol, err_msg=f"row {b}")
