"""specjax.verify: greedy equivalence with tree.greedy_accept, and losslessness of speculative
sampling checked by chi-square tests against exact laws computed by brute force."""
from __future__ import annotations

import itertools
import math
import zlib
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import SamplingArrays
from specjax.tree import Tree, accepted_tokens, chain_tree, greedy_accept, select_tree
from specjax.verify import filtered_probs, verify_tree

_verify = jax.jit(verify_tree, static_argnames="stochastic")
_greedy = jax.jit(greedy_accept)
_accepted = jax.jit(accepted_tokens)
_filtered = jax.jit(filtered_probs)
_select = jax.jit(select_tree, static_argnums=4)

NUM = 20000  # samples per chi-square test (one jitted call, one row each)
P_MIN = 1e-3  # chi-square p-value threshold


# ----------------------------------------------------------------------------- helpers


def samp_arrays(temperature, top_p, top_k, seed):
    b = len(seed)
    full = lambda x, dt: jnp.asarray(np.broadcast_to(np.asarray(x), (b,)), dt)
    return SamplingArrays(full(temperature, jnp.float32), full(top_p, jnp.float32),
                          full(top_k, jnp.int32), full(seed, jnp.uint32))


def make_tree(tokens, parents, max_depth):
    """A Tree from numpy tokens/parents [B, N] (depth and ancestor mask computed here)."""
    tokens, parents = np.asarray(tokens, np.int32), np.asarray(parents, np.int32)
    b, n = tokens.shape
    depth = np.zeros((b, n), np.int32)
    mask = np.zeros((b, n, n), bool)
    for i in range(n):
        mask[:, i, i] = True
        if i:
            depth[:, i] = depth[np.arange(b), parents[:, i]] + 1
            mask[:, i] |= mask[np.arange(b), parents[:, i]]
    return Tree(tokens=jnp.asarray(tokens), parents=jnp.asarray(parents), depth=jnp.asarray(depth),
                mask=jnp.asarray(mask), max_depth=max_depth)


def brute_probs(logits, temperature, top_p, top_k):
    """The target's sampling distribution [V] in float64: temperature, then the top_k best
    tokens, then the smallest prefix (descending) whose renormalised mass reaches top_p."""
    z = np.asarray(logits, np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k > 0:
        order = order[:top_k]
    e = np.exp(z[order] - z[order].max())
    pk = e / e.sum()
    if top_p < 1.0:
        cum = np.cumsum(pk)
        assert np.min(np.abs(cum - top_p)) > 1e-4, "top_p boundary too close to call"
        order = order[: int(np.searchsorted(cum, top_p)) + 1]
    out = np.zeros(len(z))
    e = np.exp(z[order] - z[order].max())
    out[order] = e / e.sum()
    return out


def sequences(tree, out):
    """Emitted token sequences (accepted draft tokens + bonus), one tuple per row."""
    acc, num, bonus = out
    toks = np.asarray(_accepted(tree, acc, num, bonus))
    return [tuple(int(t) for t in row[:k]) for row, k in zip(toks, np.asarray(num))]


def chi2_sf(stat, dof):
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:  # Wilson-Hilferty: (X/k)^(1/3) ~ Normal(1 - 2/(9k), 2/(9k))
        s = 2.0 / (9.0 * dof)
        z = ((stat / dof) ** (1.0 / 3.0) - (1.0 - s)) / math.sqrt(s)
        return 0.5 * math.erfc(z / math.sqrt(2.0))


def pearson(observed, expected):
    """Pearson statistic and dof over matched cells; cells expecting < 5 are pooled (and the
    pool joins the smallest remaining cell if it is still under 5)."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if (~big).any():
        o, e = observed[~big].sum(), expected[~big].sum()
        if e >= 5 or not exp:
            obs.append(o)
            exp.append(e)
        else:
            j = int(np.argmin(exp))
            obs[j] += o
            exp[j] += e
    obs, exp = np.array(obs), np.array(exp)
    return float(np.sum((obs - exp) ** 2 / exp)), len(exp) - 1


def law_test(seqs, law):
    """(p-value, sequences seen that the law says are impossible)."""
    counts = Counter(seqs)
    outside = {s: c for s, c in counts.items() if law.get(s, 0.0) <= 0.0}
    cells = sorted(law)
    stat, dof = pearson([counts[s] for s in cells], [law[s] * len(seqs) for s in cells])
    assert dof >= 5, "law too concentrated for a meaningful test"
    return chi2_sf(stat, dof), outside


def tree_law(tokens, parents, probs):
    """Exact law of the emitted sequence for a fixed tree (point-mass proposals): from a node,
    t ~ probs[node]; t continues into the lowest-index child carrying t, else it is the bonus."""
    law = Counter()

    def walk(x, prefix, w):
        kids = {}
        for c in range(len(tokens)):
            if parents[c] == x:
                kids.setdefault(int(tokens[c]), c)
        for t, pt in enumerate(probs[x]):
            if pt > 0:
                if t in kids:
                    walk(kids[t], prefix + (t,), w * pt)
                else:
                    law[prefix + (t,)] += w * pt

    walk(0, (), 1.0)
    assert abs(sum(law.values()) - 1) < 1e-9
    return dict(law)


def chain_law(p_of, q_of, depth):
    """Exact law of a chain of sampled drafts (q_of(prefix) the draft's law, p_of(prefix) the
    target's): t is emitted and continued with probability min(p, q)(t), emitted as the bonus
    with probability max(p - q, 0)(t); after the last draft the bonus is ~ p."""
    law = Counter()

    def walk(prefix, w):
        p = p_of(prefix)
        q = q_of(prefix) if len(prefix) < depth else np.zeros_like(p)
        for t in range(len(p)):
            stop, cont = max(p[t] - q[t], 0.0), min(p[t], q[t])
            if stop > 0:
                law[prefix + (t,)] += w * stop
            if cont > 0:
                walk(prefix + (t,), w * cont)

    walk((), 1.0)
    assert abs(sum(law.values()) - 1) < 1e-6
    return dict(law)


def conditional_test(seqs, p_of):
    """Losslessness as a martingale check: after every emitted prefix s, the next emitted token is
    distributed as p_of(s). Returns (p-value, impossible (prefix, token) pairs)."""
    nxt = {}
    for s in seqs:
        for k in range(len(s)):
            nxt.setdefault(s[:k], Counter())[s[k]] += 1
    stat, dof, outside = 0.0, 0, {}
    for prefix, cnt in nxt.items():
        p = p_of(prefix)
        outside.update({(prefix, t): c for t, c in cnt.items() if p[t] <= 0})
        total = sum(cnt.values())
        if total < 20:
            continue
        support = [t for t in range(len(p)) if p[t] > 0]
        st, df = pearson([cnt[t] for t in support], [p[t] * total for t in support])
        stat, dof = stat + st, dof + df
    assert dof >= 5
    return chi2_sf(stat, dof), outside


def node_logits(seed, key, v, scale=1.5):
    rng = np.random.default_rng(zlib.crc32(repr((seed, key)).encode()))
    return (rng.normal(size=v) * scale).astype(np.float32)


def random_select_tree(rng, b, topk, steps, m, v):
    st_tok, st_score, st_par = [], [], []
    for s in range(steps):
        c = topk if s == 0 else topk * topk
        st_tok.append(jnp.asarray(rng.integers(0, v, (b, c)), jnp.int32))
        st_score.append(jnp.asarray(-np.sort(rng.random((b, c)), axis=1) - s, jnp.float32))
        prev = topk if s <= 1 else topk * topk
        st_par.append(jnp.asarray(rng.integers(0, prev, (b, c)) if s else -np.ones((b, c)), jnp.int32))
    return _select(jnp.asarray(rng.integers(0, v, b), jnp.int32), st_tok, st_score, st_par, m)


def greedy_logits(rng, tree, v, p_follow=0.7):
    """Random logits [B, N, V] whose argmax often is one of the node's children's tokens."""
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    b, n = tokens.shape
    logits = rng.normal(size=(b, n, v)).astype(np.float32)
    for r in range(b):
        for i in range(n):
            kids = [int(tokens[r, c]) for c in range(n) if parents[r, c] == i]
            if kids and rng.random() < p_follow:
                logits[r, i, rng.choice(kids)] = logits[r, i].max() + 1.0
    return logits


def assert_same(a, b):
    for x, y in zip(a, b):
        assert np.asarray(x).dtype == np.asarray(y).dtype == np.int32
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- filtered probs


def test_filtered_probs_matches_brute_force():
    rng = np.random.default_rng(0)
    b, v = 48, 12
    logits = rng.normal(0, 2.0, (b, v)).astype(np.float32)
    temp = rng.choice([0.0, 0.5, 1.0, 1.6], b)
    top_p = rng.choice([1.0, 0.93, 0.6, 0.2], b)
    top_k = rng.choice([0, 1, 3, 12], b)
    got = np.asarray(_filtered(jnp.asarray(logits), samp_arrays(temp, top_p, top_k, np.zeros(b))))
    assert got.dtype == np.float32 and got.shape == (b, v)
    for r in range(b):
        if temp[r] == 0:
            np.testing.assert_array_equal(got[r], np.eye(v)[np.argmax(logits[r])])
            continue
        try:
            want = brute_probs(logits[r], temp[r], top_p[r], top_k[r])
        except AssertionError:
            continue  # top_p boundary ambiguity
        np.testing.assert_allclose(got[r], want, atol=2e-6)


def test_filtered_probs_unfiltered_equals_filtered_without_filters():
    """unfiltered=True (no sort) gives the distribution of the sorting path for rows with top_p 1 and
    top_k 0, greedy rows included."""
    rng = np.random.default_rng(1)
    b, v = 16, 50
    logits = jnp.asarray(rng.normal(0, 3.0, (b, v)).astype(np.float32))
    samp = samp_arrays(rng.choice([0.0, 0.3, 1.0, 2.0], b), np.ones(b), np.zeros(b, np.int32), np.zeros(b))
    want = np.asarray(_filtered(logits, samp))
    got = np.asarray(jax.jit(filtered_probs, static_argnums=2)(logits, samp, True))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(got - np.asarray(_filtered(logits, samp_arrays(np.ones(b), np.full(b, 0.5), np.zeros(b, np.int32),
                                                                   np.zeros(b))))).max() > 0.01  # filters change it


# ----------------------------------------------------------------------------- greedy


TREE_CASES = [("chain", 1, 4, 4), ("tree", 2, 3, 6), ("tree", 4, 2, 12)]


@pytest.mark.parametrize("kind,topk,steps,m", TREE_CASES)
def test_greedy_equals_greedy_accept(kind, topk, steps, m):
    rng = np.random.default_rng(topk * 10 + steps)
    b, v = 8, 11
    if kind == "chain":
        tree = chain_tree(jnp.asarray(rng.integers(0, v, b), jnp.int32),
                          jnp.asarray(rng.integers(0, v, (b, steps)), jnp.int32))
    else:
        tree = random_select_tree(rng, b, topk, steps, m, v)
    n = tree.num_nodes
    for trial in range(3):
        logits = greedy_logits(rng, tree, v)
        want = _greedy(tree, jnp.asarray(np.argmax(logits, -1), jnp.int32))
        pos = jnp.asarray(rng.integers(0, 1000, b), jnp.int32)
        seeds = rng.integers(0, 2**32, b)
        assert_same(_verify(tree, logits, samp_arrays(1.0, 1.0, 0, seeds), pos, stochastic=False), want)
        assert np.asarray(want[1]).max() > 1  # something is accepted
        # greedy rows (temperature 0) take the greedy result; in the sampled rows a one-token
        # nucleus (top_k = 1 or a tiny top_p) makes the sampling walk itself greedy
        even, top1 = np.arange(b) % 2 == 0, np.arange(b) % 4 == 1
        samp = samp_arrays(np.where(even, 0.0, rng.choice([0.6, 1.0, 1.7], b)),
                           np.where(even | top1, 1.0, 1e-6),
                           np.where(even, rng.choice([0, 2], b), np.where(top1, 1, 0)), seeds)
        assert_same(_verify(tree, logits, samp, pos), want)
        q = np.exp(rng.normal(size=(b, n, v)))
        q = jnp.asarray(q / q.sum(-1, keepdims=True), jnp.float32)
        assert_same(_verify(tree, logits, samp, pos, draft_probs=q), want)


def check_walk(tree, logits, samp, out):
    """Structure of every row's result, and for sampled rows with point-mass proposals: the bonus
    has target probability > 0 and is no child's token of the last accepted node."""
    acc, num, bonus = (np.asarray(x) for x in out)
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    probs = np.asarray(_filtered(logits[np.arange(len(num)), acc[np.arange(len(num)), num - 1]], samp))
    b, n = tokens.shape
    assert acc.shape == (b, tree.max_depth + 1)
    for r in range(b):
        k = num[r]
        assert 1 <= k <= tree.max_depth + 1 and acc[r, 0] == 0 and (acc[r, k:] == -1).all()
        assert all(parents[r, acc[r, j]] == acc[r, j - 1] for j in range(1, k))
        last = acc[r, k - 1]
        assert probs[r, bonus[r]] > 0
        if np.asarray(samp.temperature)[r] > 0:
            assert bonus[r] not in {int(tokens[r, c]) for c in range(n) if parents[r, c] == last}


def test_mixed_batch_and_determinism():
    rng = np.random.default_rng(5)
    b, v = 32, 9
    tree = random_select_tree(rng, b, 3, 3, 8, v)
    logits = jnp.asarray(greedy_logits(rng, tree, v, p_follow=0.5) * 0.7)
    temp = np.where(np.arange(b) % 2 == 0, 0.0, rng.choice([0.5, 1.0, 1.5], b))
    samp = samp_arrays(temp, rng.choice([1.0, 0.9], b), rng.choice([0, 4], b), rng.integers(0, 99, b))
    pos = jnp.asarray(rng.integers(0, 500, b), jnp.int32)
    out = _verify(tree, logits, samp, pos)
    want = [np.asarray(x) for x in _greedy(tree, jnp.asarray(np.argmax(logits, -1), jnp.int32))]
    for x, y in zip(out, want):
        np.testing.assert_array_equal(np.asarray(x)[::2], y[::2])
    check_walk(tree, logits, samp, out)
    assert (np.asarray(out[1])[1::2] > 1).any()

    # the same (seed, root_pos) gives the same result at another place in the batch
    perm = rng.permutation(b)
    take = lambda x: jax.tree.map(lambda a: a[perm], x)
    out2 = _verify(take(tree), logits[perm], take(samp), pos[perm])
    for x, y in zip(out, out2):
        np.testing.assert_array_equal(np.asarray(x)[perm], np.asarray(y))
    # ... and another root position changes the sampled rows' randomness
    many = _verify(tree, logits, samp, pos + 1)
    assert any((np.asarray(x)[1::2] != np.asarray(y)[1::2]).any() for x, y in zip(out, many))


# ----------------------------------------------------------------------------- lossless


def run_fixed_tree(tokens, parents, max_depth, logits, temperature, top_p, top_k):
    """NUM rows of one fixed tree and per-node logits [N, V] -> emitted sequences and exact law."""
    n, v = logits.shape
    tree = make_tree(np.tile(tokens, (NUM, 1)), np.tile(parents, (NUM, 1)), max_depth)
    samp = samp_arrays(temperature, top_p, top_k, np.arange(NUM) % 4000)
    pos = jnp.asarray(np.arange(NUM) // 4000 * 37 + 3, jnp.int32)
    out = _verify(tree, jnp.broadcast_to(jnp.asarray(logits), (NUM, n, v)), samp, pos)
    probs = np.stack([brute_probs(l, temperature, top_p, top_k) for l in logits])
    return sequences(tree, out), tree_law(tokens, parents, probs), probs


def ranked_tokens(logits, spec):
    """Node tokens from (parent, rank) pairs: the rank-th most likely token after the parent."""
    return np.array([0] + [int(np.argsort(-logits[par])[rank]) for par, rank in spec], np.int32)


POINT_TREE = [(0, 2), (0, 0), (0, 4), (1, 0), (1, 1), (2, 1), (4, 0)]  # (parent, rank); depth 3


def point_tree_case(seed=3, v=6):
    logits = np.stack([node_logits(seed, i, v) for i in range(len(POINT_TREE) + 1)])
    tokens = ranked_tokens(logits, POINT_TREE)
    parents = np.array([-1] + [p for p, _ in POINT_TREE], np.int32)
    return tokens, parents, logits


def test_lossless_point_mass_tree():
    tokens, parents, logits = point_tree_case()
    seqs, law, _ = run_fixed_tree(tokens, parents, 3, logits, 0.7, 0.9, 0)
    assert max(len(s) for s in law) == 4 and Counter(map(len, seqs))[4] > 100  # full depth reached
    pval, outside = law_test(seqs, law)
    assert not outside, outside
    assert pval > P_MIN, pval


def test_lossless_rejected_and_duplicate_children():
    """top_k = 2: children whose token has p = 0 (never accepted) and a duplicate sibling token
    (the second copy can never be accepted: the first one's rejection removed the token)."""
    v = 5
    spec = [(0, 3), (0, 0), (0, 0), (0, 1), (2, 4), (2, 1), (3, 0), (4, 0), (6, 0)]
    logits = np.stack([node_logits(11, i, v, 1.0) for i in range(len(spec) + 1)])
    tokens = ranked_tokens(logits, spec)
    parents = np.array([-1] + [p for p, _ in spec], np.int32)
    seqs, law, probs = run_fixed_tree(tokens, parents, 3, logits, 1.0, 1.0, 2)
    assert probs[0, tokens[1]] == 0 and probs[2, tokens[5]] == 0 and tokens[2] == tokens[3]
    assert Counter(map(len, seqs))[4] > 100  # the path through nodes 2, 6 and 9 is taken
    pval, outside = law_test(seqs, law)
    assert not outside, outside
    assert pval > P_MIN, pval


def code(prefix, v):
    """Index of a token prefix in the dense tables below (0 = the empty prefix)."""
    c = 0
    for t in prefix:
        c = c * (v + 1) + t + 1
    return c


def draft_tables(v, depth, temperature, top_k, seed):
    """Target logits, target law and draft law after every prefix of length <= depth, as dense
    arrays [(v + 1)**depth, V] indexed by code(prefix). The draft is the target plus noise,
    filtered the same way."""
    size = (v + 1) ** depth
    logits = np.zeros((size, v), np.float32)
    p = np.zeros((size, v))
    q = np.zeros((size, v), np.float32)
    for k in range(depth + 1):
        for pre in itertools.product(range(v), repeat=k):
            i = code(pre, v)
            logits[i] = node_logits(seed, pre, v)
            p[i] = brute_probs(logits[i], temperature, 1.0, top_k)
            q[i] = brute_probs(logits[i] + node_logits(seed + 1, pre, v, 1.0), temperature, 1.0, top_k)
    return logits, p, q


def run_sampled_drafts(parents, depth, v, temperature, top_k, seed, stochastic=True):
    """NUM rows of a tree whose node c is drawn from the draft law after its parent's prefix
    (jax.random.categorical); verified with draft_probs. -> (sequences, p_of(prefix), q_of(prefix))."""
    l_tab, p_tab, q_tab = draft_tables(v, depth, temperature, top_k, seed)
    n = len(parents)
    keys = jax.random.split(jax.random.key(seed + 100), n)
    codes = np.zeros((NUM, n), np.int64)  # code of each node's prefix (root: empty)
    tokens = np.zeros((NUM, n), np.int32)
    for c in range(1, n):
        q = q_tab[codes[:, parents[c]]]  # [NUM, V]
        tokens[:, c] = np.asarray(jax.random.categorical(keys[c], jnp.log(jnp.asarray(q))))
        codes[:, c] = codes[:, parents[c]] * (v + 1) + tokens[:, c] + 1
    draft_probs = q_tab[codes[:, np.maximum(parents, 0)]]  # [NUM, N, V]; node 0's row is unused
    tree = make_tree(tokens, np.tile(parents, (NUM, 1)), depth)
    samp = samp_arrays(temperature, 1.0, top_k, np.arange(NUM))
    out = _verify(tree, jnp.asarray(l_tab[codes]), samp, jnp.full((NUM,), 12, jnp.int32),
                  draft_probs=jnp.asarray(draft_probs), stochastic=stochastic)
    return sequences(tree, out), lambda pre: p_tab[code(pre, v)], lambda pre: q_tab[code(pre, v)]


def test_lossless_sampled_chain():
    depth, v = 3, 6
    seqs, p_of, q_of = run_sampled_drafts(np.arange(-1, depth, dtype=np.int32), depth, v, 1.0, 3, 21)
    law = chain_law(p_of, q_of, depth)
    assert Counter(map(len, seqs))[depth + 1] > 100
    pval, outside = law_test(seqs, law)
    assert not outside, outside
    assert pval > P_MIN, pval
    pval, outside = conditional_test(seqs, p_of)
    assert not outside and pval > P_MIN, (pval, outside)


def test_lossless_sampled_chain_unfiltered_program():
    """The UNFILTERED program (rows without top-k / top-p: softmax without the sort) keeps the law."""
    from specjax.sampling import UNFILTERED
    depth, v = 3, 6
    seqs, p_of, q_of = run_sampled_drafts(np.arange(-1, depth, dtype=np.int32), depth, v, 0.8, 0, 22,
                                          stochastic=UNFILTERED)
    law = chain_law(p_of, q_of, depth)
    pval, outside = law_test(seqs, law)
    assert not outside, outside
    assert pval > P_MIN, pval


def test_lossless_sampled_siblings():
    """Siblings drawn independently from the same draft law (multi-draft rejection sampling):
    after every emitted prefix the next token follows the target."""
    parents = np.array([-1, 0, 0, 0, 1, 1, 2, 2], np.int32)
    seqs, p_of, _ = run_sampled_drafts(parents, 2, 5, 0.8, 0, 33)
    assert Counter(map(len, seqs))[3] > 100
    pval, outside = conditional_test(seqs, p_of)
    assert not outside, outside
    assert pval > P_MIN, pval


# ----------------------------------------------------------------------------- power


def wrong_walk(tokens, parents, probs, rng):
    """A deliberately wrong verifier: child c is accepted with probability p(tok_c) of the
    *unrenormalised* target law (no residual update between siblings); the bonus comes from the
    correct residual (the children are tried again when it is empty), so every output stays
    inside the law's support."""
    x, seq = 0, []
    while True:
        kids = [c for c in range(len(tokens)) if parents[c] == x]
        for c in kids:
            if rng.random() < probs[x, tokens[c]]:
                break
        else:
            res = probs[x].copy()
            res[[tokens[c] for c in kids]] = 0
            if res.sum() == 0:
                continue
            seq.append(int(rng.choice(len(res), p=res / res.sum())))
            return tuple(seq)
        seq.append(int(tokens[c]))
        x = c


def test_chi_square_has_power():
    tokens, parents, logits = point_tree_case()
    probs = np.stack([brute_probs(l, 0.7, 0.9, 0) for l in logits])
    law = tree_law(tokens, parents, probs)
    rng = np.random.default_rng(0)
    seqs = [wrong_walk(tokens, parents, probs, rng) for _ in range(NUM)]
    pval, outside = law_test(seqs, law)
    assert not outside  # rejected by the statistic, not by the support
    assert pval < P_MIN, pval
