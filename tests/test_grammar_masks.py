"""Batched grammar masks (specjax.grammar_masks) and their device op (specjax.token_mask), on a
97-token character vocabulary: the batch of rows equals the masks of each row alone (next token:
xgrammar's batched fill; trees: vectorised bookkeeping + pooled traversals, checked against the
Python tree walk), only the listed rows are masked on the device, a grammar that raises fails its
own row only, and tokens fed to a constrained request in bursts give what one at a time gives."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.grammar import GrammarCompiler, unpack_bitmask
from specjax.grammar_masks import MaskBuilder
from specjax.request import Request
from specjax.sampling_params import SamplingParams
from specjax.token_mask import RowMasks, apply_bitmask, apply_token_mask, rows_bucket

xgrammar = pytest.importorskip("xgrammar")
from grammar_faults import BrokenMatcher  # noqa: E402
from test_grammar_engine import EOS, SCHEMA, VOCAB, CharTokenizer  # noqa: E402

V, W = 97, 4
KEYS = [SamplingParams(json_schema=SCHEMA).constraint, ("regex", r"[a-f]{2,5}(-[0-9]{1,3})?"),
        ("regex", r"(yes|no)!"), ("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]')]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(xgrammar.TokenizerInfo(VOCAB, vocab_size=V, stop_token_ids=[EOS]), V)


def walk(compiler, rng, k, steps):
    """A grammar of KEYS[k] advanced by `steps` random legal tokens (terminated if it gets there)."""
    g = compiler.matcher(KEYS[k], [EOS])
    for _ in range(steps):
        if g.is_terminated:
            break
        legal = np.flatnonzero(unpack_bitmask(g.next_mask(), V))
        g.accept([int(rng.choice(legal))])
    return g


def random_tree(rng, g, n):
    """A tree of n nodes, mostly legal tokens (some random ones: illegal), EOS now and then."""
    tokens, parents = [0], [-1]
    for i in range(1, n):
        p = int(rng.integers(0, i)) if rng.random() < 0.4 else i - 1
        row = g.tree_masks(np.array(tokens), np.array(parents), native=False)[p]
        legal = np.flatnonzero(unpack_bitmask(row, V))
        tokens.append(int(rng.choice(legal)) if legal.size and rng.random() < 0.85 else int(rng.integers(0, V)))
        parents.append(p)
    return np.array(tokens, np.int32), np.array(parents, np.int32)


def test_rows_bucket():
    assert [rows_bucket(n, 32) for n in (1, 2, 4, 5, 16, 17, 32)] == [1, 4, 4, 16, 16, 32, 32]
    assert rows_bucket(3, 2) == 3 and rows_bucket(2, 2) == 2  # never fewer than n


def test_apply_token_mask_rows_only():
    rng = np.random.default_rng(0)
    B, N = 6, 3
    logits = rng.normal(size=(B, N, V)).astype(np.float32)
    bits = rng.integers(-2**31, 2**31, size=(4, N, W), dtype=np.int64).astype(np.int32)
    rows = np.array([4, 1, B, B + 3], np.int32)  # two padding rows
    got = np.asarray(jax.jit(apply_token_mask)(jnp.asarray(logits), RowMasks(jnp.asarray(bits), jnp.asarray(rows))))
    want = logits.copy()
    for i, b in enumerate(rows[:2]):
        want[b] = np.where(unpack_bitmask(bits[i], V), logits[b], -np.inf)
    np.testing.assert_array_equal(got, want)
    dense = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(bits[:1].repeat(B, 0))))
    np.testing.assert_array_equal(dense, np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(bits[0]))))
    assert apply_token_mask(logits, None) is logits


@pytest.mark.parametrize("threads", [1, 2])
def test_next_masks_batch_equals_each_row(compiler, threads):
    rng = np.random.default_rng(threads)
    grammars = [walk(compiler, rng, k % 4, s) for k, s in zip(range(11), [0, 3, 7, 2, 30, 1, 5, 40, 0, 9, 4])]
    assert any(g.is_terminated for g in grammars) and not all(g.is_terminated for g in grammars)
    batch_rows = rng.permutation(16)[:11]
    out = MaskBuilder(W, threads).next_masks(list(zip(batch_rows.tolist(), grammars)), 16)
    assert out.bits.shape == (16, W) and out.failures == []
    np.testing.assert_array_equal(out.rows[:11], batch_rows)
    assert (out.rows[11:] == 16).all()  # padding rows: out of range
    for i, g in enumerate(grammars):
        np.testing.assert_array_equal(out.bits[i], g.next_mask(), err_msg=f"row {i}")
    assert MaskBuilder(W, threads).next_masks([], 16) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_tree_masks_batch_equals_each_row(compiler, threads):
    """10 rows (the pool splits them in two with threads=2): random trees over grammars in random
    states, terminated ones included; each row equals the Python walk of that row alone."""
    rng = np.random.default_rng(10 + threads)
    grammars = [walk(compiler, rng, k % 4, s) for k, s in zip(range(8), [0, 3, 8, 2, 30, 1, 5, 6])]
    trees = [random_tree(rng, g, 7) for g in grammars]
    c = [VOCAB.index(ch) for ch in "yno!"]
    done = compiler.matcher(KEYS[2], [EOS])  # complete after "no!": EOS may come next
    done.accept([c[1], c[2], c[3]])
    ended = compiler.matcher(KEYS[2], [EOS])  # terminated: only EOS follows
    ended.accept([c[0], VOCAB.index("e"), VOCAB.index("s"), c[3], EOS])
    grammars += [done, ended]
    trees += [(np.array([c[3], EOS, c[1], EOS, c[0], EOS, EOS]), np.array([-1, 0, 0, 1, 0, 3, 4])),
              (np.array([EOS, EOS, c[2], EOS, EOS, c[0], EOS]), np.array([-1, 0, 0, 1, 3, 4, 1]))]
    batch_rows = list(range(9, -1, -1))
    out = MaskBuilder(W, threads).tree_masks([(b, g, t) for b, g, t in zip(batch_rows, grammars, trees)], 12)
    assert out.bits.shape == (12, 7, W) and out.failures == []
    np.testing.assert_array_equal(out.rows, batch_rows + [12, 12])
    for i, (g, (tok, par)) in enumerate(zip(grammars, trees)):
        np.testing.assert_array_equal(out.bits[i], g.tree_masks(tok, par, native=False), err_msg=f"row {i}")
        np.testing.assert_array_equal(out.bits[i], g.tree_masks(tok, par), err_msg=f"row {i}")
    eos_only = done.stop_mask
    for i, stops, dead in ((8, [1, 3, 5], [2, 4, 6]), (9, [0, 1, 3, 4, 6], [2, 5])):
        for j in stops:  # stop nodes (and a terminated root): EOS only
            np.testing.assert_array_equal(out.bits[i, j], eos_only, err_msg=f"row {i} node {j}")
        assert not out.bits[i, dead].any()  # illegal nodes and those below them
    assert unpack_bitmask(out.bits[8, 0], V)[EOS] and unpack_bitmask(out.bits[8, 0], V).sum() == 1


@pytest.mark.parametrize("where", ["next", "tree"])
def test_a_raising_grammar_fails_its_row_only(compiler, where):
    rng = np.random.default_rng(5)
    grammars = [walk(compiler, rng, k, 2) for k in range(4)]
    trees = [random_tree(rng, g, 5) for g in grammars]
    ref = [g.next_mask().copy() for g in grammars] if where == "next" else \
        [g.tree_masks(*t) for g, t in zip(grammars, trees)]
    grammars[1]._matcher = BrokenMatcher(grammars[1]._matcher, fail=("fill_next_token_bitmask", "traverse_draft_tree"))
    grammars[3]._matcher = BrokenMatcher(grammars[3]._matcher)  # every call raises, is_terminated too
    other = GrammarCompiler(xgrammar.TokenizerInfo(VOCAB + ["x"] * 40, vocab_size=137, stop_token_ids=[EOS]), 137)
    grammars.append(other.matcher(KEYS[1], [EOS]))  # a vocabulary that does not match the model's
    trees.append(trees[0])
    mb = MaskBuilder(W, 1)
    if where == "next":
        out = mb.next_masks([(b, g) for b, g in enumerate(grammars)], 8)
    else:
        out = mb.tree_masks([(b, g, t) for b, g, t in zip(range(5), grammars, trees)], 8)
    why = dict(out.failures)
    assert sorted(why) == [1, 3, 4], out.failures
    assert "injected matcher fault" in why[1] and "injected matcher fault" in why[3] and "vocabulary" in why[4]
    assert out.rows.tolist()[:5] == [0, 8, 2, 8, 8]  # failed rows leave the device's batch alone
    for i in (0, 2):
        np.testing.assert_array_equal(out.bits[i], ref[i])


def _request(compiler, k, stop=()):
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=list(stop))
    req = Request(0, None, [1, 2], params, CharTokenizer(), (EOS,), 96, 0)
    req.grammar = compiler.matcher(KEYS[k], [EOS])
    return req


@pytest.mark.parametrize("k,stop,bad_at,reason", [(0, (), None, None), (1, (), None, "stop"), (3, (",",), None, None),
                                                  (1, (), 3, "error"), (0, ('"kind"',), 25, "stop"),
                                                  (2, (), None, "stop")])
def test_burst_accept_equals_one_at_a_time(compiler, k, stop, bad_at, reason):
    """Tokens in bursts of 1..5 give the tokens, text, finish reason and error of one at a time,
    with stop strings and a token the grammar rejects (bad_at) too."""
    rng = np.random.default_rng(k)
    ref = compiler.matcher(KEYS[k], [EOS])
    seq = []
    while len(seq) < 50:
        allowed = np.flatnonzero(unpack_bitmask(ref.next_mask(), V))
        t = int(rng.choice(allowed))
        if len(seq) == bad_at:  # a token the grammar forbids here
            t = int(np.flatnonzero(~unpack_bitmask(ref.next_mask(), V))[0])
            seq.append(t)
            break
        ref.accept([t])
        seq.append(t)
        if t == EOS:
            break
    seq += [EOS] * 5  # tokens after the end are dropped
    one, burst = _request(compiler, k, stop), _request(compiler, k, stop)
    for t in seq:
        if one.extend([t]):
            break
    i = 0
    while not burst.finished and i < len(seq):
        n = int(rng.integers(1, 6))
        burst.extend(seq[i: i + n])
        i += n
    a, b = one.output(), burst.output()
    assert (a.token_ids, a.text, a.finish_reason, a.error) == (b.token_ids, b.text, b.finish_reason, b.error)
    assert reason is None or a.finish_reason == reason, (a.finish_reason, a.text)
    assert a.finish_reason in ("stop", "length", "error") and (a.finish_reason == "error") == (a.error is not None)


def test_matcher_fault_in_accept_fails_the_request(compiler):
    req = _request(compiler, 1)
    req.extend([VOCAB.index("a")])
    req.grammar._matcher = BrokenMatcher(req.grammar._matcher, fail=("accept_token",))
    assert req.extend([VOCAB.index("b"), VOCAB.index("c")])
    assert req.finish_reason == "error" and "injected matcher fault" in req.error
    assert req.token_ids == [VOCAB.index("a"), VOCAB.index("b")]
