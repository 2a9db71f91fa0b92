"""Verification of a draft tree: greedy, or lossless speculative sampling, per row.

Everything is pure ``jnp`` with static shapes, batched over rows ``B``, usable in ``jax.jit``
with no host synchronisation. Tree conventions are those of :mod:`specjax.tree` (node 0 is the
root = the last accepted token, ``parents[i] < i``, nodes ordered by depth).

Algorithm (rows whose temperature is > 0)
-----------------------------------------
Let ``p_x`` be the target's distribution after node ``x``: its logits after temperature,
top-k and top-p (:func:`filtered_probs`). The walk starts at the root with a *residual*
``r = p_root`` and visits the children of the current node in node-index order. Child ``c``
carries a proposal ``q_c``, the law its token was drawn from: ``draft_probs[b, c]`` when the
draft sampled it, or the point mass on ``tokens[c]`` when the children are a deterministic
function of the draft (EAGLE-2 top-k trees, ``draft_probs=None``).

* ``c`` is accepted with probability ``min(1, r(tok_c) / q_c(tok_c))``; the walk then moves to
  ``c`` and starts over with ``r = p_c``.
* otherwise ``r <- normalize(max(r - q_c, 0))`` and the next child is tried. For a point mass
  this just removes ``tok_c`` from ``r`` (a duplicate sibling token can then never be accepted).
* when every child of the current node was rejected, or it has none, the bonus token is drawn
  from ``r`` and the walk ends.

For a point-mass tree this emits exactly a sample of the target: the first child is taken with
probability ``p(t_1)``, the second with ``(1 - p(t_1)) * p(t_2) / (1 - p(t_1)) = p(t_2)``, ...,
and a token that is no child's comes out as the bonus with probability ``p(t)``. For a chain of
sampled drafts it is the classic speculative-sampling rule: a token ``t`` is emitted and
continued with probability ``min(p(t), q(t))`` and emitted as the bonus with probability
``max(p(t) - q(t), 0)``, which sum to ``p(t)``. Siblings sharing one ``q`` are correct when they
are independent draws from it.

Rows whose temperature is 0 take the :func:`specjax.tree.greedy_accept` result unchanged.

Implementation
--------------
A ``scan`` over the ``tree.max_depth + 1`` levels (the last one only stops the rows that reached
the deepest level). At each level the current node's logits are gathered and filtered once
([B, V] sort), then a ``fori_loop`` runs over the index range of the next depth's nodes (from
``tree.depth``; nodes are ordered by depth): those whose parent is the current node are tried,
the others are no-ops. For point masses the residual is kept unnormalised together with its
mass, so a loop step is O(1) per row (zero one entry, subtract its probability); with
``draft_probs`` a loop step is O(V). In total ``D + 1`` sorts of [B, V] and about ``N`` loop
steps (a chain: one per level), one program body each, so the compile stays small.

Randomness is a pure function of (seed, root position, depth, child rank): the uniform that
decides the ``k``-th child tried at depth ``d`` comes from
``fold_in(fold_in(fold_in(fold_in(key(seed), root_pos), ACCEPT_TAG), d), k)``, and the bonus
token from ``fold_in(fold_in(key(seed), root_pos), BONUS_TAG)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import SamplingArrays, filtered_logits
from specjax.tree import Tree, greedy_accept

ACCEPT_TAG = 0x61636370  # fold-in tag of the acceptance uniforms
BONUS_TAG = 0x626F6E73  # fold-in tag of the bonus / residual sample


def filtered_probs(logits, samp: SamplingArrays):
    """Sampling distribution [B, V] float32 of logits [B, V]: softmax of the temperature /
    top-k / top-p filtered logits, in vocabulary order. Rows with temperature 0 give the one-hot
    of the argmax."""
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    vals, order = filtered_logits(logits, samp.temperature, samp.top_p, samp.top_k)  # [B, V] sorted
    sorted_probs = jax.nn.softmax(vals, axis=-1)  # [B, V]
    rows = jnp.arange(b)[:, None]
    probs = jnp.zeros((b, v), jnp.float32).at[rows, order].set(sorted_probs)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    return jnp.where((samp.temperature > 0)[:, None], probs, greedy)


def _fold(keys, data):
    """keys [B] (typed key array), data [B] or scalar int -> fold_in per row, [B] keys."""
    data = jnp.broadcast_to(jnp.asarray(data, jnp.uint32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, data)


def _base_keys(seed, root_pos):
    """Per-row key [B] for one verification: fold_in(key(seed), root_pos)."""
    keys = jax.vmap(jax.random.key)(seed.astype(jnp.uint32))
    return _fold(keys, root_pos.astype(jnp.uint32))


def _uniform(keys, rank):
    """A uniform in [0, 1) per row from fold_in(keys, rank): [B] float32."""
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(_fold(keys, rank))


def _column(x, c):
    """x[:, c] for a traced c (x [B, N, ...]) -> [B, ...]."""
    return jax.lax.dynamic_index_in_dim(x, c, axis=1, keepdims=False)


def _level_bounds(depth, d):
    """Scalar node-index range [lo, hi) holding every node of depth d in every row (nodes are
    ordered by depth); lo >= hi when there is none."""
    n = depth.shape[1]
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    here = depth == d  # [B, N]
    return jnp.min(jnp.where(here, idx, n)), jnp.max(jnp.where(here, idx + 1, 0))


def _try_children(tree: Tree, cur, p, keys, draft_probs, d):
    """Try the children of ``cur`` [B] (a node of depth d) in node order, starting from the
    residual p [B, V].

    keys [B]: this depth's acceptance keys (the child's rank is folded in here). Returns
    (found [B] bool, child [B] int32, residual [B, V] unnormalised, mass [B] float32 = its total);
    residual/mass are what is left after the rejections: the bonus law when nothing was accepted.
    """
    b = tree.tokens.shape[0]
    rows = jnp.arange(b)

    def body(c, carry):
        res, mass, rank, found, child = carry
        tok = _column(tree.tokens, c)  # [B]
        tried = (_column(tree.parents, c) == cur) & ~found  # [B]
        u = _uniform(keys, rank)  # [B]
        p_tok = res[rows, tok]  # [B] unnormalised: the probability is p_tok / mass
        if draft_probs is None:  # point mass on tok: accept with probability p(tok)
            accept = tried & (u * mass < p_tok)
            reject = tried & ~accept
            res = res.at[rows, tok].set(jnp.where(reject, 0.0, p_tok))
            mass = jnp.where(reject, jnp.maximum(mass - p_tok, 0.0), mass)
        else:  # accept with probability min(1, p(tok) / q(tok)), i.e. u * q * mass < p_tok
            q = _column(draft_probs, c)  # [B, V]
            q_tok = q[rows, tok]
            accept = tried & (u * q_tok * mass < p_tok)
            reject = tried & ~accept
            left = jnp.maximum(res - q * mass[:, None], 0.0)  # [B, V] = mass * max(p - q, 0)
            left_mass = jnp.sum(left, axis=-1)  # [B]
            ok = reject & (left_mass > 0)  # zero residual (p <= q everywhere): keep p
            res = jnp.where(ok[:, None], left / jnp.where(ok, left_mass, 1.0)[:, None], res)
            mass = jnp.where(ok, 1.0, mass)
        rank = rank + tried.astype(jnp.int32)
        child = jnp.where(accept, c, child)
        return res, mass, rank, found | accept, child

    zeros = jnp.zeros((b,), jnp.int32)
    carry = (p, jnp.sum(p, axis=-1), zeros, jnp.zeros((b,), bool), zeros)
    lo, hi = _level_bounds(tree.depth, d + 1)
    res, mass, _, found, child = jax.lax.fori_loop(lo, hi, body, carry)
    return found, child, res, mass


def _sample_bonus(keys, probs):
    """One token per row from the unnormalised probs [B, V] with keys [B] -> [B] int32."""
    return jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)


def verify_tree(tree: Tree, target_logits, samp: SamplingArrays, root_pos, *, draft_probs=None,
                stochastic: bool = True):
    """Accept a prefix of the draft tree and pick the bonus token.

    tree: Tree with N nodes, B rows. target_logits [B, N, V] float32: the target's logits after
    each node. samp: per-row sampling parameters. root_pos [B] int32: sequence position of the
    root (keys the randomness). draft_probs: None (children are a deterministic function of the
    draft: point-mass proposals), or [B, N, V] float32 with draft_probs[b, c] the (filtered)
    distribution node c's token was sampled from; draft_probs[:, 0] is unused.
    stochastic (static): False compiles the greedy-only program (== tree.greedy_accept).

    Returns (accept_idx [B, D + 1] int32: the accepted path's node indices, accept_idx[:, 0] = 0,
    padded with -1; num_accepted [B] int32 >= 1 including the root; bonus [B] int32), the
    contract of :func:`specjax.tree.greedy_accept`.
    """
    b, n = tree.tokens.shape
    max_depth = tree.max_depth if tree.max_depth > 0 else n - 1
    target_logits = target_logits.astype(jnp.float32)
    if draft_probs is not None:
        draft_probs = draft_probs.astype(jnp.float32)
    g_idx, g_num, g_bonus = greedy_accept(tree, jnp.argmax(target_logits, axis=-1).astype(jnp.int32))
    if not stochastic:
        return g_idx, g_num, g_bonus

    rows = jnp.arange(b)
    base = _base_keys(samp.seed, root_pos)  # [B]
    accept_keys = _fold(base, ACCEPT_TAG)

    def level(carry, d):
        """One depth: filter the current node's logits, try its children, move or stop."""
        cur, alive, count, final = carry
        p = filtered_probs(target_logits[rows, cur], samp)  # [B, V]
        found, child, res, mass = _try_children(tree, cur, p, _fold(accept_keys, d + 1), draft_probs, d)
        stop = alive & ~found  # every child rejected, or a leaf: the bonus comes from the residual
        usable = (mass > 0) & (jnp.sum(res, axis=-1) > 0)  # guard: an empty residual falls back to p
        final = jnp.where(stop[:, None], jnp.where(usable[:, None], res, p), final)
        moved = alive & found
        carry = (jnp.where(moved, child, cur), moved, count + moved.astype(jnp.int32), final)
        return carry, jnp.where(moved, child, -1)

    # max_depth + 1 levels: at the last one no node is deeper, so every row still alive stops there.
    init = (jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), jnp.ones((b,), jnp.int32),
            jnp.zeros((b, target_logits.shape[-1]), jnp.float32))
    (_, _, count, final), moves = jax.lax.scan(level, init, jnp.arange(max_depth + 1, dtype=jnp.int32))
    path = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), moves[:max_depth].T], axis=1)  # [B, D + 1]
    bonus = _sample_bonus(_fold(base, BONUS_TAG), final)

    greedy = ~(samp.temperature > 0)  # [B]
    accept_idx = jnp.where(greedy[:, None], g_idx, path)
    return accept_idx, jnp.where(greedy, g_num, count), jnp.where(greedy, g_bonus, bonus)
