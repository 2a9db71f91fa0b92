"""Draft tree construction (EAGLE-2) and greedy tree verification vs brute-force Python."""
from __future__ import annotations

import random
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.tree import (
    SpecConfig,
    Tree,
    accepted_tokens,
    chain_tree,
    expand_step,
    frontier,
    greedy_accept,
    greedy_accept_walk,
    make_tree,
    max_candidates,
    merge_branch,
    positions,
    select_tree,
)

B = 3
V = 9

_select = jax.jit(select_tree, static_argnums=4)
_expand = jax.jit(expand_step, static_argnums=(2, 3))
_frontier = jax.jit(frontier, static_argnums=(1, 2))
_chain = jax.jit(chain_tree)
_accept = jax.jit(greedy_accept)
_walk = jax.jit(greedy_accept_walk)
_positions = jax.jit(positions)
_accepted_tokens = jax.jit(accepted_tokens)


# ----------------------------------------------------------------------------- draft model


def draft_logprobs(seed: int, path: tuple, quantized: bool) -> np.ndarray:
    """Deterministic draft log-probs [V] float32 (all <= 0) given the token path from the root."""
    h = zlib.crc32(repr((seed, tuple(int(t) for t in path))).encode())
    rng = np.random.default_rng(h)
    if quantized:  # exact float32 sums and lots of ties (0 included: child score == parent's)
        return (-rng.integers(0, 6, V) / 4).astype(np.float32)
    x = rng.normal(size=V) * 2.0
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


def brute_force_eagle2(seed, num_steps, topk, m, quantized):
    """Pure-Python EAGLE-2: returns the kept token paths ordered by (depth, candidate index)."""
    cands = []  # dicts: path, score, depth, idx (global candidate index in (depth, index) order)
    lps = draft_logprobs(seed, (), quantized)
    best = sorted(range(V), key=lambda t: (-lps[t], t))[:topk]
    prev = [{"path": (t,), "score": np.float32(lps[t])} for t in best]
    steps = [prev]
    for _ in range(1, num_steps):
        order = sorted(range(len(prev)), key=lambda i: (-prev[i]["score"], i))[:topk]
        cur = []
        for i in order:
            p = prev[i]
            lps = draft_logprobs(seed, p["path"], quantized)
            for t in sorted(range(V), key=lambda t: (-lps[t], t))[:topk]:
                cur.append({"path": p["path"] + (t,), "score": np.float32(p["score"] + lps[t])})
        steps.append(cur)
        prev = cur
    for s, cur in enumerate(steps):
        for c in cur:
            cands.append(dict(c, depth=s + 1, idx=len(cands)))
    kept = sorted(cands, key=lambda c: (-c["score"], c["depth"], c["idx"]))[:m]
    kept = sorted(kept, key=lambda c: c["idx"])
    return [c["path"] for c in kept]


def jax_eagle2(seeds, root_tokens, num_steps, topk, m, quantized, impl="xla"):
    """The same growth through expand_step/frontier (host loop only to query the draft); impl: their
    top-k (specjax.topk)."""
    lp0 = np.stack([draft_logprobs(sd, (), quantized) for sd in seeds])[:, None, :]
    tok, sc, _ = _expand(jnp.zeros((B, 1), jnp.float32), jnp.asarray(lp0), topk, impl)
    step_tokens, step_scores = [tok], [sc]
    step_parents = [jnp.full(tok.shape, -1, jnp.int32)]
    paths = [[(int(t),) for t in row] for row in np.asarray(tok)]  # per row, per candidate
    for _ in range(1, num_steps):
        fr = _frontier(step_scores[-1], topk, impl)  # [B, k]
        fr_np = np.asarray(fr)
        lp = np.stack([np.stack([draft_logprobs(seeds[b], paths[b][j], quantized) for j in fr_np[b]])
                       for b in range(B)])
        tok, sc, local = _expand(jnp.take_along_axis(step_scores[-1], fr, axis=1), jnp.asarray(lp), topk, impl)
        par = jnp.take_along_axis(fr, local, axis=1)
        tok_np, par_np = np.asarray(tok), np.asarray(par)
        paths = [[paths[b][par_np[b, c]] + (int(tok_np[b, c]),) for c in range(tok.shape[1])]
                 for b in range(B)]
        step_tokens.append(tok)
        step_scores.append(sc)
        step_parents.append(par)
    tree = _select(jnp.asarray(root_tokens, jnp.int32), step_tokens, step_scores, step_parents, m)
    return tree, (step_tokens, step_scores, step_parents)


def node_paths(tokens, parents, i):
    path = []
    while i > 0:
        path.append(int(tokens[i]))
        i = int(parents[i])
    return tuple(reversed(path))


def check_tree_invariants(tree: Tree, root_tokens):
    tokens, parents, depth, mask = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depth, tree.mask))
    b, n = tokens.shape
    assert tokens.dtype == parents.dtype == depth.dtype == np.int32 and mask.dtype == bool
    assert mask.shape == (b, n, n)
    for r in range(b):
        assert tokens[r, 0] == root_tokens[r] and parents[r, 0] == -1 and depth[r, 0] == 0
        for i in range(1, n):
            assert 0 <= parents[r, i] < i
            assert depth[r, i] == depth[r, parents[r, i]] + 1
            assert depth[r, i] >= depth[r, i - 1]  # sorted by depth
            assert depth[r, i] <= tree.max_depth
        for i in range(n):
            anc = {i}
            j = i
            while j > 0:
                j = int(parents[r, j])
                anc.add(j)
            expect = np.array([j in anc for j in range(n)])
            np.testing.assert_array_equal(mask[r, i], expect)


def _case_sizes(k, s):
    cap = max_candidates(s, k)
    sizes = {cap, min(s * k, cap)}
    if k in (2, 3):  # a few extra sizes, kept small: every case is a separate compile
        sizes |= {1, max(1, cap // 2)}
    return sorted(m for m in sizes if k > 1 or m == s)


CASES = [(k, s, m) for k in range(1, 5) for s in range(1, 6) for m in _case_sizes(k, s)]


@pytest.mark.parametrize("impl", ["xla", "reduce"])
@pytest.mark.parametrize("quantized", [False, True])
def test_select_tree_matches_brute_force(quantized, impl):
    rnd = random.Random(1234 + quantized)
    for topk, num_steps, m in CASES:
        seeds = [rnd.randrange(1 << 30) for _ in range(B)]
        root_tokens = np.array([rnd.randrange(V) for _ in range(B)], np.int32)
        tree, _ = jax_eagle2(seeds, root_tokens, num_steps, topk, m, quantized, impl)
        assert tree.tokens.shape == (B, m + 1) and tree.max_depth == num_steps
        check_tree_invariants(tree, root_tokens)
        tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
        for r in range(B):
            want = brute_force_eagle2(seeds[r], num_steps, topk, m, quantized)
            got = [node_paths(tokens[r], parents[r], i) for i in range(1, m + 1)]
            assert got == want, (topk, num_steps, m, r)
            kept = set(want)  # closed under ancestors (the brute force is sorted purely by score)
            assert all(p[:-1] in kept or len(p) == 1 for p in kept)
            assert len(kept) == m  # sibling tokens are distinct, so paths identify nodes


def test_select_tree_closure_with_bad_scores():
    """Children scoring above their parents (positive 'log-probs') still give a closed tree."""
    rng = np.random.default_rng(0)
    k, s = 3, 4
    step_tokens, step_scores, step_parents = [], [], []
    for st in range(s):
        c = k if st == 0 else k * k
        step_tokens.append(jnp.asarray(rng.integers(0, 50, (B, c)), jnp.int32))
        step_scores.append(jnp.asarray(rng.normal(size=(B, c)), jnp.float32))  # not monotone
        prev = k if st <= 1 else k * k
        par = rng.integers(0, prev, (B, c)) if st else -np.ones((B, c))
        step_parents.append(jnp.asarray(par, jnp.int32))
    for m in (1, 4, 9, max_candidates(s, k)):
        tree = _select(jnp.zeros((B,), jnp.int32), step_tokens, step_scores, step_parents, m)
        check_tree_invariants(tree, np.zeros(B, np.int32))
    # a NaN score (a broken draft) ranks with -inf: a closed tree without that candidate (root child 0)
    step_scores[0] = step_scores[0].at[:, 0].set(jnp.nan)
    step_tokens[0] = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))
    tree = _select(jnp.zeros((B,), jnp.int32), step_tokens, step_scores, step_parents, 4)
    check_tree_invariants(tree, np.zeros(B, np.int32))
    depth1 = np.where(np.asarray(tree.depth) == 1, np.asarray(tree.tokens), -1)
    assert (depth1 != 0).all() and ((depth1 == 1) | (depth1 == 2)).any(axis=1).all()


def test_chain_tree_matches_select_topk1():
    rnd = random.Random(7)
    for num_steps in range(1, 6):
        seeds = [rnd.randrange(1 << 30) for _ in range(B)]
        root = np.array([rnd.randrange(V) for _ in range(B)], np.int32)
        tree, (step_tokens, _, _) = jax_eagle2(seeds, root, num_steps, 1, num_steps, False)
        chain = _chain(jnp.asarray(root), jnp.concatenate(step_tokens, axis=1))
        assert chain.max_depth == tree.max_depth == num_steps
        for a, b in ((chain.tokens, tree.tokens), (chain.parents, tree.parents),
                     (chain.depth, tree.depth), (chain.mask, tree.mask)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        check_tree_invariants(chain, root)


def test_positions():
    rnd = random.Random(3)
    seeds = [rnd.randrange(1 << 30) for _ in range(B)]
    tree, _ = jax_eagle2(seeds, np.zeros(B, np.int32), 3, 2, 6, False)
    seq_len = jnp.array([0, 5, 17], jnp.int32)
    pos = np.asarray(_positions(tree, seq_len))
    np.testing.assert_array_equal(pos, np.asarray(seq_len)[:, None] + np.asarray(tree.depth))
    assert pos.dtype == np.int32 and (pos[:, 0] == np.asarray(seq_len)).all()


# ----------------------------------------------------------------------------- greedy accept


def brute_force_accept(tokens, parents, target):
    cur, path = 0, [0]
    while True:
        kids = [c for c in range(len(tokens)) if parents[c] == cur and tokens[c] == target[cur]]
        if not kids:
            return path, int(target[cur])
        cur = min(kids)
        path.append(cur)


def check_accept(tree, target):
    acc, num, bonus = _accept(tree, jnp.asarray(target, jnp.int32))
    acc, num, bonus = np.asarray(acc), np.asarray(num), np.asarray(bonus)
    assert acc.shape == (B, tree.max_depth + 1) and acc.dtype == num.dtype == bonus.dtype == np.int32
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    for got, want in zip((acc, num, bonus), _walk(tree, jnp.asarray(target, jnp.int32))):  # the walk itself
        np.testing.assert_array_equal(got, np.asarray(want))
    for r in range(B):
        path, bon = brute_force_accept(tokens[r], parents[r], target[r])
        assert num[r] == len(path)
        assert list(acc[r, :len(path)]) == path and (acc[r, len(path):] == -1).all()
        assert bonus[r] == bon
    new = np.asarray(_accepted_tokens(tree, jnp.asarray(acc), jnp.asarray(num), jnp.asarray(bonus)))
    assert new.shape == acc.shape and new.dtype == np.int32
    for r in range(B):
        want = [int(tokens[r, i]) for i in acc[r, 1:num[r]]] + [int(bonus[r])]
        assert list(new[r]) == want + [-1] * (acc.shape[1] - len(want))
    return acc, num, bonus


def random_trees(rnd):
    for topk, num_steps, m in CASES[::2]:
        seeds = [rnd.randrange(1 << 30) for _ in range(B)]
        root = np.array([rnd.randrange(V) for _ in range(B)], np.int32)
        tree, _ = jax_eagle2(seeds, root, num_steps, topk, m, rnd.random() < 0.5)
        yield tree


def test_greedy_accept_random():
    rnd = random.Random(11)
    for tree in random_trees(rnd):
        tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
        n = tokens.shape[1]
        for p_match in (0.3, 0.7, 0.95):
            target = np.zeros((B, n), np.int32)
            for r in range(B):
                for i in range(n):
                    kids = [int(tokens[r, c]) for c in range(n) if parents[r, c] == i]
                    hit = kids and rnd.random() < p_match
                    target[r, i] = rnd.choice(kids) if hit else rnd.randrange(V + 2)
            check_accept(tree, target)


def test_merge_branch_paths_and_acceptance():
    """A chain branch merged into EAGLE-2 trees (merge_branch): the merged tree's root-to-node token
    paths are the tree's and the branch's prefixes up to max_depth (brute force), its parents / depth /
    mask are consistent, and greedy acceptance of a target that continues some sequence t accepts the
    longer of the tree's and the branch's matches of t (brute-force walk as in check_accept)."""
    rnd = random.Random(3)
    merge = jax.jit(merge_branch)
    for topk, num_steps, m in [(1, 3, 3), (2, 2, 5), (3, 4, 15), (4, 5, 20)]:
        root = np.array([rnd.randrange(V) for _ in range(B)], np.int32)
        tree, _ = jax_eagle2([rnd.randrange(1 << 30) for _ in range(B)], root, num_steps, topk, m, False)
        tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
        n, D = tokens.shape[1], tree.max_depth
        for L in sorted({1, D, D + 2}):
            for trial in range(4):
                branch, t = np.zeros((B, L), np.int32), []
                for r in range(B):  # follow one of the tree's paths for a while, then anything
                    path = node_paths(tokens[r], parents[r], rnd.randrange(n)) if trial % 2 else ()
                    follow = path[: rnd.randrange(len(path) + 1)]
                    branch[r] = list(follow[:L]) + [rnd.randrange(V) for _ in range(L - min(L, len(follow)))]
                    t.append(list(branch[r]) if trial < 2 else list(path) + [rnd.randrange(V)])
                m = merge(tree, jnp.asarray(branch))
                mt, mp, md, mm = (np.asarray(x) for x in (m.tokens, m.parents, m.depth, m.mask))
                assert mt.shape == (B, n + L) and m.max_depth == D
                np.testing.assert_array_equal(mt[:, :n], tokens)
                wants = []
                for r in range(B):
                    for i in range(1, n + L):
                        assert 0 <= mp[r, i] < i and md[r, i] == md[r, mp[r, i]] + 1 <= D
                        anc, j = {i}, i
                        while j > 0:
                            j = int(mp[r, j])
                            anc.add(j)
                        np.testing.assert_array_equal(mm[r, i], [j in anc for j in range(n + L)])
                    got = {node_paths(mt[r], mp[r], i) for i in range(n + L)}
                    want = {node_paths(tokens[r], parents[r], i) for i in range(n)}
                    want |= {tuple(int(x) for x in branch[r, :d]) for d in range(1, min(L, D) + 1)}
                    assert got == want, (r, L)
                    wants.append(want)
                target = np.zeros((B, n + L), np.int32)
                for r in range(B):
                    for i in range(n + L):
                        pth = node_paths(mt[r], mp[r], i)
                        on = len(pth) < len(t[r]) and list(pth) == t[r][: len(pth)]
                        target[r, i] = t[r][len(pth)] if on else V + 1  # off t: no child matches
                _, num, _ = check_accept(m, target)
                for r in range(B):
                    best = max(d for d in range(min(len(t[r]), D) + 1)
                               if tuple(t[r][:d]) in wants[r])
                    assert num[r] - 1 == best, (r, num[r], best)


def test_spec_config_ngram_branch():
    """SpecConfig.ngram_branch: nodes added to a model draft's tree (num_nodes counts them); refused
    for the n-gram drafter, a chain, deeper than num_steps or not an int >= 0."""
    c = SpecConfig(method="eagle3", num_steps=5, topk=4, num_draft_tokens=20, ngram_branch=5)
    assert c.num_nodes == 26 and c.num_draft_tokens == 20
    assert SpecConfig(method="eagle3", num_steps=5, topk=4, num_draft_tokens=20).num_nodes == 21
    for kw, msg in [(dict(method="eagle3", num_steps=3, topk=2, ngram_branch=4), r"in \[0, num_steps=3\], got 4"),
                    (dict(method="eagle3", num_steps=3, topk=2, ngram_branch=-1), "got -1"),
                    (dict(method="eagle3", num_steps=3, topk=2, ngram_branch=True), "got True"),
                    (dict(method="draft", num_steps=3, topk=1, ngram_branch=2), "topk=1"),
                    (dict(method="ngram", num_steps=3, topk=2, ngram_branch=2), "method='ngram'")]:
        with pytest.raises(ValueError, match=msg):
            SpecConfig(**kw)


def test_greedy_accept_all_and_none():
    rnd = random.Random(5)
    for tree in random_trees(rnd):
        tokens, parents, depth = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depth))
        n = tokens.shape[1]
        # all accepted along the deepest path
        target = np.full((B, n), V + 1, np.int32)
        deepest = []
        for r in range(B):
            d = int(np.argmax(depth[r]))  # first node of maximal depth
            deepest.append(d)
            target[r, d] = 4242
            j = d
            while j > 0:
                target[r, parents[r, j]] = tokens[r, j]
                j = parents[r, j]
        acc, num, bonus = check_accept(tree, target)
        for r in range(B):
            assert num[r] == depth[r, deepest[r]] + 1
            assert acc[r, num[r] - 1] == deepest[r] and bonus[r] == 4242
        # none accepted: the target's first token is no child of the root
        target = np.asarray(rnd.choices(range(V), k=B * n), np.int32).reshape(B, n)
        target[:, 0] = V + 3
        acc, num, bonus = check_accept(tree, target)
        assert (num == 1).all() and (acc[:, 0] == 0).all() and (acc[:, 1:] == -1).all()
        assert (bonus == V + 3).all()


def test_greedy_accept_stale_tree_stays_in_range():
    """A row whose tree is not one of ours (a padding row's stale state: depths that contradict the
    parents) still gets node indices in range (they index K/V compaction on the device)."""
    n = 6
    tree = make_tree(jnp.zeros((2, n), jnp.int32), jnp.zeros((2, n), jnp.int32).at[:, 0].set(-1),
                     jnp.zeros((2, n), jnp.int32), 3)  # every node a child of the root, all at "depth 0"
    acc, num, bonus = _accept(tree, jnp.zeros((2, n), jnp.int32))
    acc, num = np.asarray(acc), np.asarray(num)
    assert ((acc >= -1) & (acc < n)).all() and ((num >= 1) & (num <= 4)).all() and (np.asarray(bonus) == 0).all()


def test_greedy_accept_malformed_trees_cut_to_the_walks_prefix():
    """Any tree, also one whose depths or ancestor mask contradict its parents (a draft gone wrong on
    the device): the accepted path is a prefix of the walk's, with no -1 inside num_accepted, and the
    bonus is the target's choice after its last node; so every token emitted is the target's greedy
    choice, whatever the draft did (losslessness must not depend on the tree being well formed)."""
    rng = np.random.default_rng(11)
    B, n, D, V = 64, 9, 4, 3  # few token values: many matches, deep walks
    for trial in range(6):
        tokens = rng.integers(0, V, (B, n)).astype(np.int32)
        parents = np.where(rng.random((B, n)) < 0.8, rng.integers(0, n, (B, n)), -1).astype(np.int32)
        parents[:, 0] = -1
        if trial % 2:  # parents before children (the layout of our trees), depths and mask still random
            parents[:, 1:] = rng.integers(0, np.arange(1, n), (B, n - 1))
        depth = rng.integers(0, D + 1, (B, n)).astype(np.int32)
        mask = rng.random((B, n, n)) < 0.4
        mask[:, np.arange(n), np.arange(n)] = rng.random((B, n)) < 0.8  # not always the node itself
        tree = Tree(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), depth=jnp.asarray(depth),
                    mask=jnp.asarray(mask), max_depth=D)
        target = rng.integers(0, V, (B, n)).astype(np.int32)
        acc, num, bonus = map(np.asarray, _accept(tree, jnp.asarray(target)))
        w_acc, w_num, _ = map(np.asarray, _walk(tree, jnp.asarray(target)))
        toks = np.asarray(accepted_tokens(tree, jnp.asarray(acc), jnp.asarray(num), jnp.asarray(bonus)))
        for r in range(B):
            k = int(num[r])
            assert 1 <= k <= w_num[r] and (acc[r, :k] == w_acc[r, :k]).all() and (acc[r, k:] == -1).all()
            assert bonus[r] == target[r, acc[r, k - 1]]
            assert (toks[r, :k] >= 0).all() and (toks[r, :k - 1] == tokens[r, acc[r, 1:k]]).all()


def test_greedy_accept_chain():
    root = jnp.array([1, 2, 3], jnp.int32)
    draft = jnp.array([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]], jnp.int32)
    tree = _chain(root, draft)
    target = jnp.array([[10, 11, 99, 0, 0], [20, 21, 22, 23, 77], [5, 0, 0, 0, 0]], jnp.int32)
    acc, num, bonus = _accept(tree, target)
    np.testing.assert_array_equal(np.asarray(num), [3, 5, 1])
    np.testing.assert_array_equal(np.asarray(bonus), [99, 77, 5])
    np.testing.assert_array_equal(np.asarray(acc),
                                  [[0, 1, 2, -1, -1], [0, 1, 2, 3, 4], [0, -1, -1, -1, -1]])
    new = _accepted_tokens(tree, acc, num, bonus)
    np.testing.assert_array_equal(np.asarray(new),
                                  [[10, 11, 99, -1, -1], [20, 21, 22, 23, 77], [5, -1, -1, -1, -1]])


# ----------------------------------------------------------------------------- config


def test_spec_config():
    c = SpecConfig()
    assert (c.method, c.num_steps, c.topk, c.num_draft_tokens) == ("eagle", 5, 1, 5)
    assert c.num_nodes == 6 and c.is_chain
    c = SpecConfig(num_steps=3, topk=4)
    assert c.num_draft_tokens == 12 and c.max_candidates == 4 + 2 * 16 and not c.is_chain
    assert SpecConfig(num_steps=5, topk=8, num_draft_tokens=64).num_nodes == 65
    assert SpecConfig(num_steps=1, topk=4, num_draft_tokens=4).num_draft_tokens == 4
    assert SpecConfig(num_steps=1, topk=4).num_draft_tokens == 4
    for kw, msg in [({"method": "medusa"}, "method"), ({"num_steps": 0}, "num_steps"),
                    ({"topk": 0}, "topk"), ({"num_draft_tokens": 0}, "num_draft_tokens"),
                    ({"num_steps": 3, "num_draft_tokens": 4}, "chain"),
                    ({"num_steps": 2, "topk": 2, "num_draft_tokens": 7}, "exceeds"),
                    ({"num_steps": 2.0}, "num_steps")]:
        with pytest.raises(ValueError, match=msg):
            SpecConfig(**kw)
    with pytest.raises(ValueError):
        _select(jnp.zeros((B,), jnp.int32), [jnp.zeros((B, 2), jnp.int32)], [jnp.zeros((B, 2))],
                [jnp.zeros((B, 2), jnp.int32)], 3)
