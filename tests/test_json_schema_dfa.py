"""JSON schemas on the device DFA (specjax.json_schema_regex -> regex_dfa -> token_dfa -> dfa_routing):

* the converter: integer ranges against brute force; unsupported schemas raise SchemaUnsupported
  with their reason;
* the language of xgrammar's grammar for the schema (the host path:
  from_json_schema(any_whitespace=False, strict_mode=True)): byte strings spelled by random walks of
  the schema's byte DFA, and mutations of them, are accepted by both or by neither;
* the token masks on SmolLM2's vocabulary: along seeded walks (a random token class at each step,
  later the tokens nearest to the end of the JSON) the token DFA's mask equals xgrammar's bitmask at
  every step, the stop token (termination) included;
* routing: a supported schema gets a DeviceDFA; unsupported, invalid and over-limit ones the host
  path with the reason;
* the engine (the tiny random model over 97 characters): in tests/test_device_dfa.py, whose
  engines the checks share;
* the real SmolLM2 (float32): plain and tree-speculative greedy outputs under a schema are the
  same with the device DFA on and off, and parse and validate: in tests/test_grammar_smollm2.py,
  whose engines it shares (building and compiling them again here cost ~100 s).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from specjax.dfa_routing import DeviceDFA, DFARouter
from specjax.grammar import build_grammar, unpack_bitmask
from specjax.json_schema_regex import SchemaUnsupported, int_range_regex, picojson_dumps, schema_regex
from specjax.regex_dfa import compile_regex
from specjax.sampling_params import SamplingParams
from specjax.token_dfa import build_token_dfa, vocab_token_bytes

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MOVIE = {  # scripts/bench_engine.py's JSON_SCHEMA
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                   "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
                   "cast": {"type": "array", "items": {"type": "object", "properties": {
                       "name": {"type": "string"}, "role": {"type": "string"}}, "required": ["name", "role"]}},
                   "summary": {"type": "string"}},
    "required": ["title", "year", "genre", "cast", "summary"],
}
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}
SCHEMAS = {
    "movie": MOVIE,
    "string": {"type": "string"},
    "int ranges": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -5, "maximum": 123}, "b": {"type": "integer", "exclusiveMinimum": 0},
        "c": {"type": "integer", "maximum": -7}, "d": {"type": "integer", "minimum": 3, "exclusiveMaximum": 10.0}},
        "required": ["a", "b", "c", "d"]},
    "scalars": {"type": "array", "items": {"type": ["number", "boolean", "null"]}, "minItems": 1, "maxItems": 4},
    "optional": {"type": "object", "properties": {
        "x": {"type": "boolean"}, "y": {"type": "string", "minLength": 1, "maxLength": 3}, "z": {"type": "integer"}},
        "required": ["y"]},
    "all optional": {"properties": {"a": {"type": "null"}, "b": {"type": "boolean", "title": "B"}}},
    "enum const": {"type": "object", "properties": {
        "e": {"enum": ["a\"b", "c\\d", "é/中\u007f\u0001", 1.5, 2.0, 0.1, -0.0, None, True, {"k": [1, "x"]}]},
        "c": {"const": "fixed\ttext"}, "k\"é": {"const": [1e300, 12345678901234567890]}},
        "required": ["e", "c", "k\"é"]},
    "refs": {"$defs": {"pt": POINT}, "type": "object", "properties": {
        "path": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 3},
        "origin": {"$ref": "#/$defs/pt", "type": "string"}}, "required": ["path"]},
    "any of": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"v": {"type": "string"}},
                                                "required": ["v"]}, {"enum": ["none"]}]},
    "formats": {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "date-time"},
        "u": {"type": "string", "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"},
        "tm": {"type": "string", "format": "time"}}, "required": ["d", "u"]},
    "lengths": {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2, "maxItems": 2},
    "nested": {"type": "object", "properties": {
        "id": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"},
                                                  "sub": {"allOf": [POINT]}}, "required": ["n"]},
        "none": {"type": "array", "items": False}}, "required": ["meta"], "additionalProperties": False},
    "number": {"type": "number"},
}

UNSUPPORTED = [
    ({}, "any JSON value"), ({"type": "object"}, "any object"), ({"type": "array"}, "array without items"),
    ({"type": "array", "items": True}, "any JSON value"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
     "recursive $ref"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}, "additionalProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
     "additionalProperties"),
    ({"type": "string", "pattern": "^[a-z]+$"}, "pattern"), ({"type": "string", "format": "email"}, "format"),
    ({"type": "number", "minimum": 0}, "minimum"), ({"type": "integer", "multipleOf": 5}, "multipleOf"),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "prefixItems"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "minProperties": 1}, "minProperties"),
    ({"allOf": [{"type": "integer"}, {"type": "integer"}]}, "allOf"),
    ({"type": "integer", "not": {"const": 3}}, "not"), ({"$ref": "other.json#/a"}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "patternProperties": {"^x": {}}}, "patternProperties"),
]


def key_of(schema) -> tuple[str, str]:
    """The constraint key the engine sees (the schema re-serialised, its key order kept)."""
    return SamplingParams(json_schema=schema).constraint


# ----------------------------------------------------------------------------- converter

def test_integer_ranges_are_the_canonical_integers():
    rng = np.random.default_rng(0)
    cases = [(None, None), (0, None), (None, 0), (5, None), (-3, None), (None, -7), (None, 12), (-250, -20),
             (1900, 2100), (0, 0), (-1, 1), (7, 7), (-7, -7), (100, 999), (99, 1000), (10, 10 ** 6)]
    for a, b in rng.integers(-3000, 3000, (60, 2)):
        lo, hi = sorted((int(a), int(b)))
        cases += [(lo, hi), (lo, None), (None, hi)]
    strings = [str(i) for i in range(-3100, 3100)] + ["-0", "00", "01", "-01", "+1", "1.0", "", "1000000", "1000001"]
    strings += [str(s * 10 ** k) for k in range(4, 9) for s in (1, -1)]
    for lo, hi in cases:
        r = re.compile(int_range_regex(lo, hi))
        for s in strings:
            want = (re.fullmatch(r"0|-?[1-9][0-9]*", s) is not None and (lo is None or int(s) >= lo)
                    and (hi is None or int(s) <= hi))
            assert (r.fullmatch(s) is not None) == want, (lo, hi, s, r.pattern)


def test_picojson_spelling():
    """const / enum values as xgrammar writes them; doubles in the installed xgrammar's form (0.2.8: "%.17g";
    0.2.9 on: the shortest of %.15g / %.16g / %.17g that reads back), the values probed against both versions."""
    from specjax.json_schema_regex import _spell_double, _xgrammar_spells_short
    short = _xgrammar_spells_short()
    assert picojson_dumps({"k": [1, 2.0, 0.1, -0.0, None, True], "é/\"\x7f\x01\n": "x"}) == \
        '{"k":[1,2,%s,-0,null,true],"é/\\"\\u007f\\u0001\\n":"x"}' % ("0.1" if short else "0.10000000000000001")
    assert picojson_dumps(12345678901234567890) == "1.2345678901234567e+19"
    assert picojson_dumps(1e300) == ("1e+300" if short else "1.0000000000000001e+300")
    cases = {  # value: (xgrammar 0.2.8, 0.2.9)
        1e-5: ("1.0000000000000001e-05", "1e-05"), 5e-324: ("4.9406564584124654e-324", "4.94065645841247e-324"),
        1e16: ("10000000000000000", "1e+16"), 3e15: ("3000000000000000", "3000000000000000"),
        2.0 ** 53: ("9007199254740992", "9007199254740992"), 2.0 ** 60: ("1.152921504606847e+18",) * 2,
        1234567890123456.5: ("1234567890123456.5",) * 2, 1e-320: ("9.9998886718268301e-321", "9.99988867182683e-321")}
    for x, (long_form, short_form) in cases.items():
        assert (_spell_double(x, False), _spell_double(x, True)) == (long_form, short_form), x


@pytest.mark.parametrize("schema,why", UNSUPPORTED, ids=[w for _, w in UNSUPPORTED])
def test_unsupported_schemas_say_why(schema, why):
    with pytest.raises(SchemaUnsupported, match=re.escape(why)):
        schema_regex(key_of(schema)[1])


# ----------------------------------------------------------------------------- language

def byte_walks(dfa, rng, n):
    """n byte strings spelled by random walks of the byte DFA, each ended by a shortest path to
    acceptance (surrogate encodings included: xgrammar's string characters allow them)."""
    S = dfa.num_states
    dist = np.where(dfa.accept, 0, S + 1)
    for _ in range(S):
        dist = np.minimum(dist, np.where(dfa.trans >= 0, dist[np.maximum(dfa.trans, 0)] + 1, S + 1).min(1))
    out = []
    for _ in range(n):
        s, data = 0, []
        for _ in range(int(rng.integers(0, 60))):
            nz = np.flatnonzero(dfa.trans[s] >= 0)
            if nz.size == 0:
                break
            data.append(int(rng.choice(nz)))
            s = int(dfa.trans[s, data[-1]])
        while not dfa.accept[s]:
            b = int(np.flatnonzero((dfa.trans[s] >= 0) & (dist[np.maximum(dfa.trans[s], 0)] == dist[s] - 1))[0])
            data.append(b)
            s = int(dfa.trans[s, b])
        out.append(bytes(data))
    return out


def mutations(data: bytes, rng) -> list[bytes]:
    i = int(rng.integers(0, len(data) + 1))
    c = bytes([int(rng.choice(list(b' ,:"{}[]\\0159-.eEtfnu\n\t\x01\xa0\xc3\xed')))])
    return [data[:i] + c + data[i:], data[:i] + data[i + 1:], data[:i] + c + data[i + 1:], data[:i]]


@pytest.fixture(scope="module")
def tiny_compiler():
    info = xgrammar.TokenizerInfo(["a", "</s>"], vocab_size=2, stop_token_ids=[1])
    return xgrammar.GrammarCompiler(info, max_threads=1)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_same_language_as_xgrammar(tiny_compiler, name):
    key = key_of(SCHEMAS[name])
    dfa = compile_regex(schema_regex(key[1]), xgrammar=True)
    compiled = tiny_compiler.compile_grammar(build_grammar(key))
    rng = np.random.default_rng(1)
    walks = byte_walks(dfa, rng, 60)
    strings = walks + [m for w in walks for m in mutations(w, rng)] + [b"", b"{}", b"[]", b"null", b"0"]
    for data in strings:
        m = xgrammar.GrammarMatcher(compiled)
        want = m.accept_string(data) and m.is_completed()
        assert dfa.matches(data) == want, (name, data)
    assert all(dfa.matches(w) for w in walks)


def test_properties_keep_the_schemas_order(tiny_compiler):
    """An object's properties come in the order the request's schema gives them, on both paths (the
    constraint key once sorted the keys, which made every generated object alphabetical)."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    key = key_of(schema)
    assert key[1].index('"zeta"') < key[1].index('"alpha"')
    dfa = compile_regex(schema_regex(key[1]), xgrammar=True)
    compiled = tiny_compiler.compile_grammar(build_grammar(key))
    for text, ok in ((b'{"zeta": 1, "alpha": 2}', True), (b'{"alpha": 2, "zeta": 1}', False)):
        m = xgrammar.GrammarMatcher(compiled)
        assert dfa.matches(text) == ok
        assert (m.accept_string(text) and m.is_completed()) == ok


# ----------------------------------------------------------------------------- token masks (SmolLM2)

@pytest.fixture(scope="module")
def smollm2_info():
    from helpers import default_model_or_skip

    from specjax.checkpoint import load_tokenizer
    tok = load_tokenizer(default_model_or_skip())  # CI=true: fails instead of skipping
    return xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=49152)


def steps_to_end(td) -> np.ndarray:
    """[S] the fewest tokens from each state to an accepting one."""
    far = td.num_states + 1
    d = np.where(td.accept, 0, far)
    for _ in range(td.num_states):
        nd = np.minimum(d, np.where(td.next >= 0, d[np.maximum(td.next, 0)] + 1, far).min(1))
        if (nd == d).all():
            break
        d = nd
    return d


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_token_masks_equal_xgrammar_smollm2(smollm2_info, name):
    """8 seeded walks of up to 150 tokens: a token of a random class among the allowed ones, with a
    growing chance of a token nearest to the end instead (so the walks finish their JSON); at every
    step both masks agree; each walk ends at the stop token, where xgrammar terminates and the token
    DFA is in an accepting state."""
    info, V = smollm2_info, smollm2_info.vocab_size
    key = key_of(SCHEMAS[name])
    td = build_token_dfa(compile_regex(schema_regex(key[1]), xgrammar=True), vocab_token_bytes(info),
                         info.stop_token_ids, V)
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(build_grammar(key))
    near = steps_to_end(td)
    stops = set(info.stop_token_ids)
    bitmask = xgrammar.allocate_token_bitmask(1, V).numpy()
    compared = 0
    for seed in range(8):
        rng = np.random.default_rng(seed)
        m = xgrammar.GrammarMatcher(compiled)
        state, steps = 0, 150
        for step in range(steps):
            m.fill_next_token_bitmask(bitmask)
            want, got = unpack_bitmask(bitmask[0], V), td.allowed(state)
            diff = np.flatnonzero(want != got)
            assert diff.size == 0, (name, seed, step, [(int(t), bytes(info.decoded_vocab[t]), bool(want[t]))
                                                       for t in diff[:8]])
            allowed = np.flatnonzero(got)
            assert allowed.size, (name, seed, step)  # the vocabulary has every byte: never stuck
            text = np.array([t for t in allowed if t not in stops])
            if text.size and rng.random() >= min(0.9, step / steps):
                cls = td.token_class[text]
                t = int(rng.choice(text[cls == rng.choice(np.unique(cls))]))
            else:
                after = near[td.next[state, td.token_class[allowed]]]
                t = int(rng.choice(allowed[after == after.min()]))
            assert m.accept_token(t)
            state = td.step(state, t)
            if t in stops:
                assert m.is_terminated() and td.accept[state]
                break
        else:
            pytest.fail(f"{name} seed {seed}: no stop token in {steps} steps")
        compared += step + 1
    print(f"{name}: {td.num_states} states, {td.num_classes} token classes, {compared} masks compared")


def test_string_masks_inside_multibyte_characters(smollm2_info):
    """In a JSON string, after each single-byte token that starts a multi-byte character (and after
    each of its first continuation bytes for E0 / ED / F0 / F4, whose ranges are special): the same
    masks. xgrammar allows the encodings of surrogates (ED A0..BF ..): so does the DFA."""
    info, V = smollm2_info, smollm2_info.vocab_size
    tb = vocab_token_bytes(info)
    byte_token = {b[0]: t for t, b in enumerate(tb) if b is not None and len(b) == 1}
    key = key_of({"type": "string"})
    td = build_token_dfa(compile_regex(schema_regex(key[1]), xgrammar=True), tb, info.stop_token_ids, V)
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(build_grammar(key))
    bitmask = xgrammar.allocate_token_bitmask(1, V).numpy()
    seqs = [(lead,) for lead in range(0xC2, 0xF5)] + [(lead, c) for lead in (0xE0, 0xED, 0xF0, 0xF4)
                                                      for c in range(0x80, 0xC0)]
    checked = 0
    for seq in seqs:
        m, state = xgrammar.GrammarMatcher(compiled), td.step(0, byte_token[ord('"')])
        assert m.accept_token(byte_token[ord('"')])
        for b in seq:
            ok = b in byte_token and td.next[state, td.token_class[byte_token[b]]] >= 0
            assert ok == (b in byte_token and m.accept_token(byte_token[b])), seq
            if not ok:
                break
            state = td.step(state, byte_token[b])
        else:
            m.fill_next_token_bitmask(bitmask)
            assert (unpack_bitmask(bitmask[0], V) == td.allowed(state)).all(), seq
            checked += 1
    assert checked > 100


# ----------------------------------------------------------------------------- routing

def char_info():
    from test_grammar_engine import EOS, VOCAB
    return xgrammar.TokenizerInfo(VOCAB, vocab_size=97, stop_token_ids=[EOS])


def test_routing():
    from test_grammar_engine import EOS, VOCAB
    router, info = DFARouter(97), char_info()
    dfa, why = router.route(key_of(MOVIE), info, (EOS,), 512, 256)
    assert why is None and isinstance(dfa, DeviceDFA) and dfa.token_dfa.num_states <= 512
    text = '{"title": "T\\"", "year": 2001, "genre": "drama", "cast": [], "summary": "x"}'  # the schema's order
    s = dfa.state_after([VOCAB.index(c) for c in text])
    assert dfa.token_dfa.accept[s]
    dfa, why = router.route(key_of(MOVIE), info, (EOS,), 100, 256)
    assert dfa is None and "> dfa_max_states=100" in why
    dfa, why = router.route(key_of({"type": "number", "maximum": 3}), info, (EOS,), 512, 256)
    assert dfa is None and why.startswith("json_schema not supported on the device") and "maximum" in why
    dfa, why = router.route(key_of({"type": "bogus"}), info, (EOS,), 512, 256)  # the host path fails it
    assert dfa is None and why.startswith("json_schema not supported on the device") and "bogus" in why
    dfa, why = router.route(key_of({"enum": [1, 2], "type": "bogus"}), info, (EOS,), 512, 256)  # converts (enum first)
    assert dfa is None and why.startswith("invalid json_schema")  # but jsonschema rejects it
