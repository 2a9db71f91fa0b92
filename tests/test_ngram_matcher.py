"""The on-device n-gram matcher (specjax.ngram) against a plain Python implementation on random
token histories: the candidate positions, their continuations, the trie tree built from them,
the history bookkeeping (prompt write, append) and SpecConfig's n-gram fields."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import ngram
from specjax.tree import SpecConfig, greedy_accept

W = 40
_trie = jax.jit(ngram.trie_tree, static_argnums=2)
_propose = jax.jit(ngram.propose, static_argnums=3)


def ref_candidates(h: list[int], nmax: int, nmin: int, k: int) -> list[int]:
    """Positions p in [1, H - 1] whose n tokens before equal the last n (n from nmax down to nmin),
    by (longest n, most recent p); missing ones are H - 1."""
    H = len(h)
    found: list[int] = []
    for n in range(nmax, nmin - 1, -1):
        if n > H:
            continue
        suffix = h[H - n:]
        for p in range(H - 1, n - 1, -1):
            if h[p - n:p] == suffix and p not in found:
                found.append(p)
    found = found[:k]
    return found + [H - 1] * (k - len(found))


def ref_continuation(h: list[int], p: int, S: int) -> list[int]:
    d = len(h) - p
    return [h[p + i % d] for i in range(S)]


def _histories(rng, B, vocab):
    H = rng.integers(1, W + 1, size=B)
    hist = rng.integers(0, vocab, size=(B, W)).astype(np.int32)  # entries >= H are stale garbage
    return hist, H.astype(np.int32)


@pytest.mark.parametrize("nmax,nmin,k,S,vocab", [(4, 1, 1, 5, 3), (3, 2, 4, 3, 2), (4, 1, 6, 4, 4), (1, 1, 3, 6, 5),
                                                 (5, 3, 2, 2, 2)])
def test_candidates_and_continuations_match_python(nmax, nmin, k, S, vocab):
    rng = np.random.default_rng(nmax * 100 + k * 10 + vocab)
    hist, H = _histories(rng, 64, vocab)
    spec = SpecConfig(method="ngram", num_steps=S, topk=k, ngram_max=nmax, ngram_min=nmin)
    pos = np.asarray(jax.jit(ngram.candidates, static_argnums=2)(jnp.asarray(hist), jnp.asarray(H), spec))
    cont = np.asarray(jax.jit(ngram.continuations, static_argnums=3)(jnp.asarray(hist), jnp.asarray(H),
                                                                      jnp.asarray(pos), S))
    hits = 0
    for b in range(len(H)):
        h = hist[b, : H[b]].tolist()
        want = ref_candidates(h, nmax, nmin, k)
        assert pos[b].tolist() == want, (b, h)
        assert cont[b].tolist() == [ref_continuation(h, p, S) for p in want]
        hits += want[0] != len(h) - 1
    assert hits > 10  # the random histories do exercise real matches


def test_match_lengths_at_every_position():
    rng = np.random.default_rng(3)
    hist, H = _histories(rng, 32, 2)
    m = np.asarray(jax.jit(ngram.match_lengths, static_argnums=2)(jnp.asarray(hist), jnp.asarray(H), 4))
    for b in range(len(H)):
        h = hist[b, : H[b]].tolist()
        for p in range(W):
            want = 0
            if 1 <= p <= len(h) - 1:
                while want < 4 and want < p and h[p - want - 1] == h[len(h) - want - 1]:
                    want += 1
            assert m[b, p] == want, (b, p)


def _paths(tokens, parents):
    """Token path (below the root) of every node of one tree."""
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("k,S", [(4, 3), (2, 6)])
def test_trie_tree(k, S):
    """The trie holds exactly the prefixes of the continuations (M = k * S: duplicates fill the
    rest), is a valid tree, and greedy acceptance along it = the longest common prefix with the
    best-matching continuation; with fewer nodes it keeps the first ones in (rank, depth) order."""
    rng = np.random.default_rng(k * S)
    B = 48
    cont = rng.integers(0, 3, size=(B, k, S)).astype(np.int32)
    cont[:, 1, : S // 2] = cont[:, 0, : S // 2]  # shared prefixes
    root = rng.integers(0, 3, size=B).astype(np.int32)
    tree = _trie(jnp.asarray(root), jnp.asarray(cont), k * S)
    toks, par, dep = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.depth))
    truth = rng.integers(0, 3, size=(B, S)).astype(np.int32)
    truth[: B // 2] = cont[: B // 2, rng.integers(0, k)]  # half the rows: one continuation is right
    # a target that wants truth[depth] after every node
    argmax = np.take_along_axis(truth, np.minimum(dep, S - 1), axis=1)
    _, num, _ = jax.jit(greedy_accept)(tree, jnp.asarray(argmax))
    num = np.asarray(num)
    for b in range(B):
        assert toks[b, 0] == root[b] and par[b, 0] == -1
        assert all(par[b, i] < i and dep[b, i] == dep[b, par[b, i]] + 1 for i in range(1, k * S + 1))
        prefixes = {tuple(cont[b, j, : s + 1]) for j in range(k) for s in range(S)}
        paths = _paths(toks[b], par[b])
        assert set(paths[1:]) == prefixes
        lcp = max(next((i for i in range(S) if cont[b, j, i] != truth[b, i]), S) for j in range(k))
        assert num[b] - 1 == lcp
    M = S + k - 1
    small = _trie(jnp.asarray(root), jnp.asarray(cont), M)
    for b in range(B):
        order = list(dict.fromkeys(tuple(cont[b, j, : s + 1]) for j in range(k) for s in range(S)))
        got = _paths(np.asarray(small.tokens[b]), np.asarray(small.parents[b]))[1:]
        assert set(got) == set(order[:M])


def test_history_write_and_append():
    hist = ngram.init_history(3, 8)
    toks = jnp.asarray([[5, 6, 7, 0], [9, 0, 0, 0]], jnp.int32)
    hist = ngram.write_prompt(hist, jnp.asarray([2, 3]), toks, jnp.asarray([3, 1]), jnp.asarray([1, 2]))
    assert np.asarray(hist).tolist() == [[0] * 8, [0] * 8, [5, 6, 7, 1, 0, 0, 0, 0]]  # slot 3: dropped
    # append at L + 1 (L = 3: x_0..x_3 held), 2 of 3 tokens; a row past the width is clipped
    hist = ngram.append(hist, jnp.asarray([2, 0]), jnp.asarray([3, 6]), jnp.asarray([[4, 8, -1], [1, 2, 3]]),
                        jnp.asarray([2, 3]))
    assert np.asarray(hist).tolist() == [[0] * 7 + [1], [0] * 8, [5, 6, 7, 1, 4, 8, 0, 0]]


def test_propose_without_a_match_repeats_the_last_token():
    hist = jnp.asarray([[1, 2, 3, 4, 9, 9]], jnp.int32)
    spec = SpecConfig(method="ngram", num_steps=3, ngram_min=1)
    tree = _propose(hist, jnp.asarray([4]), jnp.asarray([4]), spec)
    assert np.asarray(tree.tokens).tolist() == [[4, 4, 4, 4]]
    # H past the width (a step run ahead at the end of the context) stays in bounds
    tree = _propose(hist, jnp.asarray([9]), jnp.asarray([9]), spec)
    assert np.asarray(tree.tokens).tolist() == [[9, 9, 9, 9]]


def test_spec_config_ngram_fields():
    c = SpecConfig(method="ngram", num_steps=4, topk=3)
    assert (c.num_draft_tokens, c.max_candidates, c.ngram_max, c.ngram_min) == (12, 12, 4, 1)
    with pytest.raises(ValueError, match="ngram_min=3 exceeds ngram_max=2"):
        SpecConfig(method="ngram", ngram_max=2, ngram_min=3)
    with pytest.raises(ValueError, match="ngram_max must be an int >= 1"):
        SpecConfig(method="ngram", ngram_max=0)
    with pytest.raises(ValueError, match=r"exceeds the 12 candidates .*num_steps\*topk"):
        SpecConfig(method="ngram", num_steps=4, topk=3, num_draft_tokens=13)
