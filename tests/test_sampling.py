"""specjax.sampling against brute-force numpy references and a chi-square goodness-of-fit test."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import UNFILTERED, SamplingArrays, filter_in_place, filtered_logits, sample, token_logprobs
from specjax.sampling_params import MAX_LOGPROBS

# Chi-square critical values for p = 0.001 by degrees of freedom (standard table, e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.4 "Critical Values of the
# Chi-Square Distribution", upper-tail 0.001 column).
CHI2_CRIT_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def brute_kept(logits, temperature, top_p, top_k):
    """{token: filtered logit} a sampler keeps: descending order; top_k (0 = off) first; then the
    smallest prefix of the renormalized distribution whose mass reaches top_p. float64."""
    t = temperature if temperature > 0 else 1.0
    z = np.asarray(logits, np.float64) / t
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k > 0:
        order = order[:top_k]
    p = softmax(z[order])
    if top_p >= 1.0:  # top_p = 1 is "off": every token survives, however small its probability
        return {tok: z[tok] for tok in order}, p
    kept, mass = [], 0.0
    for tok, pi in zip(order, p):
        kept.append(tok)
        mass += pi
        if mass >= top_p:
            break
    return {tok: z[tok] for tok in kept}, p


def kept_from(vals, order):
    vals, order = np.asarray(vals), np.asarray(order)
    return {int(o): float(v) for v, o in zip(vals, order) if np.isfinite(v)}


def test_filtered_logits_matches_brute_force():
    rng = np.random.default_rng(0)
    B, V = 64, 50
    logits = rng.normal(0, 3.0, (B, V)).astype(np.float32)
    temperature = rng.choice([0.0, 0.5, 1.0, 1.7], B).astype(np.float32)
    top_p = rng.choice([0.999, 0.95, 0.7, 0.3, 0.05], B).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 10, 49, 50], B).astype(np.int32)
    vals, order = filtered_logits(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_p),
                                  jnp.asarray(top_k))
    vals, order = np.asarray(vals), np.asarray(order)
    checked = 0
    for b in range(B):
        want, p = brute_kept(logits[b], float(temperature[b]), float(top_p[b]), int(top_k[b]))
        cum = np.cumsum(p)
        if np.min(np.abs(cum - top_p[b])) < 1e-5 and top_p[b] < 1.0:
            continue  # a prefix mass equals top_p up to rounding: either answer is right
        got = kept_from(vals[b], order[b])
        assert set(got) == set(want), (b, temperature[b], top_p[b], top_k[b])
        for tok, z in want.items():
            assert abs(got[tok] - z) < 1e-5 * max(1.0, abs(z))
        # sorted descending, and the ids are a permutation of the vocabulary
        assert sorted(order[b].tolist()) == list(range(V))
        finite = vals[b][np.isfinite(vals[b])]
        assert np.all(np.diff(finite) <= 0) and np.isfinite(vals[b][: len(finite)]).all()
        checked += 1
    assert checked > B * 0.9


def test_top_p_one_keeps_every_token():
    """top_p = 1.0 means no nucleus filtering: every token must stay sampleable."""
    rng = np.random.default_rng(4)
    B, V = 4, 4096
    logits = rng.normal(0, 5.0, (B, V)).astype(np.float32)
    vals, _ = filtered_logits(jnp.asarray(logits), jnp.ones(B), jnp.ones(B), jnp.zeros(B, jnp.int32))
    dropped = (~np.isfinite(np.asarray(vals))).sum(-1)
    assert dropped.tolist() == [0] * B, f"tokens dropped per row at top_p=1: {dropped.tolist()}"


@pytest.mark.parametrize("k", [1, 2, 7, 16])
def test_top_k_keeps_exactly_k_best(k):
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(8, 16)).astype(np.float32)
    B = logits.shape[0]
    vals, order = filtered_logits(jnp.asarray(logits), jnp.ones(B), jnp.ones(B), jnp.full(B, k, jnp.int32))
    for b in range(B):
        got = kept_from(vals[b], order[b])
        assert set(got) == set(np.argsort(-logits[b])[:k].tolist())


def test_top_p_smallest_prefix_reaching_p():
    # sorted probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 -> prefix masses 0.5, 0.75, 0.875, 0.9375, 1
    probs = np.array([0.0625, 0.5, 0.125, 0.0625, 0.25])
    logits = np.log(probs).astype(np.float32)
    cases = {1e-6: {1}, 0.4: {1}, 0.51: {1, 4}, 0.74: {1, 4}, 0.76: {1, 4, 2}, 0.87: {1, 4, 2},
             0.9: "tie", 0.95: {0, 1, 2, 3, 4}, 1.0: {0, 1, 2, 3, 4}}
    for p, want in cases.items():
        vals, order = filtered_logits(jnp.asarray(logits[None]), jnp.ones(1), jnp.asarray([p], jnp.float32),
                                      jnp.zeros(1, jnp.int32))
        got = set(kept_from(vals[0], order[0]))
        if want == "tie":  # 0.875 < 0.9 <= 0.9375: one of the two 0.0625 tokens joins (either is right)
            assert len(got) == 4 and {1, 4, 2} < got, got
        else:
            assert got == want, (p, got)


def _arrays(temperature, top_p, top_k, seed):
    B = len(temperature)
    return SamplingArrays(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                          jnp.asarray(top_k, jnp.int32), jnp.asarray(seed, jnp.uint32).reshape(B))


def test_temperature_zero_rows_are_argmax():
    rng = np.random.default_rng(1)
    B, V = 32, 40
    logits = rng.normal(0, 2.0, (B, V)).astype(np.float32)
    temperature = np.where(np.arange(B) % 2 == 0, 0.0, 1.0)  # mixed batch: stochastic branch runs
    samp = _arrays(temperature, np.full(B, 0.5), np.full(B, 5), np.arange(B))
    got = np.asarray(sample(jnp.asarray(logits), samp, jnp.arange(B, dtype=jnp.int32)))
    np.testing.assert_array_equal(got[::2], np.argmax(logits[::2], -1))
    assert got.dtype == np.int32
    # all-greedy batch too
    samp = _arrays(np.zeros(B), np.full(B, 0.5), np.full(B, 5), np.arange(B))
    got = np.asarray(sample(jnp.asarray(logits), samp, jnp.arange(B, dtype=jnp.int32)))
    np.testing.assert_array_equal(got, np.argmax(logits, -1))
    # top_k=1 or a tiny top_p are argmax as well, whatever the temperature
    samp = _arrays(np.full(B, 2.0), np.where(np.arange(B) % 2, 1e-6, 1.0), np.where(np.arange(B) % 2, 0, 1),
                   np.arange(B))
    got = np.asarray(sample(jnp.asarray(logits), samp, jnp.arange(B, dtype=jnp.int32)))
    np.testing.assert_array_equal(got, np.argmax(logits, -1))


def test_sample_is_deterministic_per_seed_and_position():
    rng = np.random.default_rng(2)
    V = 30
    row = rng.normal(size=V).astype(np.float32)
    N = 64
    logits = jnp.asarray(np.tile(row, (N, 1)))
    seeds, pos = np.arange(N) % 4, np.arange(N) // 4
    samp = _arrays(np.ones(N), np.ones(N), np.zeros(N), seeds)
    a = np.asarray(sample(logits, samp, jnp.asarray(pos, jnp.int32)))
    # same (seed, position) pairs in another order and another batch size -> same tokens
    perm = rng.permutation(N)[:40]
    samp2 = _arrays(np.ones(40), np.ones(40), np.zeros(40), seeds[perm])
    b = np.asarray(sample(logits[:40], samp2, jnp.asarray(pos[perm], jnp.int32)))
    np.testing.assert_array_equal(a[perm], b)
    assert len(set(a.tolist())) > 3  # different (seed, position) pairs do vary


@pytest.mark.parametrize("temperature,top_p,top_k,mode", [(1.0, 1.0, 0, True), (0.7, 0.9, 6, True), (1.3, 0.8, 0, True),
                                                        (2.0, 1.0, 3, True), (1.0, 1.0, 0, UNFILTERED),
                                                        (0.6, 1.0, 0, UNFILTERED)])
def test_sample_frequencies_chi_square(temperature, top_p, top_k, mode):
    V, N = 8, 20000
    logits = np.array([1.5, -0.5, 0.3, 2.0, -2.0, 0.9, 0.0, -1.0], np.float32)
    kept, _ = brute_kept(logits, temperature, top_p, top_k)
    toks = sorted(kept)
    z = np.array([kept[t] for t in toks])
    expected_p = dict(zip(toks, softmax(z)))
    seeds = np.repeat(np.arange(200), N // 200)
    positions = np.tile(np.arange(N // 200), 200)
    samp = _arrays(np.full(N, temperature), np.full(N, top_p), np.full(N, top_k), seeds)
    got = np.asarray(sample(jnp.asarray(np.tile(logits, (N, 1))), samp, jnp.asarray(positions, jnp.int32), mode))
    counts = np.bincount(got, minlength=V)
    outside = [t for t in range(V) if t not in kept]
    assert counts[outside].sum() == 0, f"sampled filtered-out tokens: {dict(zip(outside, counts[outside]))}"
    exp = np.array([expected_p[t] * N for t in toks])
    assert exp.min() >= 5, "expected counts too small for a chi-square test"
    stat = float(np.sum((counts[toks] - exp) ** 2 / exp))
    dof = len(toks) - 1
    assert dof >= 1
    assert stat < CHI2_CRIT_P001[dof], f"chi2={stat:.2f} dof={dof} counts={counts[toks]} expected={exp.round(1)}"


def test_token_logprobs():
    rng = np.random.default_rng(3)
    B, V = 4, 50
    logits = rng.normal(0, 3.0, (B, V)).astype(np.float32)
    tokens = rng.integers(0, V, B).astype(np.int32)
    chosen, top_vals, top_ids = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
    x = logits.astype(np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chosen), lp[np.arange(B), tokens], atol=1e-5)
    assert np.asarray(top_ids).shape == (B, MAX_LOGPROBS)
    for b in range(B):
        want = np.argsort(-lp[b])[:MAX_LOGPROBS]
        np.testing.assert_array_equal(np.asarray(top_ids)[b], want)
        np.testing.assert_allclose(np.asarray(top_vals)[b], lp[b, want], atol=1e-5)


def test_filter_in_place_keeps_what_the_sorted_filter_keeps():
    rng = np.random.default_rng(4)
    B, V = 24, 40
    logits = rng.normal(0, 2.0, (B, V)).astype(np.float32)
    top_p = rng.choice([1.0, 0.95, 0.7, 0.3], B).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 17], B).astype(np.int32)
    got = np.asarray(filter_in_place(jnp.asarray(logits), jnp.asarray(top_p), jnp.asarray(top_k)))
    for b in range(B):
        kept, _ = brute_kept(logits[b], 1.0, float(top_p[b]), int(top_k[b]))
        assert set(np.flatnonzero(np.isfinite(got[b])).tolist()) == set(kept), b
        np.testing.assert_array_equal(got[b][list(kept)], logits[b][list(kept)])


def test_unfiltered_rows_draw_the_same_token_in_either_program():
    """A row without top-k / top-p samples the same token whether its batch needed the sort (True) or
    not (UNFILTERED), so a request's tokens do not depend on its batch neighbours' filters."""
    rng = np.random.default_rng(5)
    B, V = 64, 300
    logits = jnp.asarray(rng.normal(0, 2.0, (B, V)).astype(np.float32))
    temp = rng.choice([0.0, 0.5, 1.0, 1.7], B)
    pos = jnp.asarray(rng.integers(0, 1000, B), jnp.int32)
    plain = _arrays(temp, np.ones(B), np.zeros(B), np.arange(B))
    fast = np.asarray(sample(logits, plain, pos, UNFILTERED))
    general = np.asarray(sample(logits, plain, pos, True))
    np.testing.assert_array_equal(fast, general)
    mixed = _arrays(temp, np.where(np.arange(B) % 2, 0.5, 1.0), np.where(np.arange(B) % 3 == 0, 4, 0), np.arange(B))
    in_mixed = np.asarray(sample(logits, mixed, pos, True))
    free = (np.arange(B) % 2 == 0) & (np.arange(B) % 3 != 0)  # rows of `mixed` without top-p / top-k
    np.testing.assert_array_equal(in_mixed[free], fast[free])
    assert (in_mixed[~free & (temp > 0)] != fast[~free & (temp > 0)]).any()  # the filters do act
