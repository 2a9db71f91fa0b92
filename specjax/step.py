"""Fused speculative step with a classic draft model: chain drafting (topk=1), greedy acceptance.

One pure function under jax.jit (no host round trip): draft k tokens autoregressively with the
draft model, verify them with one target forward over k + 1 tokens, accept greedily.

Cache layout. The target and the draft have their own K/V pages but share the page table (the
draft pages are indexed by the same page numbers, so one host-side PageAllocator serves both)
and keep separate lengths:

  target: cache.seq_lens[s] = L   tokens x_0 .. x_{L-1} have K/V in the target cache;
          last_tokens[s] = x_L    the last accepted token, not yet in either cache.
  draft:  draft_seq_lens[s] = Ld in {L - 1, L}; prev_tokens[s] = x_{L-1}.

Draft catch-up scheme (exact). A step first runs the draft once over T = 2 tokens, the ones
the draft has not consumed: [x_{L-1}, x_L] at positions L-1, L when Ld == L - 1 (num_new 2), or
[x_L, pad] at position L when Ld == L (num_new 1, the pad goes to the trash page). Its logits at
x_L give d_1. Then k - 1 T=1 draft decodes feed d_1 .. d_{k-1} at L+1 .. L+k-1 and give
d_2 .. d_k; d_k itself is never fed. So the draft cache holds [x_L, d_1 .. d_{k-1}] at
L .. L+k-1. The target verifies [x_L, d_1 .. d_k] at L .. L+k and n tokens are accepted
(x_L, d_1 .. d_{n-1}), plus a bonus token. The draft's K/V agree with the accepted tokens up to
position L + min(n, k) - 1, so:

  L' = L + n,  Ld' = L + min(n, k)  (= L' unless all k drafts were accepted: then L' - 1),
  last' = bonus,  prev' = token at L' - 1 (d_{n-1}, or x_L when n == 1).

Draft K/V written beyond Ld' are stale but never read: every later read of a position is preceded
by a write of it (kv_len bounds the visible entries). Inactive rows (active False) feed num_new 0
everywhere (all their writes land on the trash page) and do not advance; rows whose slot is
>= max_slots are padding (reads clamp, updates drop).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kv_cache import KVCache, meta_at


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: KVCache  # target cache (its page_table is shared with the draft)
    draft_kv: list  # per draft layer [num_pages, page_size, 2, Hkv_d, D_d]
    draft_seq_lens: jax.Array  # [max_slots] int32, L - 1 or L (see module doc)
    last_tokens: jax.Array  # [max_slots] int32: last accepted token, not yet in any cache
    prev_tokens: jax.Array  # [max_slots] int32: the token at position L - 1

    def draft_cache(self) -> KVCache:
        return KVCache(kv=self.draft_kv, page_table=self.cache.page_table, seq_lens=self.draft_seq_lens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecOut:
    tokens: jax.Array  # [B, num_steps + 1] int32 emitted tokens, padded with -1
    num_accepted: jax.Array  # [B] int32 in 1 .. num_steps + 1 (0 for inactive rows)
    accept_hist: jax.Array  # [num_steps + 2] int32: histogram of num_accepted over active rows


def init_spec_state(cache: KVCache, draft_cfg, dtype) -> SpecState:
    """A SpecState around a target cache: draft pages of the same count/page size, zero lengths."""
    n, ps = cache.kv[0].shape[:2]
    shape = (n, ps, 2, draft_cfg.num_kv_heads, draft_cfg.head_dim)
    max_slots = cache.seq_lens.shape[0]
    return SpecState(cache=cache, draft_kv=[jnp.zeros(shape, dtype) for _ in range(draft_cfg.num_layers)],
                     draft_seq_lens=jnp.zeros((max_slots,), jnp.int32),
                     last_tokens=jnp.zeros((max_slots,), jnp.int32),
                     prev_tokens=jnp.zeros((max_slots,), jnp.int32))


def _argmax_at(model, h, idx):
    """Greedy token from hidden h [B, T, E] at per-row index idx [B] -> [B] int32."""
    h_sel = jnp.take_along_axis(h, idx[:, None, None], axis=1)  # [B, 1, E]
    return jnp.argmax(model.logits(h_sel)[:, 0], axis=-1).astype(jnp.int32)


def spec_prefill(target_graphdef, target_params, draft_graphdef, draft_params, state: SpecState,
                 tokens, lens, slots):
    """Prefill ragged prompts from position 0 into both caches; greedy first token.

    tokens: [B, T] int32 (right-padded); lens: [B] int32 (0 for padding rows); slots: [B] int32
    (padding rows may hold any index >= max_slots). Returns (first tokens [B] int32, state)."""
    target = nnx.merge(target_graphdef, target_params)
    draft = nnx.merge(draft_graphdef, draft_params)
    B, T = tokens.shape
    max_slots = state.cache.seq_lens.shape[0]
    safe = jnp.clip(slots, 0, max_slots - 1)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    last = jnp.clip(lens - 1, 0, T - 1)

    meta = meta_at(state.cache.page_table[safe], jnp.zeros_like(lens), lens, T, state.cache.page_size)
    h, cache, _ = target(tokens, positions, state.cache, meta)
    first = _argmax_at(target, h, last)
    cache = dataclasses.replace(cache, seq_lens=cache.seq_lens.at[slots].set(lens, mode="drop"))
    _, dcache, _ = draft(tokens, positions, state.draft_cache(), meta)
    draft_seq_lens = state.draft_seq_lens.at[slots].set(lens, mode="drop")
    prev = jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0]
    return first, SpecState(cache=cache, draft_kv=dcache.kv, draft_seq_lens=draft_seq_lens,
                            last_tokens=state.last_tokens.at[slots].set(first, mode="drop"),
                            prev_tokens=state.prev_tokens.at[slots].set(prev, mode="drop"))


def spec_step(target_graphdef, target_params, draft_graphdef, draft_params, state: SpecState,
              slots, active, num_steps: int):
    """One speculative step (draft num_steps tokens, verify, greedy accept) for rows `slots` [B]
    with `active` [B] bool. num_steps is static (>= 1). Returns (SpecOut, state).

    The caller must have pages allocated for positions up to L + num_steps of every active slot."""
    if num_steps < 1:
        raise ValueError("num_steps must be >= 1")
    k = num_steps
    target = nnx.merge(target_graphdef, target_params)
    draft = nnx.merge(draft_graphdef, draft_params)
    max_slots = state.cache.seq_lens.shape[0]
    rs = jnp.minimum(slots, max_slots - 1)  # read slots (padding rows clamp)
    active = active & (slots < max_slots)
    act = active.astype(jnp.int32)
    L = state.cache.seq_lens[rs]  # [B]
    last = state.last_tokens[rs]
    prev = state.prev_tokens[rs]
    Ld = state.draft_seq_lens[rs]
    pt = state.cache.page_table[rs]  # [B, P], shared by both caches
    ps = state.cache.page_size

    # ---- 1. draft: catch-up forward (T=2) giving d_1, then k-1 T=1 decodes
    dcache = state.draft_cache()
    lag = jnp.clip(L - Ld, 0, 1)  # 1: x_{L-1} not yet in the draft cache
    start = L - lag  # == Ld for active rows
    toks2 = jnp.where(lag[:, None] == 1, jnp.stack([prev, last], 1),
                      jnp.stack([last, jnp.zeros_like(last)], 1))
    pos2 = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    h, dcache, _ = draft(toks2, pos2, dcache, meta_at(pt, start, (1 + lag) * act, 2, ps))
    d = _argmax_at(draft, h, lag)  # d_1 (logits at x_L)
    drafts = [d]
    for j in range(1, k):  # feed d_j at L + j, get d_{j+1}
        h, dcache, _ = draft(d[:, None], (L + j)[:, None], dcache, meta_at(pt, L + j, act, 1, ps))
        d = _argmax_at(draft, h, jnp.zeros_like(L))
        drafts.append(d)
    drafts = jnp.stack(drafts, axis=1)  # [B, k]

    # ---- 2. verify: target over [x_L, d_1 .. d_k] at L .. L+k (causal chain)
    vtoks = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, k+1]
    vpos = L[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    h, cache, _ = target(vtoks, vpos, state.cache, meta_at(pt, L, act * (k + 1), k + 1, ps))
    tgt = jnp.argmax(target.logits(h), axis=-1).astype(jnp.int32)  # [B, k+1]

    # ---- 3. greedy accept: n = 1 + leading matches of d_j with tgt[j-1]
    match = (drafts == tgt[:, :k]).astype(jnp.int32)
    n = 1 + jnp.sum(jnp.cumprod(match, axis=1), axis=1)  # [B] in 1 .. k+1
    bonus = jnp.take_along_axis(tgt, (n - 1)[:, None], axis=1)[:, 0]
    col = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    drafted = jnp.concatenate([drafts, jnp.full_like(drafts[:, :1], -1)], axis=1)
    out_tokens = jnp.where(col < (n - 1)[:, None], drafted, jnp.where(col == (n - 1)[:, None], bonus[:, None], -1))
    out_tokens = jnp.where(active[:, None], out_tokens, -1)
    n_out = n * act
    new_prev = jnp.take_along_axis(vtoks, (n - 1)[:, None], axis=1)[:, 0]  # token at L' - 1

    # ---- 4. state update (padding rows dropped, inactive rows unchanged)
    upd = jnp.where(active, slots, max_slots)  # inactive rows: out of range -> dropped
    cache = dataclasses.replace(cache, seq_lens=state.cache.seq_lens.at[upd].set(L + n, mode="drop"))
    draft_seq_lens = state.draft_seq_lens.at[upd].set(L + jnp.minimum(n, k), mode="drop")
    new_state = SpecState(cache=cache, draft_kv=dcache.kv, draft_seq_lens=draft_seq_lens,
                          last_tokens=state.last_tokens.at[upd].set(bonus, mode="drop"),
                          prev_tokens=state.prev_tokens.at[upd].set(new_prev, mode="drop"))
    hist = jnp.zeros((k + 2,), jnp.int32).at[n_out].add(act)
    return SpecOut(tokens=out_tokens, num_accepted=n_out, accept_hist=hist), new_state


class SpecSteps(NamedTuple):
    prefill: Callable  # (target_weights, draft_weights, state, tokens, lens, slots) -> (first, state)
    step: Callable  # (target_weights, draft_weights, state, slots, active, num_steps=) -> (SpecOut, state)


def compile_spec_steps(target_graphdef, target_params, draft_graphdef, draft_params):
    """-> (SpecSteps, target_weights, draft_weights): weights are flat lists of arrays, graph
    definitions are closed over; the state (argument 2) is donated."""
    t_leaves, t_def = jax.tree.flatten(target_params)
    d_leaves, d_def = jax.tree.flatten(draft_params)

    def bind(fn):
        def run(tw, dw, *args, **kw):
            return fn(target_graphdef, jax.tree.unflatten(t_def, tw),
                      draft_graphdef, jax.tree.unflatten(d_def, dw), *args, **kw)
        return run

    jit = functools.partial(jax.jit, donate_argnums=(2,))
    return SpecSteps(prefill=jit(bind(spec_prefill)),
                     step=jit(bind(spec_step), static_argnames=("num_steps",))), t_leaves, d_leaves
