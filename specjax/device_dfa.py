"""Regex constraints followed on the device: per-slot token-DFA tables (specjax.token_dfa) in the
programs' state, so that a constrained row needs no host work per token.

Per slot (`DFATables`, part of decode.DecodeState / step.SpecState once a DFA request was admitted;
None before: compiled out), the static limits S_max / C_max (SchedulerOptions.dfa_max_states /
dfa_max_classes) fixing every shape:

    cls   [M, V] int16/int32     the token class of each token id (TokenDFA.token_class)
    next  [M, S_max, C_max] int32 the state after a token of class c in state s; -1: not allowed
                                  (padding states / classes are -1)
    state [M] int32              the state after the slot's last token (the root of its next tree);
                                  -1: no DFA (the row is never masked)

Tables are written at admission (`admit`: one device update per admission batch; a request without
a DFA gets state -1, which is how a reused slot is cleared) and read by slot in every step:

    plain:        mask_logits(logits [B, V], view) then advance(view, tokens)
    speculative:  tree_states (the state at each node: its parent's state -> next[., cls[token]];
                  one unrolled round per tree level), mask_logits(logits [B, N, V]) per node, then
                  the slot's state is the accepted node's state advanced by the bonus token (the
                  next root)

The mask (allowed_tokens) reads the table rows once per node ([B, N, C]: which classes the node's
state allows), packs them 32 nodes to a word ([B, ceil(N/32), C] uint32), reads each token's word
through its class (one gather per row and token, not per node) and takes node k's bit out
elementwise, so the [B, N, V] mask is no gather of its own and fuses into the where and its
consumer (argmax, softmax). mask_logits_reference / tree_states_reference are the direct forms
(one gather per row, node and token; a device loop over the nodes), kept for the tests and
scripts/bench_dfa_mask.py.

A node whose token its parent's state forbids gets state -1 and is left unmasked: masked
acceptance never reaches it (its parent's masked distribution gives its token zero mass). The
mask work is compiled in only for dispatches with a DFA row (the programs' static flag `dfa`);
rows with state -1 in such a dispatch keep their logits.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["DFATables", "DFAView", "admit", "advance", "allowed_tokens", "init_tables", "mask_logits",
           "mask_logits_reference", "step_states", "tree_states", "tree_states_reference", "view"]

_WORD = 32  # nodes per packed word of allowed classes (allowed_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFATables:
    cls: jax.Array  # [M, V] int16 (int32 when C_max > 32767) token class per token id
    next: jax.Array  # [M, S_max, C_max] int32 next state, -1 = disallowed
    state: jax.Array  # [M] int32 current state, -1 = no DFA


class DFAView(NamedTuple):
    """A batch's rows of the tables: the tables (cls [M, V], next [M, S_max, C_max]), read through the
    rows' slots [B] (clamped) where needed (no [B, S_max, C_max] copy), and the rows' states [B]."""
    cls: jax.Array
    next: jax.Array
    slots: jax.Array
    state: jax.Array


def init_tables(max_slots: int, vocab_size: int, max_states: int, max_classes: int) -> DFATables:
    """Empty tables: every slot without a DFA."""
    dt = jnp.int16 if max_classes <= 32767 else jnp.int32
    return DFATables(cls=jnp.zeros((max_slots, vocab_size), dt),
                     next=jnp.full((max_slots, max_states, max_classes), -1, jnp.int32),
                     state=jnp.full((max_slots,), -1, jnp.int32))


def admit(tables: DFATables, slots, cls, nxt, start) -> DFATables:
    """Write the tables of admitted rows: slots [B] int32 (>= M: padding, dropped), cls [B, V],
    nxt [B, S_max, C_max], start [B] int32 (the state after the sequence prefilled so far: 0 for a
    fresh request; -1: the row has no DFA, its tables are left as they are)."""
    def put(a, v):
        return a.at[slots].set(v.astype(a.dtype), mode="drop")
    has = start >= 0
    keep = jnp.where(has, slots, tables.state.shape[0])  # rows without a DFA write no table
    return DFATables(cls=tables.cls.at[keep].set(cls.astype(tables.cls.dtype), mode="drop"),
                     next=tables.next.at[keep].set(nxt, mode="drop"), state=put(tables.state, start))


def view(tables: DFATables, read_slots) -> DFAView:
    """The rows read_slots [B] (clamped by the caller) of the tables."""
    return DFAView(tables.cls, tables.next, read_slots, tables.state[read_slots])


def _classes(v: DFAView, tokens):
    """[B, K] int32 the token classes of tokens [B, K] in the rows' tables."""
    return v.cls[v.slots[:, None], jnp.clip(tokens, 0, v.cls.shape[1] - 1)].astype(jnp.int32)


def step_states(v: DFAView, states, tokens):
    """states [B, ...] int32 after tokens [B, ...] int32 (same shape): next[s, cls[t]]; -1 where the
    state is -1 or the token is not allowed."""
    B = states.shape[0]
    flat_s, flat_t = states.reshape(B, -1), tokens.reshape(B, -1)
    c = _classes(v, flat_t)  # [B, K]
    nxt = v.next[v.slots[:, None], jnp.clip(flat_s, 0, v.next.shape[1] - 1), c]  # [B, K]
    return jnp.where(flat_s >= 0, nxt, -1).reshape(states.shape)


def advance(v: DFAView, tokens, active):
    """[B] the rows' states after tokens [B] (inactive rows and rows without a DFA: unchanged)."""
    return jnp.where(active & (v.state >= 0), step_states(v, v.state, tokens), v.state)


def tree_states(v: DFAView, tokens, parents, max_depth: int | None = None):
    """[B, N] int32 the state after each node of trees tokens / parents [B, N] (node 0 the root,
    whose state is v.state; parents[i] < i): its parent's state stepped by its token; -1 below a
    forbidden token and for rows without a DFA. max_depth (static): the trees' depth bound
    (default N - 1, any tree).

    max_depth relaxation rounds over all nodes at once, unrolled (no device loop): after round d
    every node of depth <= d has its final state (its parent's was final after round d - 1)."""
    B, N = tokens.shape
    rounds = N - 1 if max_depth is None else min(max_depth, N - 1)
    root = (jnp.arange(N) == 0)[None, :]  # [1, N]
    st = jnp.where(root, v.state[:, None], -1)  # [B, N]
    if rounds <= 0:
        return st
    c = _classes(v, tokens)  # [B, N] fixed over the rounds
    par = jnp.clip(parents, 0, N - 1)
    rows = v.slots[:, None]
    S = v.next.shape[1]
    for _ in range(rounds):
        ps = jnp.take_along_axis(st, par, axis=1)  # [B, N] the parents' states
        nxt = v.next[rows, jnp.clip(ps, 0, S - 1), c]
        st = jnp.where(root, st, jnp.where(ps >= 0, nxt, -1))
    return st


def tree_states_reference(v: DFAView, tokens, parents, max_depth: int | None = None):
    """tree_states node by node in a device loop (N - 1 iterations); the reference it is tested
    against (max_depth unused)."""
    B, N = tokens.shape
    rows = jnp.arange(B)
    st = jnp.full((B, N), -1, jnp.int32).at[:, 0].set(v.state)

    def body(i, st):
        par = st[rows, jnp.maximum(parents[:, i], 0)]  # [B]
        return st.at[:, i].set(step_states(v, par, tokens[:, i]))

    return jax.lax.fori_loop(1, N, body, st) if N > 1 else st


def _class_words(v: DFAView, flat):
    """[B, G, C] uint32 for states flat [B, K] (G = ceil(K / 32)): bit k % 32 of word [b, k // 32, c]
    is set where node k's state allows class c (every class for state -1)."""
    B, K = flat.shape
    S, C = v.next.shape[1:]
    ok = (v.next[v.slots[:, None], jnp.clip(flat, 0, S - 1)] >= 0) | (flat < 0)[:, :, None]  # [B, K, C]
    G = -(-K // _WORD)
    W = min(K, _WORD)  # bits used per word
    ok = jnp.pad(ok, ((0, 0), (0, G * W - K), (0, 0))).reshape(B, G, W, C)
    bit = jnp.left_shift(jnp.uint32(1), jnp.arange(W, dtype=jnp.uint32))[None, None, :, None]  # [1, 1, W, 1]
    return jnp.sum(jnp.where(ok, bit, jnp.uint32(0)), axis=2, dtype=jnp.uint32)  # distinct bits: the sum is the or


def allowed_tokens(v: DFAView, states):
    """[B, ..., V] bool: the tokens each state of states [B, ...] allows (all for state -1).

    One gather per (row, token, group of 32 nodes) instead of one per (row, node, token): the nodes'
    allowed classes packed into words [B, G, C] (tiny), each token's word read through its class
    ([B, G, V]), and node k's bit taken out of it (elementwise, fused into the consumer)."""
    B, V = states.shape[0], v.cls.shape[1]
    mid = states.shape[1:]
    flat = states.reshape(B, -1)  # [B, K]
    K = flat.shape[1]
    words = _class_words(v, flat)  # [B, G, C]
    G, C = words.shape[1:]
    cls = v.cls[v.slots].astype(jnp.int32)  # [B, V]
    idx = (jnp.arange(B * G, dtype=jnp.int32) * C).reshape(B, G, 1) + cls[:, None, :]  # [B, G, V] into words
    tok = words.reshape(-1).at[idx].get(mode="promise_in_bounds")  # [B, G, V] uint32
    node = jnp.arange(K, dtype=jnp.uint32)
    per_node = jnp.repeat(tok, _WORD, axis=1)[:, :K] if G > 1 else tok  # [B, K or 1, V]
    allowed = (jnp.right_shift(per_node, (node % _WORD)[None, :, None]) & 1) != 0  # [B, K, V]
    return allowed.reshape((B,) + mid + (V,))


def mask_logits(logits, v: DFAView | None, states=None):
    """logits [B, ..., V] with the tokens the states [B, ...] (default v.state [B]) forbid set to
    -inf; rows / nodes with state -1 unchanged. None: no DFA in the dispatch (logits unchanged)."""
    if v is None:
        return logits
    states = v.state if states is None else states
    return jnp.where(allowed_tokens(v, states), logits, jnp.asarray(-jnp.inf, logits.dtype))


def mask_logits_reference(logits, v: DFAView | None, states=None):
    """mask_logits with one gather per (row, node, token) ([B, K, V] from the allowed classes
    [B, K, C]); the reference it is tested and benchmarked against (scripts/bench_dfa_mask.py)."""
    if v is None:
        return logits
    states = v.state if states is None else states
    B, V = logits.shape[0], logits.shape[-1]
    mid = states.shape[1:]
    flat = states.reshape(B, -1)  # [B, K]
    ok = (v.next[v.slots[:, None], jnp.clip(flat, 0, v.next.shape[1] - 1)] >= 0) | (flat < 0)[:, :, None]  # [B, K, C]
    cls = v.cls[v.slots].astype(jnp.int32)  # [B, V]
    allowed = jnp.take_along_axis(ok, cls[:, None, :], axis=2)  # [B, K, V] (index broadcast)
    allowed = allowed.reshape((B,) + mid + (V,))
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
