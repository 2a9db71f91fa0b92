"""Draft trees for EAGLE-2 style speculative decoding (and the chain special case).

Everything here is pure ``jnp`` with static shapes, batched over rows ``B``, and usable
inside ``jax.jit``.

Conventions
-----------
* A tree has ``N = num_draft_tokens + 1`` nodes: node 0 is the *root* (the last accepted
  token, depth 0) followed by ``M = num_draft_tokens`` draft nodes.
* Nodes are ordered by depth, and within a depth by candidate index (see below), so that
  ``parents[i] < i`` for every ``i >= 1``; ``parents[0] == -1``.
* ``mask[b, i, j]`` is True iff node ``j`` is node ``i`` or an ancestor of node ``i``
  (the tree attention mask: node ``i`` attends to ``j``).
* Positions: the KV cache holds ``seq_len`` tokens *not* including the root. The root is
  fed to the target together with the draft nodes at position ``seq_len``, so a node at
  depth ``d`` sits at position ``seq_len + d`` (see :func:`positions`).
* Gathers along a tree (parents, kept candidates, accepted nodes) take indices that are in range by
  construction (-1s clamped to 0 first) with ``mode="clip"``: jnp's default fill adds bounds-check
  selects, and they cost the batch-1 fused step a kernel (scripts/count_step_kernels.py, H100).

EAGLE-2 growth (``topk = k``, ``num_steps = S``)
------------------------------------------------
* step 0: the root's ``k`` best children; ``C_0 = k`` candidates at depth 1, score = log-prob.
* step s >= 1: the frontier is the ``k`` best candidates of step ``s-1`` (by cumulative score,
  ties -> lower candidate index); each frontier node expands its ``k`` best children,
  score = parent score + child log-prob, giving ``C_s = k*k`` candidates at depth ``s+1``.
  Candidate ``j*k + r`` of step ``s`` is the ``r``-th best child of the ``j``-th frontier node.
* finally the best ``M`` of all ``sum_s C_s`` candidates are kept (ties -> lower depth, then
  lower candidate index). Scores are made monotone along paths (a node's effective score is
  ``min(own, parent's effective)``), so the kept set is always closed under ancestors.

Per-step candidate representation consumed by :func:`select_tree` (lists of length ``S``)::

    step_tokens[s]   [B, C_s] int32    candidate token ids
    step_scores[s]   [B, C_s] float32  cumulative log-prob scores
    step_parents[s]  [B, C_s] int32    index into step s-1's candidates (-1 = root; step 0)

:func:`expand_step` / :func:`frontier` produce exactly that from the draft's log-probs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import topk as topk_lib

SPEC_METHODS = ("draft", "eagle", "eagle3", "ngram")


def shape_label(num_steps: int, topk: int, num_draft_tokens: int, ngram_branch: int = 0) -> str:
    """'7/4/24+7': num_steps / topk / num_draft_tokens [+ ngram_branch], as logs and tables name a tree."""
    return f"{num_steps}/{topk}/{num_draft_tokens}" + (f"+{ngram_branch}" if ngram_branch else "")


def max_candidates(num_steps: int, topk: int) -> int:
    """Total number of EAGLE-2 candidates: ``topk + (num_steps - 1) * topk**2``."""
    return topk + (num_steps - 1) * topk * topk


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding configuration.

    ``num_draft_tokens`` (M) counts the draft nodes, *excluding* the root; the verified tree
    has ``num_nodes = M + 1`` nodes. ``topk == 1`` is a chain of ``num_steps`` tokens (M must
    then equal ``num_steps``). When None, M defaults to ``num_steps`` for a chain and to
    ``min(max_candidates, num_steps * topk)`` for a tree.

    ``method="ngram"`` (specjax.ngram, no draft weights) drafts the continuations of the ``topk``
    best matches of the last ``ngram_max`` down to ``ngram_min`` tokens in the request's own
    text; its tree is the trie of those continuations (``max_candidates = num_steps * topk``).

    ``ngram_branch`` (L, 0 <= L <= num_steps; a model draft's tree, topk > 1) adds L nodes to each
    tree: the continuation of the request's best n-gram match (the same lookup, ngram_max /
    ngram_min) under the root, merged into the tree where the tree already has its tokens
    (:func:`merge_branch`); ``num_nodes = num_draft_tokens + 1 + L``.
    """

    method: str = "eagle"
    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int | None = None
    ngram_max: int = 4  # n-gram drafter: longest suffix matched
    ngram_min: int = 1  # n-gram drafter: shortest suffix matched
    ngram_branch: int = 0  # a model draft's tree: nodes of one n-gram continuation added under the root

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"SpecConfig.method must be one of {SPEC_METHODS}, got {self.method!r}")
        for name in ("num_steps", "topk", "ngram_max", "ngram_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SpecConfig.{name} must be an int >= 1, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"SpecConfig.ngram_min={self.ngram_min} exceeds ngram_max={self.ngram_max}")
        b = self.ngram_branch
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= self.num_steps:
            raise ValueError(f"SpecConfig.ngram_branch must be an int in [0, num_steps={self.num_steps}], got {b!r}")
        if b and (self.method == "ngram" or self.topk == 1):
            raise ValueError(f"SpecConfig.ngram_branch={b} adds an n-gram branch to a model draft's tree "
                             f"(topk > 1); got method={self.method!r}, topk={self.topk}")
        cap = self.max_candidates
        m = self.num_draft_tokens
        if m is None:
            m = self.num_steps if self.topk == 1 else min(cap, self.num_steps * self.topk)
            object.__setattr__(self, "num_draft_tokens", m)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"SpecConfig.num_draft_tokens must be an int >= 1, got {m!r}")
        if self.topk == 1 and m != self.num_steps:
            raise ValueError(
                f"SpecConfig: with topk=1 (a chain) num_draft_tokens must equal num_steps "
                f"({self.num_steps}), got {m}")
        if m > cap:
            how = "num_steps*topk" if self.method == "ngram" else "topk + (num_steps-1)*topk^2"
            raise ValueError(
                f"SpecConfig.num_draft_tokens={m} exceeds the {cap} candidates that "
                f"num_steps={self.num_steps}, topk={self.topk} can produce ({how})")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def num_nodes(self) -> int:
        """Tree size including the root: num_draft_tokens + 1 (+ ngram_branch)."""
        return self.num_draft_tokens + 1 + self.ngram_branch

    @property
    def max_candidates(self) -> int:
        if self.method == "ngram":  # topk continuations of num_steps tokens
            return self.num_steps * self.topk
        return max_candidates(self.num_steps, self.topk)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    """A batch of draft trees with N = M + 1 nodes (node 0 = root)."""

    tokens: jax.Array  # [B, N] int32; tokens[:, 0] = root token
    parents: jax.Array  # [B, N] int32; parents[:, 0] = -1, parents[:, i] < i
    depth: jax.Array  # [B, N] int32; depth[:, 0] = 0
    mask: jax.Array  # [B, N, N] bool; mask[b, i, j] = j is i or an ancestor of i
    max_depth: int = dataclasses.field(default=0, metadata={"static": True})  # = num_steps

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


# ----------------------------------------------------------------------------- growth


def expand_step(parent_scores, child_logprobs, topk: int, impl: str = "xla"):
    """Expand frontier nodes by their ``topk`` best children.

    parent_scores   [B, F] float32: cumulative scores of the F frontier nodes (zeros for the root)
    child_logprobs  [B, F, V] float32: the draft's log-probs for each frontier node's next token
    Returns (tokens [B, F*topk] int32, scores [B, F*topk] float32, local_parent [B, F*topk] int32)
    where candidate ``j*topk + r`` is the r-th best child (ties -> lower token id) of frontier
    node ``j`` and ``local_parent`` is ``j``. impl: the top-k implementation (specjax.topk.IMPLS; the
    same results).
    """
    lp, tok = topk_lib.top_k(child_logprobs, topk, impl)  # [B, F, k]
    return expand_top(parent_scores, lp, tok)


def expand_top(parent_scores, lp, tok):
    """expand_step from each frontier node's best children already chosen: lp [B, F, k] their log-probs,
    tok [B, F, k] their draft ids, best first (e.g. specjax.topk.top_k_log_softmax)."""
    b, f, topk = lp.shape
    scores = parent_scores[:, :, None].astype(jnp.float32) + lp.astype(jnp.float32)
    local = jnp.broadcast_to(jnp.arange(f, dtype=jnp.int32)[None, :, None], (b, f, topk))
    return (tok.astype(jnp.int32).reshape(b, f * topk), scores.reshape(b, f * topk),
            local.reshape(b, f * topk))


def frontier(scores, topk: int, impl: str = "xla"):
    """Indices [B, topk] int32 of the ``topk`` best candidates (ties -> lower index), best first.
    impl "reduce": specjax.topk.top_k_reduce (the same indices) instead of a sort."""
    if impl == "reduce":
        return topk_lib.top_k_reduce(scores, topk)[1]
    order = jnp.argsort(-scores, axis=-1, stable=True)
    return order[:, :topk].astype(jnp.int32)


# ----------------------------------------------------------------------------- trees


def _ancestor_mask(parents, max_depth: int):
    """mask [B, N, N]: j == i or j is an ancestor of i. parents [B, N] with -1 for the root."""
    b, n = parents.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    mask = jnp.broadcast_to(idx[:, None] == idx[None, :], (b, n, n))
    anc = parents
    for _ in range(max_depth):
        mask = mask | (anc[:, :, None] == idx[None, None, :])  # anc == -1 matches nothing
        anc = jnp.where(anc >= 0, jnp.take_along_axis(parents, jnp.maximum(anc, 0), axis=1, mode="clip"), -1)
    return mask


def select_tree(root_tokens, step_tokens, step_scores, step_parents, num_draft_tokens: int) -> Tree:
    """Keep the best ``num_draft_tokens`` EAGLE-2 candidates and lay them out as a Tree.

    root_tokens      [B] int32
    step_tokens[s]   [B, C_s] int32
    step_scores[s]   [B, C_s] float32 cumulative scores
    step_parents[s]  [B, C_s] int32 index into step s-1's candidates; ignored for s = 0 (root)
    Candidates are ranked by effective score (min of own and ancestors' scores), ties ->
    lower depth, then lower candidate index; the kept nodes are ordered by (depth, index).
    """
    num_steps = len(step_tokens)
    if not (num_steps == len(step_scores) == len(step_parents)) or num_steps == 0:
        raise ValueError("select_tree: need the same non-zero number of steps for tokens/scores/parents")
    b = root_tokens.shape[0]
    sizes = [t.shape[1] for t in step_tokens]
    offsets = [sum(sizes[:s]) for s in range(num_steps)]
    k_total = sum(sizes)
    m = int(num_draft_tokens)
    if not 1 <= m <= k_total:
        raise ValueError(f"select_tree: num_draft_tokens={m} must be in [1, {k_total}] (candidates)")

    eff_steps, gparents, depths = [], [], []
    for s in range(num_steps):
        sc = step_scores[s].astype(jnp.float32)
        if s == 0:
            eff = sc
            gp = jnp.full(sc.shape, -1, jnp.int32)
        else:
            lp = step_parents[s].astype(jnp.int32)
            eff = jnp.minimum(sc, jnp.take_along_axis(eff_steps[-1], lp, axis=1, mode="clip"))
            gp = lp + offsets[s - 1]
        eff_steps.append(eff)
        gparents.append(gp)
        depths.append(jnp.full(sc.shape, s + 1, jnp.int32))
    eff = jnp.concatenate(eff_steps, axis=1)  # [B, K]
    toks = jnp.concatenate([t.astype(jnp.int32) for t in step_tokens], axis=1)  # [B, K]
    gpar = jnp.concatenate(gparents, axis=1)  # [B, K] global candidate index, -1 = root
    dep = jnp.concatenate(depths, axis=1)  # [B, K]

    # Flat order is (depth, index): a candidate's rank counts those before it (a better score, or the
    # same score and a lower flat index); the m of rank < m are kept, numbered in flat order. Compares
    # and sums over K x K (K = 68 for a 5 x 4 tree) instead of two sorts: fewer, cheaper kernels on a GPU, the
    # same result as a stable descending sort.
    eff = jnp.where(jnp.isnan(eff), -jnp.inf, eff)  # a NaN score ranks as -inf, never first
    idx = jnp.arange(k_total, dtype=jnp.int32)
    ahead = (eff[:, None, :] > eff[:, :, None]) | ((eff[:, None, :] == eff[:, :, None]) & (idx[None, :] < idx[:, None]))
    kept = jnp.sum(ahead, axis=2, dtype=jnp.int32) < m  # [B, K]
    node_of = jnp.where(kept, jnp.cumsum(kept, axis=1, dtype=jnp.int32), 0)  # candidate -> node (0 = not kept)
    nodes = jnp.arange(1, m + 1, dtype=jnp.int32)
    keep = jnp.sum(jnp.where(node_of[:, None, :] == nodes[None, :, None], idx[None, None, :], 0), axis=2,
                   dtype=jnp.int32)  # [B, M] the candidate of each node

    cpar = jnp.take_along_axis(gpar, keep, axis=1, mode="clip")  # [B, M]
    npar = jnp.where(cpar < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(cpar, 0), axis=1, mode="clip"))

    tokens = jnp.concatenate([root_tokens.astype(jnp.int32)[:, None],
                              jnp.take_along_axis(toks, keep, axis=1, mode="clip")], axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), npar], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                             jnp.take_along_axis(dep, keep, axis=1, mode="clip")], axis=1)
    return Tree(tokens=tokens, parents=parents, depth=depth,
                mask=_ancestor_mask(parents, num_steps), max_depth=num_steps)


def make_tree(tokens, parents, depth, max_depth: int) -> Tree:
    """A Tree from stored tokens / parents / depth [B, N] (the mask is rebuilt from the parents)."""
    return Tree(tokens=tokens, parents=parents, depth=depth, mask=_ancestor_mask(parents, max_depth),
                max_depth=max_depth)


def merge_branch(tree: Tree, branch) -> Tree:
    """tree (N nodes) and a chain branch [B, L] int32 of tokens under the root -> a Tree of N + L
    nodes whose root-to-node token paths are the tree's and the branch's prefixes up to max_depth.

    The branch follows the tree's nodes while the tree has its tokens; from the first token the tree
    lacks, its nodes hang under the last node it reached (then under each other). Branch node i is
    node N + i; one that only repeats a tree node it followed, or that would lie deeper than
    max_depth, is a duplicate sibling (the followed node's parent and token; node 1's for too deep),
    which verification never takes: greedy_accept picks the lowest index among equal children, and
    a point-mass proposal's token is gone from the residual once an earlier sibling was rejected.
    Computed for all branch nodes at once (no loop over them: a few fused kernels on a GPU, where
    each kernel of the step costs launch latency): the tree nodes on the branch's path are those
    whose ancestors' tokens all equal the branch's at their depths; the mask is the parent's row
    plus the branch nodes of the chain, no rebuild from the parents.
    """
    b, n = tree.tokens.shape
    L, D = branch.shape[1], tree.max_depth
    g = branch.astype(jnp.int32)  # [B, L]
    d = tree.depth  # [B, N]
    at = jnp.take_along_axis(g, jnp.clip(d - 1, 0, L - 1), axis=1, mode="clip")  # [B, N] branch token at its depth
    eq = (d == 0) | ((d <= L) & (tree.tokens == at))
    on = jnp.all(~tree.mask | eq[:, None, :], axis=2) & (d >= 1)  # [B, N] the node's path is a branch prefix
    i = jnp.arange(L, dtype=jnp.int32)[None, :]  # [1, L]
    lvl = (d[:, None, :] == i[:, :, None] + 1) & on[:, None, :]  # [B, L, N] on the path at depth i + 1
    found = jnp.cumprod(jnp.any(lvl, axis=2).astype(jnp.int32), axis=1)  # [B, L] followed through i
    node = jnp.argmax(lvl, axis=2).astype(jnp.int32)  # [B, L] the tree node reached at depth i + 1
    m = jnp.sum(found, axis=1, keepdims=True)  # [B, 1] branch tokens the tree already has
    prev = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), node[:, :-1]], axis=1)  # [B, L] the node before i
    leave = jnp.take_along_axis(prev, jnp.minimum(m, L - 1), axis=1, mode="clip")  # [B, 1] where the branch leaves
    fits = (i < m) | (i + 1 <= D)  # [B, L] on the tree, or new and not too deep
    chain = fits & (i >= m)  # new nodes: a chain under `leave`
    toks = jnp.where(fits, g, tree.tokens[:, 1:2])
    pars = jnp.where(fits, jnp.where(i <= m, prev, n + i - 1), 0)
    deps = jnp.where(fits, i + 1, 1)
    anchor = jnp.where(chain, leave, jnp.where(fits, prev, 0))  # [B, L] the tree node above the chain
    lo = jnp.where(chain, m, i)  # [B, L] the chain's first branch node
    upper = jnp.take_along_axis(tree.mask, anchor[:, :, None], axis=1, mode="clip")  # [B, L, N]
    j = i[:, None, :]  # [1, 1, L] branch node columns
    own = (j >= lo[:, :, None]) & (j <= i[:, :, None])  # [B, L, L]
    mask = jnp.concatenate([jnp.concatenate([tree.mask, jnp.zeros((b, n, L), bool)], axis=2),
                            jnp.concatenate([upper, own], axis=2)], axis=1)  # [B, N + L, N + L]
    return Tree(tokens=jnp.concatenate([tree.tokens, toks], axis=1),
                parents=jnp.concatenate([tree.parents, pars], axis=1),
                depth=jnp.concatenate([tree.depth, deps], axis=1), mask=mask, max_depth=D)


def chain_tree(root_tokens, draft_tokens) -> Tree:
    """The topk=1 tree: root_tokens [B], draft_tokens [B, S] -> a chain of N = S + 1 nodes."""
    b, s = draft_tokens.shape
    n = s + 1
    idx = jnp.arange(n, dtype=jnp.int32)
    tokens = jnp.concatenate([root_tokens.astype(jnp.int32)[:, None],
                              draft_tokens.astype(jnp.int32)], axis=1)
    parents = jnp.broadcast_to(idx - 1, (b, n))
    depth = jnp.broadcast_to(idx, (b, n))
    mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, n, n))
    return Tree(tokens=tokens, parents=parents, depth=depth, mask=mask, max_depth=s)


def positions(tree: Tree, seq_len):
    """Rope positions [B, N] int32 of the tree nodes: ``seq_len + depth``.

    ``seq_len`` [B] is the number of tokens already in the KV cache, *excluding* the root
    (the root is written together with the draft nodes, at position ``seq_len``).
    """
    return seq_len.astype(jnp.int32)[:, None] + tree.depth


def greedy_accept(tree: Tree, target_argmax):
    """Greedy verification of a draft tree.

    target_argmax [B, N] int32: the target's argmax next token after each node.
    Walks from the root: a child ``c`` of the current node is accepted iff
    ``tokens[c] == target_argmax[current]`` (several matching children -> the lowest index).
    Returns:
      accept_idx   [B, max_depth + 1] int32: node indices of the accepted path, accept_idx[:, 0]
                   = 0 (root), padded with -1.
      num_accepted [B] int32 >= 1: accepted path length including the root. The new tokens are
                   tokens[accept_idx[1:num_accepted]] followed by bonus_token.
      bonus_token  [B] int32: target_argmax at the last accepted node.

    Computed for all nodes at once (greedy_accept_walk is the walk itself, the reference): a node is
    taken if its token is the target's choice after its parent and no lower-index sibling's is; the
    walk reaches a node iff every node on its root path (the tree's ancestor mask) is taken. A few
    compares and reductions over [B, N, N] instead of max_depth dependent rounds: ~4 kernels on a GPU
    instead of ~12 in the fused step.
    """
    b, n = tree.tokens.shape
    max_depth = tree.max_depth if tree.max_depth > 0 else n - 1
    t = target_argmax.astype(jnp.int32)
    par = tree.parents
    idx = jnp.arange(n, dtype=jnp.int32)
    good = (par >= 0) & (tree.tokens == jnp.take_along_axis(t, jnp.maximum(par, 0), axis=1, mode="clip"))  # [B, N]
    sibling_before = (par[:, None, :] == par[:, :, None]) & (idx[None, None, :] < idx[None, :, None])  # [B, N, N]
    shadowed = jnp.any(good[:, None, :] & sibling_before, axis=2)  # a lower-index sibling matches: the walk takes it
    taken = (good & ~shadowed) | (idx == 0)[None, :]  # the root counts as taken
    reached = jnp.all(taken[:, None, :] | ~tree.mask, axis=2)  # [B, N] every node of its root path taken
    # one reached node per depth in a tree built here: the first reached node of each depth. For any
    # other input (a padding row's stale tree; a tree whose depths or mask contradict its parents) the
    # path is cut at the first depth whose node is not a taken child of the node before, so it is
    # always a prefix of the walk's (greedy_accept_walk): every accepted token is the target's choice
    # and no -1 lies within num_accepted
    at = reached[:, None, :] & (tree.depth[:, None, :] == jnp.arange(max_depth + 1, dtype=jnp.int32)[None, :, None])
    # column 0 (the root) set by a select, not `.at[:, 0].set`: XLA turns that scatter into an update whose bounds
    # check is a reduction kernel of its own (one per fused step on a GPU)
    col0 = jnp.arange(max_depth + 1, dtype=jnp.int32)[None, :] == 0  # [1, D + 1]
    first = jnp.where(col0, 0, jnp.where(jnp.any(at, axis=2), jnp.argmax(at, axis=2).astype(jnp.int32), -1))  # [B, D + 1]
    safe = jnp.maximum(first, 0)
    prev = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), first[:, :-1]], axis=1)
    linked = ((first >= 0) & (jnp.take_along_axis(par, safe, axis=1, mode="clip") == prev)
              & jnp.take_along_axis(taken, safe, axis=1, mode="clip"))
    linked = linked | col0  # the root
    ok = jnp.cumprod(linked.astype(jnp.int32), axis=1)  # [B, D + 1]
    count = jnp.sum(ok, axis=1, dtype=jnp.int32)
    accept_idx = jnp.where(ok > 0, first, -1)
    cur = jnp.take_along_axis(accept_idx, (count - 1)[:, None], axis=1, mode="clip")[:, 0]
    bonus = jnp.take_along_axis(t, cur[:, None], axis=1, mode="clip")[:, 0]
    return accept_idx, count, bonus


def greedy_accept_walk(tree: Tree, target_argmax):
    """greedy_accept as the walk it describes, max_depth dependent rounds (the reference)."""
    b, n = tree.tokens.shape
    max_depth = tree.max_depth if tree.max_depth > 0 else n - 1
    target_argmax = target_argmax.astype(jnp.int32)
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path = [cur]
    count = jnp.ones((b,), jnp.int32)
    for _ in range(max_depth):
        want = target_argmax[rows, cur]  # [B]
        match = (tree.parents == cur[:, None]) & (tree.tokens == want[:, None])  # [B, N]
        found = alive & jnp.any(match, axis=1)
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)
        path.append(jnp.where(found, nxt, -1))
        cur = jnp.where(found, nxt, cur)
        count = count + found.astype(jnp.int32)
        alive = found
    accept_idx = jnp.stack(path, axis=1)
    bonus = target_argmax[rows, cur]
    return accept_idx, count, bonus


def accepted_tokens(tree: Tree, accept_idx, num_accepted, bonus_token):
    """The new tokens of a greedy_accept result: [B, max_depth + 1] int32, padded with -1.

    out[:, j] = tokens[accept_idx[:, j + 1]] for j < num_accepted - 1, then the bonus token at
    j = num_accepted - 1; each row yields num_accepted new tokens.
    """
    b, w = accept_idx.shape
    nxt = accept_idx[:, 1:]  # [B, w-1]
    drafted = jnp.where(nxt >= 0, jnp.take_along_axis(tree.tokens, jnp.maximum(nxt, 0), axis=1, mode="clip"), -1)
    out = jnp.concatenate([drafted, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    col = jnp.arange(w, dtype=jnp.int32)[None, :]
    return jnp.where(col == (num_accepted - 1)[:, None], bonus_token.astype(jnp.int32)[:, None], out)
