"""Grammar-constrained decoding (specjax.grammar) with the real SmolLM2 tokenizer.

Tree masks are checked against a brute-force reference: a fresh xgrammar matcher that consumes the
path to a node and is then offered each candidate token (on a fork, so nothing is shared).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarStateError,
    RequestGrammar,
    apply_bitmask,
    bitmask_width,
    full_mask,
    mask_of_tokens,
    pack_bool_mask,
    unpack_bitmask,
)
from specjax.sampling_params import SamplingParams, SamplingParamsError

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

VOCAB = 49152  # SmolLM2's model vocabulary

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "owl"]},
                           "score": {"type": "number", "minimum": 0, "maximum": 10}},
            "required": ["kind", "score"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from helpers import default_model_or_skip

    from specjax.checkpoint import load_tokenizer
    return load_tokenizer(default_model_or_skip())  # CI=true: fails instead of skipping


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB)


@pytest.fixture(scope="module")
def eos(tok):
    return tok.eos_token_id


def piece(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def key_of(**kw):
    return SamplingParams(**kw).constraint


# ----------------------------------------------------------------------------- reference

def reference_allowed(compiled, path, stops, candidates) -> dict[int, bool]:
    """Which candidates may follow `path`, asked of a fresh matcher (our spec: after the grammar
    ended with a stop token only stop tokens follow; after an illegal token nothing does)."""
    m = matcher_after(compiled, path, stops)
    if m is None:
        return {t: False for t in candidates}
    if m.is_terminated():
        return {t: t in stops for t in candidates}
    return {t: m.fork().accept_token(int(t)) for t in candidates}


def matcher_after(compiled, path, stops):
    """A fresh matcher that consumed path, or None when the path is illegal."""
    m = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stops))
    for t in path:
        if m.is_terminated():
            if t not in stops:
                return None
        elif not m.accept_token(int(t)):
            return None
    return m


def path_to(i, tokens, parents):
    path = []
    while i > 0:
        path.append(int(tokens[i]))
        i = int(parents[i])
    return path[::-1]


def check_against_reference(compiled, prefix, tokens, parents, masks, stops, candidates_of):
    bits = unpack_bitmask(masks, VOCAB)  # [N, V]
    for i in range(len(tokens)):
        cands = candidates_of(i, bits[i])
        ref = reference_allowed(compiled, prefix + path_to(i, tokens, parents), stops, cands)
        wrong = [t for t in cands if bool(bits[i, t]) != ref[t]]
        assert not wrong, f"node {i}: mask disagrees with the reference on tokens {wrong[:10]}"


# ----------------------------------------------------------------------------- SamplingParams

def test_sampling_params_constraint_keys():
    assert SamplingParams().constraint is None
    a = key_of(json_schema={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}})
    b = key_of(json_schema='{"type": "object",  "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}')
    assert a == b and a[0] == "json_schema" and hash(a) == hash(b)  # a dict or its text, spacing aside
    # the properties' order is the output's order: another order is another constraint
    c = key_of(json_schema='{"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}')
    assert c != a and c[1].index('"a"') < c[1].index('"b"') and a[1].index('"b"') < a[1].index('"a"')
    assert key_of(regex="a+") == ("regex", "a+")
    assert key_of(grammar='root ::= "x"') == ("grammar", 'root ::= "x"')
    assert key_of(choice=("x", "y")) == ("choice", '["x", "y"]')
    assert SamplingParams(choice=("x", "y")).choice == ["x", "y"]


@pytest.mark.parametrize("kw,words", [
    (dict(json_schema="{broken"), ["json_schema", "not valid JSON"]),
    (dict(json_schema="[1, 2]"), ["json_schema", "JSON object"]),
    (dict(json_schema=7), ["json_schema", "JSON object"]),
    (dict(json_schema={"a": {1, 2}}), ["json_schema", "serialisable"]),
    (dict(regex=""), ["regex"]), (dict(regex=3), ["regex"]), (dict(grammar=b"root"), ["grammar"]),
    (dict(choice=[]), ["choice"]), (dict(choice="yes"), ["choice"]), (dict(choice=["a", ""]), ["choice"]),
    (dict(choice=["a", 1]), ["choice"]),
    (dict(regex="a", choice=["a"]), ["regex and choice"]),
    (dict(json_schema={}, grammar='root ::= "a"'), ["json_schema and grammar"]),
])
def test_sampling_params_bad_constraints(kw, words):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    for w in words:
        assert w in str(e.value)


# ----------------------------------------------------------------------------- GrammarError

@pytest.mark.parametrize("key,words", [
    (("json_schema", '{"type": "bogus"}'), ["invalid json_schema", "bogus"]),
    (("json_schema", '{"type": "object", "properties": {"a": {"minimum": "x"}}}'), ["properties/a/minimum"]),
    (("json_schema", "[1]"), ["invalid json_schema", "JSON object"]),
    (("json_schema", "{nope"), ["invalid json_schema", "not valid JSON"]),
    (("regex", "(ab"), ["invalid regex '(ab'", "parenthesis"]),
    (("grammar", "root ::= undefined_rule"), ["invalid grammar", "undefined_rule"]),
    (("grammar", 'start ::= "a"'), ["invalid grammar", "root"]),
    (("choice", "[]"), ["invalid choice"]),
    (("choice", '["ok", ""]'), ["invalid choice"]),
    (("sql", "select"), ["kind"]),
])
def test_invalid_constraints_raise_grammar_error(compiler, key, words):
    with pytest.raises(GrammarError) as e:
        compiler.compile(key)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    assert ".cc:" not in msg  # xgrammar's log prefix is stripped


def test_compile_cache(tok):
    gc = GrammarCompiler(tok, VOCAB)
    first = gc.compile(key_of(json_schema=SCHEMA))
    again = gc.compile(key_of(json_schema=json.dumps(SCHEMA, indent=2)))  # same schema, other text
    assert again is first and gc.num_compiled == 1
    gc.compile(key_of(regex="(yes|no)"))
    gc.compile(key_of(regex="(yes|no)"))
    assert gc.num_compiled == 2
    with pytest.raises(GrammarError):
        gc.compile(key_of(regex="(bad"))
    assert gc.num_compiled == 2


def test_model_vocab_larger_than_tokenizer(tok, eos):
    gc = GrammarCompiler(tok, VOCAB + 40)
    rg = gc.matcher(key_of(regex="(yes|no)"), [eos])
    mask = rg.next_mask()
    assert mask.shape == (bitmask_width(VOCAB + 40),)
    assert not unpack_bitmask(mask, VOCAB + 40)[VOCAB:].any()


# ----------------------------------------------------------------------------- tree masks

@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_tree_masks_regex_full_vocab(tok, compiler, eos, native):
    key = key_of(regex="(yes|no|maybe)")
    rg = compiler.matcher(key, [eos])
    p = {w: piece(tok, w) for w in ("yes", "no", "may", "be", "y", "es")}
    nodes = [  # (token, parent)
        (piece(tok, ":"), -1),  # 0 root: last accepted token, already consumed
        (p["may"], 0),          # 1
        (p["no"], 0),           # 2 "no": grammar complete
        (p["yes"], 1),          # 3 "mayyes": illegal
        (p["be"], 3),           # 4 below an illegal node
        (p["be"], 1),           # 5 "maybe": complete
        (eos, 2),               # 6 "no" + EOS: terminated
        (p["no"], 6),           # 7 anything but EOS after EOS: illegal
        (p["y"], 0),            # 8
        (p["es"], 8),           # 9 "yes" in two pieces
        (eos, 0),               # 10 EOS before any output: illegal
    ]
    tokens = np.array([t for t, _ in nodes], np.int32)
    parents = np.array([q for _, q in nodes], np.int32)
    before = rg.next_mask().copy()
    masks = rg.tree_masks(tokens, parents, native=native)
    assert masks.shape == (len(nodes), bitmask_width(VOCAB)) and masks.dtype == np.int32
    np.testing.assert_array_equal(rg.next_mask(), before)  # matcher state restored
    assert rg.num_accepted == 0 and not rg.is_terminated

    only_eos = mask_of_tokens([eos], VOCAB)
    for i in (3, 4, 7, 10):
        assert not masks[i].any(), f"node {i} should have an all-zero mask"
    for i in (2, 5, 6, 9):
        np.testing.assert_array_equal(masks[i], only_eos, err_msg=f"node {i} should allow only EOS")
    allowed0 = unpack_bitmask(masks[0], VOCAB)
    assert all(allowed0[p[w]] for w in ("yes", "no", "may", "y")) and not allowed0[p["es"]]
    check_against_reference(compiler.compile(key), [], tokens, parents, masks, [eos],
                            lambda i, row: range(VOCAB))


def _grow_tree(rng, compiled, prefix, stops, n_nodes, start_token):
    """A random tree: each node picks a parent among earlier nodes and, mostly, a token the
    reference allows there (sometimes a random one, which is usually illegal)."""
    tokens, parents = [start_token], [-1]
    for i in range(1, n_nodes):
        par = int(rng.integers(0, i)) if rng.random() < 0.4 else i - 1
        m = matcher_after(compiled, prefix + path_to(par, tokens, parents), stops)
        row = np.zeros((1, bitmask_width(VOCAB)), np.int32)
        if m is not None and not m.is_terminated():
            m.fill_next_token_bitmask(row)
        legal = np.flatnonzero(unpack_bitmask(row[0], VOCAB))
        take_legal = legal.size and rng.random() < 0.85
        tokens.append(int(rng.choice(legal)) if take_legal else int(rng.integers(0, VOCAB)))
        parents.append(par)
    return np.array(tokens), np.array(parents)


@pytest.mark.parametrize("prefix_text", [
    '{"name": "Al',
    '{"name": "Al", "pet": {"kind": "cat", "score": 3',
    '{"name": "Al", "pet": {"kind": "cat", "score": 3}, "tags": ["a"',  # trees reach the end and EOS
])
def test_tree_masks_json_schema_random_trees(tok, compiler, eos, prefix_text):
    key = key_of(json_schema=SCHEMA)
    compiled = compiler.compile(key)
    prefix = tok.encode(prefix_text, add_special_tokens=False)
    rng = np.random.default_rng(len(prefix_text))
    only_eos = mask_of_tokens([eos], VOCAB)
    legal_rows = eos_rows = 0
    for _ in range(2):
        rg = compiler.matcher(key, [eos])
        rg.accept(prefix)
        tokens, parents = _grow_tree(rng, compiled, prefix, [eos], 24, prefix[-1])
        masks = rg.tree_masks(tokens, parents)
        np.testing.assert_array_equal(masks, rg.tree_masks(tokens, parents, native=False))
        sample = rng.integers(0, VOCAB, 2000)

        def candidates(i, row, tokens=tokens, sample=sample):
            on = np.flatnonzero(row)
            picked = rng.choice(on, min(on.size, 300), replace=False) if on.size else on
            return sorted({*tokens.tolist(), *sample.tolist(), *picked.tolist(), eos})

        check_against_reference(compiled, prefix, tokens, parents, masks, [eos], candidates)
        assert rg.num_accepted == len(prefix) and masks[0].any()
        legal_rows += int(masks[1:].any(1).sum())
        eos_rows += int((masks == only_eos).all(1).sum())
    assert legal_rows >= 10  # the trees go well past the root
    assert eos_rows > 0 or "tags" not in prefix_text  # near the end, paths finish and allow only EOS


def test_accept_and_termination(tok, compiler, eos):
    rg = compiler.matcher(key_of(choice=["no", "maybe"]), [eos])
    with pytest.raises(GrammarStateError):
        rg.accept([piece(tok, "yes")])
    rg.accept([piece(tok, "no")])
    assert rg.is_completed and not rg.is_terminated
    np.testing.assert_array_equal(rg.next_mask(), mask_of_tokens([eos], VOCAB))
    rg.accept([eos])
    assert rg.is_terminated
    rg.accept([eos])  # a further stop token is harmless
    with pytest.raises(GrammarStateError):
        rg.accept([piece(tok, "no")])
    np.testing.assert_array_equal(rg.next_mask(), mask_of_tokens([eos], VOCAB))
    masks = rg.tree_masks(np.array([eos, eos, piece(tok, "no"), eos]), np.array([-1, 0, 0, 1]))
    np.testing.assert_array_equal(masks[[0, 1, 3]], np.tile(mask_of_tokens([eos], VOCAB), (3, 1)))
    assert not masks[2].any()


def test_tree_masks_rejects_bad_trees(compiler, eos):
    rg = compiler.matcher(key_of(regex="a+"), [eos])
    with pytest.raises(ValueError, match="parents"):
        rg.tree_masks(np.array([1, 2, 3]), np.array([-1, 2, 0]))
    with pytest.raises(ValueError, match="draft tokens"):
        rg.tree_masks(np.array([1, VOCAB]), np.array([-1, 0]))


# ----------------------------------------------------------------------------- mask helpers

def _reference_apply(logits, bitmask):
    v = logits.shape[-1]
    words = bitmask.astype(np.int64) & 0xFFFFFFFF
    t = np.arange(v)
    in_range = t < 32 * bitmask.shape[-1]
    word = np.take(words, np.minimum(t // 32, bitmask.shape[-1] - 1), axis=-1)
    allowed = ((word >> (t % 32)) & 1).astype(bool) & in_range
    return np.where(allowed, logits, -np.inf)


@pytest.mark.parametrize("vocab,width", [(97, 4), (97, 3), (64, 2), (VOCAB, VOCAB // 32)])
def test_apply_bitmask_matches_numpy(vocab, width):
    rng = np.random.default_rng(vocab + width)
    logits = rng.normal(size=(2, 3, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(2, 3, width), dtype=np.int64).astype(np.int32)
    bitmask[0, 0] = -1  # all bits set, including the padding bits past the vocabulary
    bitmask[0, 1] = 0
    got = np.asarray(jax.jit(apply_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, _reference_apply(logits, bitmask))
    # one mask broadcast over a batch of rows
    got_b = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(bitmask[1, 2])))
    np.testing.assert_array_equal(got_b, _reference_apply(logits, np.broadcast_to(bitmask[1, 2], (2, 3, width))))


def test_numpy_mask_helpers():
    assert bitmask_width(97) == 4 and bitmask_width(96) == 3
    full = unpack_bitmask(full_mask(97), 97)
    assert full.all() and unpack_bitmask(full_mask(97), 128)[97:].sum() == 0
    np.testing.assert_array_equal(np.flatnonzero(unpack_bitmask(mask_of_tokens([0, 31, 32, 96], 97), 97)),
                                  [0, 31, 32, 96])
    allowed = np.random.default_rng(1).random((5, 97)) < 0.5
    np.testing.assert_array_equal(unpack_bitmask(pack_bool_mask(allowed), 97), allowed)
    assert mask_of_tokens([31], 97)[0] == np.int32(-2**31)  # bit 31 is the int32 sign bit


# ----------------------------------------------------------------------------- constrained decoding

def constrained_greedy(tok, rg: RequestGrammar, eos: int, seed: int, max_steps: int = 400) -> str:
    """Greedy decoding from random logits under the grammar; returns the text before EOS."""
    rng = np.random.default_rng(seed)
    step = jax.jit(lambda lg, bm: jnp.argmax(apply_bitmask(lg, bm), axis=-1))
    out = []
    for _ in range(max_steps):
        logits = rng.normal(size=VOCAB).astype(np.float32)
        logits[eos] += 2.0  # end as soon as the grammar allows
        t = int(step(jnp.asarray(logits), jnp.asarray(rg.next_mask())))
        rg.accept([t])
        if t == eos:
            assert rg.is_terminated
            return tok.decode(out)
        out.append(t)
    raise AssertionError(f"no EOS within {max_steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_greedy_json(tok, compiler, eos, seed):
    rg = compiler.matcher(key_of(json_schema=SCHEMA), [eos])
    text = constrained_greedy(tok, rg, eos, seed)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert value["pet"]["kind"] in ("cat", "dog", "owl") and 0 <= value["pet"]["score"] <= 10


def test_constrained_greedy_choice(tok, compiler, eos):
    choices = ["red", "green", 'blue "sky"', "ünïcode"]
    for seed in range(4):
        assert constrained_greedy(tok, compiler.matcher(key_of(choice=choices), [eos]), eos, seed) in choices
