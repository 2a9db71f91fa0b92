"""Paged KV cache: device pytree of per-layer pages, per-slot page tables and lengths,
plus the host-side page allocator.

Page 0 is reserved as a trash page: writes of padding tokens and of idle slots land there,
so no shape ever depends on how many tokens are real.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

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
    offset: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # q_start - mask_start
    #   where it is the same for every row and known when tracing (a draft level's s * k), else None


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
    """Scatter new K/V [B, T, Hkv, D] into pages [N, page_size, 2, Hkv, D] at flat indices write_idx [B, T].

    The indices are declared unique: a real token's entry is written by that token only, and the
    indices that repeat all point into the trash page (padding tokens, `write_indices`), whose
    content nothing reads. With the declaration XLA's GPU scatter is a plain store (no conflict
    handling): SmolLM2's fused tree step at batch 1 spent 93 -> 51 us per step in its 30 K/V writes
    on an H200 (docs/benchmarks.md, 2026-11-26, night)."""
    n, ps, two, hkv, d = kv_pages.shape
    new = jnp.stack([k_new, v_new], axis=2).reshape(-1, two, hkv, d).astype(kv_pages.dtype)  # [B*T, 2, Hkv, D]
    flat = kv_pages.reshape(n * ps, two, hkv, d).at[write_idx.reshape(-1)].set(new, unique_indices=True)
    return flat.reshape(n, ps, two, hkv, d)


class PageAllocator:
    """Host-side KV pages: per-slot page tables over reference-counted pages. Page 0 (trash) is
    never handed out.

    Prefix caching (specjax.prefix_cache computes the keys): a page whose content is complete can be
    registered under a key; a later slot that needs the same content shares the page (`share`,
    reference counted) instead of computing it. A registered page that no slot uses any more is kept
    in `cached` (least recently released first) and counts as free: `ensure` takes unregistered
    free pages first and then evicts cached ones, oldest first.
    """

    def __init__(self, num_pages: int, page_size: int, pages_per_slot: int, max_slots: int):
        if num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.pages_per_slot = pages_per_slot
        self.free = list(range(num_pages - 1, 0, -1))  # unregistered pages no slot uses (a stack)
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered pages no slot uses, LRU first
        self.refs = np.zeros(num_pages, np.int32)  # slots using each page
        self.key_of: dict[int, bytes] = {}  # registered page -> its key
        self.by_key: dict[bytes, int] = {}
        self.num_evicted = 0
        self.table = np.zeros((max_slots, pages_per_slot), np.int32)
        self.owned: list[list[int]] = [[] for _ in range(max_slots)]
        self.dirty = True

    @property
    def num_free(self) -> int:
        """Pages that `ensure` can hand out (unused pages, cached ones included)."""
        return len(self.free) + len(self.cached)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - 1 - self.num_free

    def unused_pages(self) -> list[int]:
        """Every page no slot uses, sorted (free and cached)."""
        return sorted(self.free + list(self.cached))

    def pages_needed(self, slot: int, length: int) -> int:
        return max(0, -(-length // self.page_size) - len(self.owned[slot]))

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        page, _ = self.cached.popitem(last=False)  # evict the least recently released
        del self.by_key[self.key_of.pop(page)]
        self.num_evicted += 1
        return page

    def ensure(self, slot: int, length: int) -> bool:
        """Make slot hold pages for `length` tokens. False (and no change) if pages run out."""
        need = self.pages_needed(slot, length)
        if -(-length // self.page_size) > self.pages_per_slot:
            raise ValueError(f"length {length} exceeds the slot capacity "
                             f"{self.pages_per_slot * self.page_size}")
        if need > self.num_free:
            return False
        for _ in range(need):
            page = self._take()
            self.refs[page] = 1
            self.table[slot, len(self.owned[slot])] = page
            self.owned[slot].append(page)
        self.dirty = self.dirty or need > 0
        return True

    def release(self, slot: int) -> None:
        """Drop the slot's pages; a page nobody else uses is freed, or cached if registered (the
        slot's last pages first in eviction order)."""
        for page in reversed(self.owned[slot]):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.cached[page] = None
                else:
                    self.free.append(page)
        self.owned[slot] = []
        self.table[slot] = TRASH_PAGE
        self.dirty = True

    # -- prefix caching ------------------------------------------------------------------------
    def lookup(self, keys) -> list[int]:
        """The registered pages of the longest run of keys from the first (stops at the first miss)."""
        pages = []
        for key in keys:
            page = self.by_key.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_cached_in(self, pages) -> int:
        """How many of `pages` are cached but unused (sharing them takes them from the free count)."""
        return sum(p in self.cached for p in pages)

    def share(self, slot: int, pages) -> None:
        """Append registered pages (from `lookup`) to an empty slot's table."""
        if self.owned[slot]:
            raise ValueError(f"slot {slot} already holds pages; shared pages come first")
        for i, page in enumerate(pages):
            if self.refs[page] == 0:
                del self.cached[page]
            self.refs[page] += 1
            self.table[slot, i] = page
            self.owned[slot].append(page)
        self.dirty = self.dirty or bool(pages)

    def register(self, slot: int, index: int, key: bytes) -> None:
        """Register the slot's page `index` (its content now complete) under key. A key that
        another page already holds (the same prefix computed twice) leaves the page unregistered."""
        page = self.owned[slot][index]
        if key in self.by_key or page in self.key_of:
            return
        self.key_of[page] = key
        self.by_key[key] = page

    def evict_all(self) -> int:
        """Forget every cached page (they become plain free pages). Returns how many."""
        n = len(self.cached)
        for page in self.cached:
            del self.by_key[self.key_of.pop(page)]
        self.free.extend(reversed(self.cached))
        self.cached.clear()
        return n
