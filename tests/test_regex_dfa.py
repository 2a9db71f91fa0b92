"""Regexes compiled to byte DFAs (specjax.regex_dfa).

* languages: for patterns covering every supported construct, the DFA walked over the UTF-8 bytes
  of a string accepts it exactly when ``re.fullmatch(p, s, re.ASCII)`` matches; strings are random
  (the pattern's characters, multi-byte ones), taken from random walks of the DFA (each must be
  valid UTF-8) and mutated by one character. Every DFA is minimal (an independent Moore refinement
  merges no states), every state is reachable and can reach an accepting state;
* errors: unsupported constructs name themselves, invalid patterns, too many states, no string.
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from specjax.regex_dfa import RegexError, RegexUnsupported, choice_regex, compile_regex

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
