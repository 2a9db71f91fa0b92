"""The n-gram (prompt-lookup) drafter: drafts copied from the request's own text, on the device.

No weights and no host work: the fused step keeps each slot's tokens on the device and looks up
its own history for the next draft tree.

    SpecState.history [max_slots, W] int32: x_0 .. x_L of each slot (prompt, output so far and the
    tree's root x_L; W = the slot's cache capacity, positions >= W are dropped).
    prefill      write_prompt: x_0 .. x_{P-1} and the first sampled token x_P
    each step    append: the n emitted tokens (accepted drafts + bonus) at L + 1 .. L + n
    then         propose(history rows, H = L + 1, root) -> the next Tree

Matching (per row; H tokens x_0 .. x_{H-1}; the suffix of length n is x_{H-n} .. x_{H-1}):
  a position p in [1, H - 1] matches with length m(p) = the largest n <= ngram_max such that
  x_{p-n} .. x_{p-1} == x_{H-n} .. x_{H-1} (the n tokens before p are the last n tokens).
  Candidates are the positions with m(p) >= ngram_min, best first by (m(p), p): the longest
  match, then the most recent one. The continuation of candidate p is x_p, x_{p+1}, ... read with
  period d = H - p (token i is x_{p + i mod d}), so it never reads past x_{H-1}: a match close to
  the end continues the cycle it found ("a b a b" -> "a b a b ...").
  No candidate (or fewer than topk): the missing continuations repeat the last token x_{H-1}
  (p = H - 1), a harmless guess that verification rejects when it is wrong.

Trees: a chain (topk 1) is the best candidate's num_steps tokens. A tree is the trie of the topk
best continuations (shared prefixes merged into one node), of which tree.select_tree keeps the
first num_draft_tokens nodes in (candidate rank, depth) order: the best continuation whole, then
what the next one adds, ...; nodes beyond the trie's size repeat a kept node (a duplicate
sibling, which verification never accepts twice).
Proposals are deterministic functions of the history, i.e. point masses, so verification with
draft_probs=None (specjax.verify) keeps greedy and sampling lossless.

A model draft's tree can carry the same lookup (SpecConfig.ngram_branch = L): the state keeps the
history as above and add_branch merges the best candidate's first L tokens into the draft's tree
under the root (tree.merge_branch), so a step accepts the longer of the draft's and the text's guess.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import tree as tree_lib
from specjax.tree import SpecConfig, Tree

_DUPLICATE = -1e30  # select_tree score of a trie node that repeats an earlier candidate's


def init_history(max_slots: int, width: int) -> jax.Array:
    return jnp.zeros((max_slots, width), jnp.int32)


def write_prompt(hist, slots, tokens, lens, first):
    """Reset the rows of `slots` [B] (out of range: dropped) to the prompts, tokens [B, T] of
    lengths lens [B] followed by the first sampled token first [B] at position lens."""
    W, T = hist.shape[1], tokens.shape[1]
    tokens = jnp.pad(tokens, ((0, 0), (0, max(0, W - T))))[:, :W]  # [B, W]
    col = jnp.arange(W, dtype=jnp.int32)[None, :]
    rows = jnp.where(col < lens[:, None], tokens, jnp.where(col == lens[:, None], first[:, None], 0))
    return hist.at[slots].set(rows.astype(jnp.int32), mode="drop")


def append(hist, slots, L, tokens, n):
    """Write tokens [B, T] (the first n[b] of each row) at positions L[b] + 1 .. L[b] + n[b] of
    the rows `slots` [B]; other entries, out-of-range slots and positions >= W are dropped."""
    W = hist.shape[1]
    T = tokens.shape[1]
    j = jnp.arange(T, dtype=jnp.int32)[None, :]
    col = jnp.where(j < n[:, None], L[:, None] + 1 + j, W)  # [B, T]; W: dropped
    return hist.at[slots[:, None], col].set(tokens.astype(jnp.int32), mode="drop")


def match_lengths(hist, H, ngram_max: int):
    """m [B, W] int32: m[b, p] = the number of tokens before p that equal the last tokens of row b
    (capped at ngram_max), for candidate positions 1 <= p <= H[b] - 1; 0 elsewhere.
    hist [B, W] (rows of the history), H [B] int32 tokens in each row (1 <= H <= W)."""
    B, W = hist.shape
    p = jnp.arange(W, dtype=jnp.int32)[None, :]  # [1, W]
    run = jnp.ones((B, W), bool)  # x_{p-i} == x_{H-i} for every i so far
    m = jnp.zeros((B, W), jnp.int32)
    for i in range(1, ngram_max + 1):
        last = jnp.take_along_axis(hist, jnp.maximum(H - i, 0)[:, None], axis=1)  # [B, 1] x_{H-i}
        before = jnp.pad(hist, ((0, 0), (i, 0)))[:, :W]  # [B, W] x_{p-i}
        run = run & (p >= i) & (H[:, None] - i >= 0) & (before == last)
        m = m + run.astype(jnp.int32)
    return jnp.where((p >= 1) & (p <= H[:, None] - 1), m, 0)


def candidates(hist, H, spec: SpecConfig, k: int | None = None):
    """Start positions [B, k] int32 of the k (default spec.topk) best continuations (see the module
    doc): by (match length, position) descending; missing ones are H - 1 (repeat the last token)."""
    W = hist.shape[1]
    k = spec.topk if k is None else k
    m = match_lengths(hist, H, spec.ngram_max)
    p = jnp.arange(W, dtype=jnp.int32)[None, :]
    key = jnp.where(m >= spec.ngram_min, m * W + p, -1)  # [B, W]; unique per position
    if k == 1:  # the best alone: one reduction
        val, pos = jnp.max(key, axis=1, keepdims=True), jnp.argmax(key, axis=1, keepdims=True)
    else:
        val, pos = jax.lax.top_k(key, k)  # [B, k]
    return jnp.where(val >= 0, pos.astype(jnp.int32), (H - 1)[:, None])


def continuations(hist, H, pos, num_steps: int):
    """Tokens [B, k, num_steps] int32 continuing at pos [B, k], read with period H - pos."""
    B, k = pos.shape
    d = (H[:, None] - pos)[:, :, None]  # [B, k, 1] >= 1
    i = jnp.arange(num_steps, dtype=jnp.int32)[None, None, :]
    idx = pos[:, :, None] + i % d  # [B, k, S] <= H - 1
    return jnp.take_along_axis(hist, idx.reshape(B, k * num_steps), axis=1).reshape(B, k, num_steps)


def trie_tree(root, cont, num_draft_tokens: int) -> Tree:
    """The trie of the continuations cont [B, k, S] (rank order) under root [B], as a Tree of
    num_draft_tokens + 1 nodes (candidate (j, s) = token s of continuation j; a candidate whose
    prefix equals an earlier continuation's is a duplicate and its children hang under that one)."""
    B, k, S = cont.shape
    same = cont[:, :, None, :] == cont[:, None, :, :]  # [B, k, k, S]
    prefix = jnp.cumprod(same.astype(jnp.int32), axis=-1) > 0  # equal through depth s + 1
    rep = jnp.argmax(prefix, axis=2).astype(jnp.int32)  # [B, k, S] first continuation sharing it
    own = rep == jnp.arange(k, dtype=jnp.int32)[None, :, None]
    rank = jnp.arange(k, dtype=jnp.float32)[None, :]
    toks, scores, parents = [], [], []
    for s in range(S):
        toks.append(cont[:, :, s])
        scores.append(jnp.where(own[:, :, s], -(rank * S + s), _DUPLICATE))  # (rank, depth) order
        parents.append(jnp.full((B, k), -1, jnp.int32) if s == 0 else rep[:, :, s - 1])
    return tree_lib.select_tree(root, toks, scores, parents, num_draft_tokens)


def add_branch(hist, H, tree: Tree, spec: SpecConfig) -> Tree:
    """A model draft's tree with spec.ngram_branch more nodes (SpecConfig.ngram_branch): the
    continuation of each row's best match (candidates' first) under the root, merged into the tree
    by tree.merge_branch. hist [B, W], H [B] as in propose."""
    H = jnp.clip(H, 1, hist.shape[1])
    pos = candidates(hist, H, spec, k=1)
    return tree_lib.merge_branch(tree, continuations(hist, H, pos, spec.ngram_branch)[:, 0])


def propose(hist, H, root, spec: SpecConfig) -> Tree:
    """The next draft tree of rows with history hist [B, W] holding H [B] tokens, the last being
    the root [B] (== hist[b, H - 1])."""
    W = hist.shape[1]
    H = jnp.clip(H, 1, W)  # past the capacity (a step run ahead of the host, dropped): stay in bounds
    pos = candidates(hist, H, spec)
    cont = continuations(hist, H, pos, spec.num_steps)  # [B, k, S]
    if spec.is_chain:
        return tree_lib.chain_tree(root, cont[:, 0])
    return trie_tree(root, cont, spec.num_draft_tokens)
