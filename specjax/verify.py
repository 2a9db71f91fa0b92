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
([B, V] sort), then all children of the current node are tried at once: for point masses the
k-th child is accepted iff ``u_k * mass_k < p_k`` (``p_k`` its token's probability, 0 for a token an
earlier sibling carried; ``mass_k`` what the k - 1 rejections before it left), and the first such
child is taken; with sampled proposals (``draft_probs``) the children are tried one after another,
an O(V) residual update each, in a loop of static length (1 for a chain, whose max_depth is N - 1;
N - 1 otherwise). Every loop has a static length: XLA on GPUs reads the condition of
a data-dependent loop on the host at every iteration.

Randomness is a pure function of (seed, root position, depth, child rank): the uniform that
decides the ``k``-th child tried at depth ``d`` comes from
``fold_in(fold_in(fold_in(fold_in(key(seed), root_pos), ACCEPT_TAG), d), k)``, and the bonus
token from ``fold_in(fold_in(key(seed), root_pos), BONUS_TAG)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import UNFILTERED, SamplingArrays, filtered_logits
from specjax.tree import Tree, greedy_accept

ACCEPT_TAG = 0x61636370  # fold-in tag of the acceptance uniforms
BONUS_TAG = 0x626F6E73  # fold-in tag of the bonus / residual sample


def filtered_probs(logits, samp: SamplingArrays, unfiltered: bool = False):
    """Sampling distribution [B, V] float32 of logits [B, V]: softmax of the temperature /
    top-k / top-p filtered logits, in vocabulary order. Rows with temperature 0 give the one-hot
    of the argmax. unfiltered (static): the caller guarantees that no row uses top-k / top-p
    (sampling.UNFILTERED programs), so the softmax of the scaled logits is that distribution: no
    [B, V] sort (on an H200 the sort of each tree level was most of a sampled fused step's acceptance)."""
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    if unfiltered:
        t = jnp.where(samp.temperature > 0, samp.temperature, 1.0)[:, None]
        probs = jax.nn.softmax(logits / t, axis=-1)
    else:
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


def _try_children(tree: Tree, cur, p, keys, draft_probs, max_children):
    """Try the children of ``cur`` [B] (a node of depth d) in node order, starting from the
    residual p [B, V].

    keys [B]: this depth's acceptance keys (the child's rank is folded in here). max_children
    (static): an upper bound on any node's children (None: one, a chain). Returns
    (found [B] bool, child [B] int32, residual [B, V] unnormalised, mass [B] float32 = its total);
    residual/mass are what is left after the rejections: the bonus law when nothing was accepted.
    """
    b, n = tree.tokens.shape
    rows = jnp.arange(b)
    is_child = tree.parents == cur[:, None]  # [B, N] (the root's parent is -1)
    total = jnp.sum(p, axis=-1)  # [B]
    if draft_probs is not None:  # sampled proposals: the children one after another
        rank = jnp.cumsum(is_child, axis=1, dtype=jnp.int32) - 1  # [B, N]

        def body(k, carry):  # the k-th child of cur, where a row has one
            res, mass, found, child = carry
            kth = is_child & (rank == k)  # [B, N]
            c = jnp.argmax(kth, axis=1).astype(jnp.int32)  # [B]
            tok = tree.tokens[rows, c]
            tried = jnp.any(kth, axis=1) & ~found  # [B]
            u = _uniform(keys, jnp.full((b,), k, jnp.int32))
            q = draft_probs[rows, c]  # [B, V]
            accept = tried & (u * q[rows, tok] * mass < res[rows, tok])  # min(1, p / q)
            reject = tried & ~accept
            left = jnp.maximum(res - q * mass[:, None], 0.0)  # [B, V] = mass * max(p - q, 0)
            left_mass = jnp.sum(left, axis=-1)  # [B]
            ok = reject & (left_mass > 0)  # zero residual (p <= q everywhere): keep p
            res = jnp.where(ok[:, None], left / jnp.where(ok, left_mass, 1.0)[:, None], res)
            return res, jnp.where(ok, 1.0, mass), found | accept, jnp.where(accept, c, child)

        # a chain (max_depth = N - 1) has one child per node; a tree at most N - 1: a static count
        tries = 1 if max_children is None else max_children
        res, mass, found, child = jax.lax.fori_loop(
            0, tries, body, (p, total, jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32)))
        return found, child, res, mass
    # point masses: the k-th child (node order) is tried after the k before it were rejected, each
    # rejection removing its token from the residual; so it is accepted iff u_k * mass_k < p_k, with
    # p_k = p(tok_k) (0 for a token an earlier sibling carried) and mass_k = total - p_1 - .. - p_{k-1};
    # the first such child is taken. All children at once: no loop over a data-dependent range.
    tok = tree.tokens  # [B, N]
    rank = jnp.cumsum(is_child, axis=1, dtype=jnp.int32) - 1  # [B, N] the child's rank among its siblings
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)  # [N, N] j < c
    dup = jnp.any(earlier[None] & is_child[:, None, :] & (tok[:, :, None] == tok[:, None, :]), axis=-1)  # [B, N]
    p_k = jnp.where(is_child & ~dup, p[rows[:, None], tok], 0.0)  # [B, N]
    mass_k = jnp.maximum(total[:, None] - (jnp.cumsum(p_k, axis=1) - p_k), 0.0)  # [B, N]
    u = jax.vmap(lambda r: _uniform(keys, r), in_axes=1, out_axes=1)(jnp.maximum(rank, 0))  # [B, N]
    accept = is_child & (u * mass_k < p_k)  # [B, N]
    found = jnp.any(accept, axis=1)
    child = jnp.where(found, jnp.argmax(accept, axis=1), 0).astype(jnp.int32)
    res = p.at[rows[:, None], tok].multiply(jnp.where(is_child, 0.0, 1.0))  # every child's token removed
    return found, child, res, jnp.maximum(total - jnp.sum(p_k, axis=1), 0.0)


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
    stochastic (static): False compiles the greedy-only program (== tree.greedy_accept);
    sampling.UNFILTERED one for rows without top-k / top-p (no sort); True the general one.

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
    unfiltered = isinstance(stochastic, str) and stochastic == UNFILTERED
    max_children = None if tree.max_depth == n - 1 else n - 1  # a chain (max_depth known): one child per node
    base = _base_keys(samp.seed, root_pos)  # [B]
    accept_keys = _fold(base, ACCEPT_TAG)

    def level(carry, d):
        """One depth: filter the current node's logits, try its children, move or stop."""
        cur, alive, count, final = carry
        p = filtered_probs(target_logits[rows, cur], samp, unfiltered)  # [B, V]
        found, child, res, mass = _try_children(tree, cur, p, _fold(accept_keys, d + 1), draft_probs, max_children)
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
