"""Regexes compiled to byte DFAs (specjax.regex_dfa) and lifted to token tables (specjax.token_dfa).

* languages: for patterns covering every supported construct, the DFA walked over the UTF-8 bytes
  of a string accepts it exactly when ``re.fullmatch(p, s, re.ASCII)`` matches; strings are random
  (the pattern's characters, multi-byte ones), taken from random walks of the DFA (each must be
  valid UTF-8) and mutated by one character. Every DFA is minimal (an independent Moore refinement
  merges no states), every state is reachable and can reach an accepting state;
* errors: unsupported constructs name themselves, invalid patterns, too many states, no string;
* token DFA: on a hand vocabulary (partial UTF-8 tokens, special tokens, padding, EOS ids) the
  tables equal a brute-force byte walk, in one chunk of states or many; a 49152-token random vocab;
* xgrammar: along a seeded walk of tokens the token DFA's masks equal xgrammar's, on a character
  vocabulary (with partial UTF-8 tokens) and on SmolLM2's 49152 tokens (default_model_or_skip).
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from specjax import token_dfa
from specjax.grammar import pack_bool_mask, unpack_bitmask
from specjax.regex_dfa import RegexError, RegexUnsupported, choice_regex, compile_regex
from specjax.token_dfa import build_token_dfa, vocab_token_bytes

MULTI = "é中😀"

# (pattern, strings that match: a check of the test itself and of the DFA)
PATTERNS = [
    ("abc", ["abc"]), ("a|b|cd", ["cd"]), ("a|", ["", "a"]), ("(ab)*c", ["ababc"]),
    ("(?:ab|c)+d?", ["abccd"]), ("(?P<x>a[bc])+", ["abac"]), ("x{3}", ["xxx"]), ("x{2,}y", ["xxxxy"]),
    ("x{1,3}", ["xx"]), ("(ab){,2}", ["", "abab"]), ("a{,}b", ["aab"]), ("a{}b{x}{1,x}", ["a{}b{x}{1,x}"]),
    (".+", ["a\tb中"]), ("a.c", ["a😀c"]), ("[a-c]+[^a-c]", ["ab中"]), ("[^é中]*", ["ab😀"]),
    ("[é-ü😀]+", ["éü😀"]), (r"\d+\.\d*", ["12."]), (r"\w+\s\W\S\D", ["a_1\n中😀é"]),
    (r"[\d\s_-]+", ["1 _-\t"]), (r"\x41\u4e2d\U0001F600\t\n\N{BULLET}", ["A中😀\t\n•"]),
    (r"\0\012[\1\101]\101", ["\0\n\1A"]), ("a*?b+?c??d{1,2}?", ["bdd"]), ("((a|b)(c|d)?)*e", ["acbe"]),
    ("^(a|b)c$", ["bc"]), ("[]a]+[^]a][a-]", ["]ab-"]), (r"\.|\\|\$|\(\)\[\]\{\}\*\+\?\|\^", ["\\", "()[]{}*+?|^"]),
    ("(a*)*b", ["aab"]), ("(?:a|)+x", ["aax"]), (r"[\\\]\-^]+", ["\\]-^"]), (r"\u00e9\d{2}|中{2,3}", ["é12", "中中"]),
    (r"[^\d\s]{2}", ["中a"]), (r"[\x00-\x7f]*[\u0800-\uffff]", ["a\uffff"]), (r"[\U00010000-\U0010ffff]+", ["😀\U0010ffff"]),
    ("(|a)(b|)", [""]), ("(a|ab)(c|bcd)(d*)", ["abcd"]),
]


def moore_states(trans, accept) -> int:
    """Number of classes of states (a sink state added for "no transition") that Moore refinement finds."""
    S = trans.shape[0]
    full = np.concatenate([np.where(trans >= 0, trans, S), np.full((1, 256), S)])
    cls = np.append(accept, False).astype(np.int64)
    while True:
        _, new = np.unique(np.concatenate([cls[:, None], cls[full]], 1), axis=0, return_inverse=True)
        new = new.reshape(-1)
        if new.max() == cls.max():
            return int(new.max()) + 1
        cls = new


def check_structure(dfa):
    trans, accept = dfa.trans, dfa.accept
    S = trans.shape[0]
    assert trans.dtype == np.int32 and trans.shape == (S, 256) and accept.shape == (S,) and accept.dtype == bool
    assert trans.min() >= -1 and trans.max() < S
    seen, todo = {0}, [0]  # reachable from the start, every state
    while todo:
        for t in set(trans[todo.pop()].tolist()) - {-1} - seen:
            seen.add(t)
            todo.append(t)
    assert seen == set(range(S))
    live = accept.copy()  # every state reaches an accepting state
    for _ in range(S):
        live = live | np.any((trans >= 0) & live[np.maximum(trans, 0)], axis=1)
    assert live.all()
    assert moore_states(trans, accept) == S + 1  # minimal: the sink and every state stay apart


def dfa_walks(dfa, rng, n):
    """n strings spelled by random walks of the DFA, each ended by a shortest path to acceptance."""
    S = dfa.num_states
    dist = np.where(dfa.accept, 0, S + 1)
    for _ in range(S):
        d = np.where(dfa.trans >= 0, dist[np.maximum(dfa.trans, 0)] + 1, S + 1).min(1)
        dist = np.minimum(dist, d)
    out = []
    for _ in range(n):
        s, data = 0, []
        for _ in range(int(rng.integers(0, 12))):
            nz = np.flatnonzero(dfa.trans[s] >= 0)
            if nz.size == 0:
                break
            b = int(rng.choice(nz))
            data.append(b)
            s = int(dfa.trans[s, b])
        while not dfa.accept[s]:
            b = int(np.flatnonzero((dfa.trans[s] >= 0) & (dist[np.maximum(dfa.trans[s], 0)] == dist[s] - 1))[0])
            data.append(b)
            s = int(dfa.trans[s, b])
        out.append(bytes(data).decode("utf-8"))  # the DFA spells valid UTF-8 only
    return out


def mutate(s, alphabet, rng):
    i = int(rng.integers(0, len(s) + 1))
    c = str(rng.choice(alphabet))
    return [s[:i] + c + s[i:], s[:i] + s[i + 1:], s[:i] + c + s[i + 1:]]


@pytest.mark.parametrize("pattern,examples", PATTERNS, ids=[p for p, _ in PATTERNS])
def test_language_equals_python_re(pattern, examples):
    dfa = compile_regex(pattern)
    check_structure(dfa)
    rng = np.random.default_rng(len(pattern))
    alphabet = sorted(set(pattern) - {"\\"} | set("a0 _\n.A\t\0\xa0ü•") | set(MULTI))
    strings = list(examples) + ["", "\n"]
    strings += ["".join(rng.choice(alphabet, size=int(rng.integers(0, 9)))) for _ in range(1500)]
    walks = dfa_walks(dfa, rng, 150)
    strings += walks + [m for w in walks for m in mutate(w, alphabet, rng)]
    for s in strings:
        want = re.fullmatch(pattern, s, re.ASCII) is not None
        assert dfa.matches(s.encode("utf-8")) == want, (pattern, s, want)
    assert all(re.fullmatch(pattern, s, re.ASCII) for s in examples + walks)


def test_dot_and_space_xgrammar_meaning():
    assert not compile_regex(".").matches(b"\n") and compile_regex(".", xgrammar=True).matches(b"\n")
    nbsp = "\xa0".encode()
    assert not compile_regex(r"\s").matches(nbsp) and compile_regex(r"\S").matches(nbsp)
    assert compile_regex(r"\s", xgrammar=True).matches(nbsp) and not compile_regex(r"\S", xgrammar=True).matches(nbsp)
    assert compile_regex(r"[^\s]", xgrammar=True).matches(b"a") and not compile_regex(r"[^\s]", xgrammar=True).matches(nbsp)
    surrogate = "\ud800".encode("utf-8", "surrogatepass")  # ED A0 80: xgrammar's wide classes allow it
    for p in [".", "[^a]", r"[\u0800-\uffff]", r"\S"]:
        assert not compile_regex(p).matches(surrogate) and compile_regex(p, xgrammar=True).matches(surrogate), p


def test_bounded_dot_needs_its_minimum():
    """".{2,9}x?" matches no text shorter than two characters, as Python's re says, and its token DFA
    allows EOS only from there on. (xgrammar 0.2.9 lets ".{2,9}" end after 0 or 1 characters, not
    "a{2,9}"; 0.2.8 does not: why pyproject keeps xgrammar below 0.2.9.)"""
    texts = ["", "a", "ab", "a\nb", "abcdefghi", "abcdefghix", "abcdefghij", "abcdefghijx"]
    for xg in (False, True):
        dfa = compile_regex(".{2,9}x?", xgrammar=xg)
        for t in texts:
            want = re.fullmatch(".{2,9}x?", t, re.ASCII | (re.DOTALL if xg else 0)) is not None
            assert dfa.matches(t.encode()) == want, (xg, t)
        td = build_token_dfa(dfa, HAND, HAND_EOS, HAND_V)
        state = 0
        for step in range(3):
            assert td.allowed(state)[HAND_EOS].all() == (step >= 2), (xg, step)
            state = td.step(state, HAND.index(b"a"))


def test_choice_regex():
    choices = ["red", "a.b", "中文", "x|y", "(", "red wine"]
    dfa = compile_regex(choice_regex(choices))
    for s in choices + ["re", "axb", "x", "y", "red win", "中", ""]:
        assert dfa.matches(s.encode()) == (s in choices), s
    with pytest.raises(ValueError):
        choice_regex("abc")


def test_minimal_state_counts():
    n = compile_regex("a*").num_states
    assert n == 1
    for p in ["a*|a*", "(a|a)*", "(a*)*", "a*a*", "(a|)*", "a{0,}"]:
        assert compile_regex(p).num_states == n, p
    assert compile_regex("(ab|ab)c").num_states == compile_regex("abc").num_states == 4
    assert compile_regex("x(a|b)*|y[ab]*").num_states == 2  # both tails merge
    assert compile_regex("[a-z]{0,5}").num_states == 6


UNSUPPORTED = [
    (r"(a)\1", "backreference"), (r"(?P<n>a)(?P=n)", "backreference"), (r"a(?=b)", "lookahead"),
    (r"a(?!b)", "lookahead"), (r"(?<=a)b", "lookbehind"), (r"(?<!a)b", "lookbehind"),
    (r"(a)?(?(1)b|c)", "conditional"), (r"(?i)abc", "inline flags"), (r"(?i:abc)", "inline flags"),
    (r"\bfoo", "word boundary"), (r"a\Bb", r"\B"), (r"\Afoo", r"\A"), (r"foo\Z", r"\Z"),
    (r"a^b", "'^' not at the start"), (r"a|^b", "'^' not at the start"), (r"a$b", "'$' not at the end"),
    (r"a*+", "possessive"), (r"(?>ab)", "atomic group"), (r"(?#note)a", "comment"),
]


@pytest.mark.parametrize("pattern,what", UNSUPPORTED, ids=[p for p, _ in UNSUPPORTED])
def test_unsupported_constructs(pattern, what):
    re.compile(pattern)  # valid Python
    with pytest.raises(RegexUnsupported, match=re.escape(what)):
        compile_regex(pattern)


def test_errors():
    for bad in ["(a", "a**", "[z-a]", "*a", r"\q", "a{3,2}"]:
        with pytest.raises(RegexError):
            compile_regex(bad)
    t = time.perf_counter()
    with pytest.raises(RegexUnsupported, match="too many states"):
        compile_regex("(a|b)*a(a|b){20}", max_states=4096)
    assert time.perf_counter() - t < 10
    assert compile_regex("(a|b)*a(a|b){10}").num_states == 2 ** 11
    with pytest.raises(RegexUnsupported, match="too many states"):
        compile_regex("a{10}", max_states=5)
    with pytest.raises(RegexUnsupported, match="matches no string"):
        compile_regex(r"[^\x00-\U0010ffff]")
    assert compile_regex(r"\ud800|b").num_states == 2  # a lone surrogate has no UTF-8 form: that branch drops
    assert issubclass(RegexUnsupported, ValueError) and issubclass(RegexError, ValueError)


# ----------------------------------------------------------------------------- token DFA

HAND = [b"a", b"b", b"ab", b"ba", b"abc", b"c", b"\xe4", b"\xb8\xad", "中".encode(), "é".encode(), b"\xc3",
        b"\xa9", b"", None, b"<eos>", b"1", b"12", b"x", "😀".encode(), b"\xf0\x9f", b"\x98\x80", b"a\xe4", b"z"]
HAND_V = len(HAND) + 3  # 3 padding ids
HAND_EOS = [HAND.index(b"<eos>"), HAND_V - 1]


def brute_next(dfa, vocab, eos, V):
    """[S, V] int32: the next state of every (state, token) by walking bytes one at a time."""
    S = dfa.num_states
    out = np.full((S, V), -1, np.int32)
    for s in range(S):
        for t in range(V):
            if t in eos:
                out[s, t] = s if dfa.accept[s] else -1
            elif t < len(vocab) and vocab[t]:
                out[s, t] = dfa.walk(vocab[t], s)
    return out


@pytest.mark.parametrize("path", ["one chunk", "chunks", "collisions"])
@pytest.mark.parametrize("pattern", ["(ab|c)*中?é*", "[^a]*", "a+b?", r"\d{1,2}x", "(a|😀)+z", "(<eos>)+z?"])
def test_token_dfa_equals_brute_force(pattern, path, monkeypatch):
    if path == "chunks":  # two states per chunk: the chunked walk and the merge of per-chunk classes
        monkeypatch.setattr(token_dfa, "_CHUNK", 2 * HAND_V)
    if path == "collisions":  # every column hashes alike: the exact fallback decides
        monkeypatch.setattr(token_dfa, "_column_hash", lambda cols: np.zeros(cols.shape[1], np.uint64))
    dfa = compile_regex(pattern)
    td = build_token_dfa(dfa, HAND, HAND_EOS, HAND_V)
    ref = brute_next(dfa, HAND, HAND_EOS, HAND_V)
    assert td.token_class.shape == (HAND_V,) and td.token_class.dtype == np.int32 and td.next.dtype == np.int32
    assert td.num_states == dfa.num_states and (td.accept == dfa.accept).all()
    assert (td.next[:, td.token_class] == ref).all()
    assert td.num_classes == len({tuple(c) for c in ref.T})  # identical columns share a class, only those
    assert td.token_class[0] == 0 and (np.diff(np.unique(td.token_class, return_index=True)[1]) > 0).all()
    masks = td.bitmasks()
    for s in range(td.num_states):
        allowed = ref[s] >= 0
        assert (td.allowed(s) == allowed).all()
        assert (td.bitmask(s) == pack_bool_mask(allowed)).all() and (masks[s] == td.bitmask(s)).all()
        assert (td.allowed(s)[HAND_EOS] == td.accept[s]).all()
        assert not td.allowed(s)[[HAND.index(b""), HAND.index(None), HAND_V - 2, HAND_V - 3]].any()
        for t in range(HAND_V):
            if allowed[t]:
                assert td.step(s, t) == ref[s, t]
            else:
                with pytest.raises(ValueError):
                    td.step(s, t)


def test_token_dfa_large_vocab():
    """A 49152-token random vocabulary (ASCII, whole and partial UTF-8 characters) and a DFA of about
    100 states: the tables agree with a byte walk on a sample of tokens, in all states."""
    rng = np.random.default_rng(0)
    pieces = [bytes([b]) for b in range(32, 127)] + [c.encode() for c in "é中😀ü"] + [b"\xe4", b"\xb8", b"\xc3"]
    vocab = [b"".join(rng.choice(pieces, size=int(k))) for k in rng.integers(1, 9, 49152 - 2)] + [None, b""]
    dfa = compile_regex(r"[a-z ]{0,35}-[^\d-]{0,5}\d{1,20}")
    assert 80 <= dfa.num_states <= 120
    t = time.perf_counter()
    td = build_token_dfa(dfa, vocab, [49152 - 1], 49152)
    took = time.perf_counter() - t
    print(f"build_token_dfa: {dfa.num_states} states, {td.num_classes} classes, {took:.2f} s")
    assert took < 10  # about 0.3 s where measured; the loose bound only guards against a blow-up
    sample = rng.choice(49152, 300, replace=False)
    ref = brute_next(dfa, [vocab[t] if t in set(sample.tolist()) else None for t in range(49152)], [49151], 49152)
    assert (td.next[:, td.token_class[sample]] == ref[:, sample]).all()


# ----------------------------------------------------------------------------- xgrammar

xgrammar = pytest.importorskip("xgrammar")

CHAR_VOCAB = (list("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.-_\"\\\n\t")
              + ["ab", " the", "yes", "no", "é", "中", "文", "😀", "!", b"\xe4", b"\xb8\xad", b"\xf0\x9f", b"\x98\x80", "\xa0", "", "</s>"])
XGR_REGEXES = [r"[a-z ]+", r"\d{1,3}(,\d{3})*", r"(yes|no|maybe)", r"[A-Z][a-z]*( [A-Z][a-z]*)*\.",
               r"[^\"\\]{0,12}", r".{2,9}x?", r"(\s|\w)+\S", choice_regex(["red", "green", "中文", "😀!"])]


def compare_walk(info, pattern, steps=20, seed=0):
    """Walk up to `steps` tokens (seeded choice among the allowed non-stop tokens; a stop token when
    only stop tokens are left; the walk ends at a stop token or where no token is left) and compare the masks of the token DFA and of xgrammar at every step.

    EOS convention: xgrammar allows its stop tokens exactly where the grammar may end, as the token
    DFA allows its EOS ids at accepting states. After a stop token xgrammar terminates (it accepts
    nothing more), whereas the token DFA stays in the accepting state: the walk ends there."""
    V = info.vocab_size
    td = build_token_dfa(compile_regex(pattern, xgrammar=True), vocab_token_bytes(info), info.stop_token_ids, V)
    m = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info, max_threads=1).compile_regex(pattern))
    stops = set(info.stop_token_ids)
    rng = np.random.default_rng(seed)
    bitmask = xgrammar.allocate_token_bitmask(1, V).numpy()
    state = 0
    for step in range(steps):
        m.fill_next_token_bitmask(bitmask)
        want = unpack_bitmask(bitmask[0], V)
        got = td.allowed(state)
        diff = np.flatnonzero(want != got)
        assert diff.size == 0, (pattern, step, [(int(t), bytes(info.decoded_vocab[t]), bool(want[t])) for t in diff[:8]])
        text = [t for t in np.flatnonzero(got) if t not in stops]
        if not got.any():  # a dead end for this vocabulary (the text needs a character no token spells)
            return step
        t = int(rng.choice(text)) if text else int(np.flatnonzero(got)[0])
        assert m.accept_token(t)
        state = td.step(state, t)
        if t in stops:
            assert m.is_terminated() and td.accept[state]
            return step + 1
    return steps


def char_info():
    return xgrammar.TokenizerInfo(CHAR_VOCAB, vocab_size=len(CHAR_VOCAB) + 5, stop_token_ids=[len(CHAR_VOCAB) - 1])


def test_vocab_token_bytes():
    got = vocab_token_bytes(char_info())
    assert len(got) == len(CHAR_VOCAB) + 5 and got[-7:] == [None] * 7  # "", the stop token "</s>", padding
    assert got[:-7] == [c if isinstance(c, bytes) else c.encode() for c in CHAR_VOCAB[:-2]]


@pytest.mark.parametrize("pattern", XGR_REGEXES)
def test_matches_xgrammar_char_vocab(pattern):
    info = char_info()
    for seed in range(3):
        compare_walk(info, pattern, seed=seed)


@pytest.fixture(scope="module")
def smollm2_info():
    from helpers import default_model_or_skip

    from specjax.checkpoint import load_tokenizer
    tok = load_tokenizer(default_model_or_skip())  # CI=true: fails instead of skipping
    return xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=49152)


@pytest.mark.parametrize("pattern", XGR_REGEXES[:6])
def test_matches_xgrammar_smollm2(smollm2_info, pattern):
    compare_walk(smollm2_info, pattern)
