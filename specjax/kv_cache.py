"""Paged KV cache: device pytree of per-layer pages, per-slot page tables and lengths,
plus the host-side page allocator.

Page 0 is reserved as a trash page: writes of padding tokens and of idle slots land there,
so no shape ever depends on how many tokens are real.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Logical axes of the cache arrays (tensor-parallel sharding maps these to a mesh).
PAGE_AXES = ("pages", None, None, "kv_heads", None)  # [num_pages, page_size, 2 (K, V), Hkv, D]
TRASH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    kv: list  # per layer [num_pages, page_size, 2, Hkv, D]: K and V of a token side by side
    #            (one scatter and one gather per layer and step instead of two each)
    page_table: jax.Array  # [max_slots, pages_per_slot] int32
    seq_lens: jax.Array  # [max_slots] int32: tokens whose K/V are in the cache

    @property
    def page_size(self) -> int:
        return self.kv[0].shape[1]

    @property
    def pages_per_slot(self) -> int:
        return self.page_table.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnMeta:
    """Where a step's new tokens go and what they may see. Built once per step."""
    page_table: jax.Array  # [B, P] int32 pages of each batch row
    write_idx: jax.Array  # [B, T] int32 flat cache index (page * page_size + offset); trash for padding
    q_start: jax.Array  # [B] int32 cache index of the first new token of each row
    kv_len: jax.Array  # [B] int32 valid cache entries after this step's writes (0 for rows without
    #                    new tokens: nothing of theirs is used, and the kernels then read no page)
    block_mask: jax.Array | None = None  # [B, T, W] bool: new token i sees cache entry mask_start + j
    #                                        (None: causal over the T new tokens)
    mask_start: jax.Array | None = None  # [B] int32 first cache index governed by block_mask (None: q_start)


def init_cache(cfg, *, num_pages: int, page_size: int, max_slots: int, max_seq_len: int, dtype) -> KVCache:
    pages_per_slot = -(-max_seq_len // page_size)
    shape = (num_pages, page_size, 2, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        kv=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
        page_table=jnp.zeros((max_slots, pages_per_slot), jnp.int32),
        seq_lens=jnp.zeros((max_slots,), jnp.int32),
    )


def write_indices(page_table, start, num_new, T: int, page_size: int):
    """Flat cache indices [B, T] for T new tokens per row; padding goes to the trash page."""
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = start[:, None] + t  # [B, T]
    page_col = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, page_col, axis=1)
    idx = page * page_size + pos % page_size
    valid = (t < num_new[:, None]) & (pos < page_table.shape[1] * page_size)
    return jnp.where(valid, idx, TRASH_PAGE * page_size + t % page_size).astype(jnp.int32)


def step_meta(cache: KVCache, slots, num_new, T: int, block_mask=None) -> AttnMeta:
    """AttnMeta for appending num_new[b] (<= T) tokens to each slot in `slots`."""
    return meta_at(cache.page_table[slots], cache.seq_lens[slots], num_new, T, cache.page_size, block_mask)


def meta_at(page_table, start, num_new, T: int, page_size: int, block_mask=None, mask_start=None) -> AttnMeta:
    """AttnMeta for num_new[b] (<= T) new tokens at cache indices start[b].. of rows with pages page_table [B, P]."""
    return AttnMeta(
        page_table=page_table,
        write_idx=write_indices(page_table, start, num_new, T, page_size),
        q_start=start,
        kv_len=jnp.where(num_new > 0, start + num_new, 0),  # inactive / padding rows read nothing
        block_mask=block_mask,
        mask_start=mask_start,
    )


def write_kv(kv_pages, k_new, v_new, write_idx):
    """Scatter new K/V [B, T, Hkv, D] into pages [N, page_size, 2, Hkv, D] at flat indices write_idx [B, T]."""
    n, ps, two, hkv, d = kv_pages.shape
    new = jnp.stack([k_new, v_new], axis=2).reshape(-1, two, hkv, d).astype(kv_pages.dtype)  # [B*T, 2, Hkv, D]
    flat = kv_pages.reshape(n * ps, two, hkv, d).at[write_idx.reshape(-1)].set(new)
    return flat.reshape(n, ps, two, hkv, d)


class PageAllocator:
    """Host-side free list of KV pages. Page 0 (trash) is never handed out."""

    def __init__(self, num_pages: int, page_size: int, pages_per_slot: int, max_slots: int):
        if num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
        self.page_size = page_size
        self.pages_per_slot = pages_per_slot
        self.free = list(range(num_pages - 1, 0, -1))
        self.table = np.zeros((max_slots, pages_per_slot), np.int32)
        self.owned: list[list[int]] = [[] for _ in range(max_slots)]
        self.dirty = True

    @property
    def num_free(self) -> int:
        return len(self.free)

    def pages_needed(self, slot: int, length: int) -> int:
        return max(0, -(-length // self.page_size) - len(self.owned[slot]))

    def ensure(self, slot: int, length: int) -> bool:
        """Make slot hold pages for `length` tokens. False (and no change) if pages run out."""
        need = self.pages_needed(slot, length)
        if -(-length // self.page_size) > self.pages_per_slot:
            raise ValueError(f"length {length} exceeds the slot capacity "
                             f"{self.pages_per_slot * self.page_size}")
        if need > len(self.free):
            return False
        for _ in range(need):
            page = self.free.pop()
            self.table[slot, len(self.owned[slot])] = page
            self.owned[slot].append(page)
        self.dirty = self.dirty or need > 0
        return True

    def release(self, slot: int) -> None:
        self.free.extend(reversed(self.owned[slot]))
        self.owned[slot] = []
        self.table[slot] = TRASH_PAGE
        self.dirty = True
