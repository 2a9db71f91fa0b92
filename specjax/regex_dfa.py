"""Regular expressions compiled to small byte-level DFAs, for constrained decoding on the device.

`compile_regex(pattern)` gives a :class:`ByteDFA` for the UTF-8 encodings of the strings ``text``
with ``re.fullmatch(pattern, text, re.ASCII)`` (Python's ``re`` on str); state 0 is the start:

    trans  [S, 256] int32   next state after a byte (-1: no transition, the text cannot match)
    accept [S] bool         the bytes so far form a complete match

Every state can reach an accepting state (a walk that never meets -1 can be completed); the DFA is
minimal, its states numbered in discovery order. Pipeline: parse (recursive descent) -> Thompson NFA
over bytes (code-point sets become sequences of UTF-8 byte ranges) -> subset construction ->
Hopcroft minimization (missing transitions go to a sink; the states that cannot reach acceptance
join the sink's block and are dropped with it) -> renumbering.

Supported: literals (any Unicode character), escapes (``\\d \\w \\s \\D \\W \\S`` with their ASCII
meaning as under ``re.ASCII``: ``[0-9]``, ``[A-Za-z0-9_]``, ``[ \\t\\n\\r\\f\\v]``; ``\\n \\t \\r \\f
\\v \\a \\0``, octal, ``\\xHH \\uHHHH \\UHHHHHHHH \\N{name}``, escaped metacharacters), ``.`` (any
character but ``\\n``), classes ``[...]`` (ranges, negation, escapes), groups ``(...)``, ``(?:...)``,
``(?P<name>...)``, alternation, the quantifiers ``* + ? {m} {m,} {m,n} {,n}`` and their lazy forms
(same language), ``^`` as the pattern's first and ``$`` as its last character (no-ops: the match is
a full match). Anything else (backreferences, lookaround, conditionals, inline flags, atomic groups,
possessive quantifiers, ``\\b \\B \\A \\Z``, anchors elsewhere) raises :class:`RegexUnsupported`;
a pattern Python rejects raises :class:`RegexError`.

``xgrammar=True`` takes xgrammar's meaning (``xgrammar.Grammar.from_regex``) where it differs from
Python's and the difference is cheap to follow: ``.`` matches every character (``\\n`` included),
``\\s`` also matches U+00A0 (``\\S`` then excludes it), and sets spanning surrogate code points
(U+D800..U+DFFF: ``.``, negated classes) match their 3-byte encodings (ED A0..BF 80..BF), which
xgrammar's matcher allows although they are not valid UTF-8.
"""
from __future__ import annotations

import dataclasses
import re
import unicodedata
import warnings

import numpy as np

__all__ = ["ByteDFA", "RegexError", "RegexUnsupported", "choice_regex", "compile_regex"]

MAX_CP = 0x10FFFF
_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32))  # \t \n \v \f \r and space
_SPACE_XGR = ((9, 13), (32, 32), (0xA0, 0xA0))
_SIMPLE = {"a": 7, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "\\": 92}
_NAMED = {"A": r"\A anchor", "Z": r"\Z anchor", "b": r"word boundary \b", "B": r"\B (not a word boundary)"}
_GROUPS = [("P=", "backreference (?P=name)"), ("=", "lookahead (?=...)"), ("!", "lookahead (?!...)"),
           ("<=", "lookbehind (?<=...)"), ("<!", "lookbehind (?<!...)"), ("(", "conditional (?(...)...)"),
           (">", "atomic group (?>...)"), ("#", "comment (?#...)")]
_OCT = "01234567"
_BRACE = re.compile(r"\{([0-9]*)(?:(,)([0-9]*))?\}")  # Python's digits here are ASCII


class RegexError(ValueError):
    """The pattern is not a valid Python regular expression."""


class RegexUnsupported(ValueError):
    """The pattern uses a construct this compiler does not handle, or its DFA is too large."""


@dataclasses.dataclass
class ByteDFA:
    trans: np.ndarray  # [S, 256] int32 next state per byte, -1 = none
    accept: np.ndarray  # [S] bool accepting states

    @property
    def num_states(self) -> int:
        return int(self.trans.shape[0])

    def walk(self, data: bytes, state: int = 0) -> int:
        """The state after the bytes of data from state (-1 once a byte has no transition)."""
        for b in data:
            state = int(self.trans[state, b]) if state >= 0 else -1
        return state

    def matches(self, data: bytes) -> bool:
        """Whether data (UTF-8 bytes) is in the language."""
        return (s := self.walk(data)) >= 0 and bool(self.accept[s])


def choice_regex(choices: list[str]) -> str:
    """A pattern matching exactly one of the (non-empty list of) strings."""
    if isinstance(choices, str) or not choices or any(not isinstance(c, str) for c in choices):
        raise ValueError(f"choices must be a non-empty list of strings, got {choices!r}")
    return "|".join(re.escape(c) for c in choices)


# ----------------------------------------------------------------------------- code-point sets

def _negate(ranges) -> tuple:
    """The complement in 0..MAX_CP of a set of (lo, hi) code-point ranges."""
    out, nxt = [], 0
    for lo, hi in sorted(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    return tuple(out + [(nxt, MAX_CP)] if nxt <= MAX_CP else out)


def _utf8_split(lo: int, hi: int) -> list[tuple]:
    """Byte-range sequences ((b0lo, b0hi), (b1lo, b1hi), ...) whose byte strings are exactly the UTF-8
    encodings of the code points lo..hi (same encoded length; surrogates in their 3-byte form): the
    range is cut until below each continuation byte position it spans the whole 0x80..0xBF."""
    for i in (1, 2, 3):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                return _utf8_split(lo, lo | m) + _utf8_split((lo | m) + 1, hi)
            if hi & m != m:
                return _utf8_split(lo, (hi & ~m) - 1) + _utf8_split(hi & ~m, hi)
    return [tuple(zip(chr(lo).encode("utf-8", "surrogatepass"), chr(hi).encode("utf-8", "surrogatepass")))]


def _utf8_seqs(ranges, surrogates: bool = False) -> list[tuple]:
    """The byte-range sequences of a code-point set. Surrogates have no UTF-8 form: dropped, or with
    surrogates=True spelled as other 3-byte code points (ED A0..BF 80..BF), as xgrammar's classes do."""
    seqs = []
    for lo, hi in ranges:
        for a, b in ((lo, hi),) if surrogates else ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
            for cut_lo, cut_hi in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CP)):
                if max(a, cut_lo) <= min(b, cut_hi):
                    seqs += _utf8_split(max(a, cut_lo), min(b, cut_hi))
    return seqs


# ----------------------------------------------------------------------------- parser

class _Parser:
    """Recursive descent over a pattern that re.compile accepted (so no syntax errors are left to
    find), following Python's reading of it. AST: ("set", code-point ranges) | ("cat", [node]) |
    ("alt", [node]) | ("rep", node, lo, hi or None)."""

    def __init__(self, pattern: str, xgrammar: bool):
        self.p, self.i = pattern, 0
        self.sets = {"d": _DIGIT, "w": _WORD, "s": _SPACE_XGR if xgrammar else _SPACE}
        self.dot = ((0, MAX_CP),) if xgrammar else ((0, 9), (11, MAX_CP))

    def unsupported(self, what: str, at: int):
        raise RegexUnsupported(f"regex {self.p!r}: {what} (at {at}) is not supported")

    def peek(self, text: str) -> bool:
        return self.p.startswith(text, self.i)

    def alt(self):
        items = [self.cat()]
        while self.peek("|"):
            self.i += 1
            items.append(self.cat())
        return items[0] if len(items) == 1 else ("alt", items)

    def cat(self):
        items = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            at, c = self.i, self.p[self.i]
            self.i += 1
            if c in "^$":  # allowed as the pattern's first / last character only, where they are no-ops
                if at != (0 if c == "^" else len(self.p) - 1):
                    self.unsupported(f"'{c}' not at the {'start' if c == '^' else 'end'}", at)
                continue
            if c == "(":
                atom = self.group(at)
            else:
                atom = ("set", self.dot if c == "." else self.char_class() if c == "[" else self.one(c, False))
            items.append(self.quantified(atom))
        return ("cat", items)

    def group(self, at: int):
        """The group whose '(' was just read."""
        if self.peek("?:"):
            self.i += 2
        elif self.peek("?P<"):
            self.i = self.p.index(">", self.i) + 1
        elif self.peek("?"):
            rest = self.p[self.i + 1:]
            self.unsupported(next((w for k, w in _GROUPS if rest.startswith(k)), "inline flags (?flags)"), at)
        node = self.alt()
        self.i += 1  # ')'
        return node

    def quantified(self, atom):
        at, brace = self.i, _BRACE.match(self.p, self.i)
        if self.i < len(self.p) and self.p[self.i] in "*+?":
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[self.p[self.i]]
            self.i += 1
        elif brace and brace.group(0) != "{}":  # otherwise the '{' is a literal, as in Python
            lo = int(brace.group(1) or 0)
            hi = (int(brace.group(3)) if brace.group(3) else None) if brace.group(2) else lo
            self.i = brace.end()
        else:
            return atom
        if self.peek("+"):
            self.unsupported("possessive quantifier", at)
        self.i += self.peek("?")  # lazy: the same language
        return ("rep", atom, lo, hi)

    def one(self, c: str, in_class: bool) -> tuple:
        """Code-point ranges of the character c just read (an escape when c is a backslash)."""
        return self.escape(in_class) if c == "\\" else ((ord(c), ord(c)),)

    def escape(self, in_class: bool) -> tuple:
        """Code-point ranges of the escape whose backslash was just read."""
        p, at = self.p, self.i - 1
        c = p[self.i]
        self.i = j = self.i + 1
        if c.lower() in self.sets:
            return self.sets[c] if c in self.sets else _negate(self.sets[c.lower()])
        if c in _NAMED and not (in_class and c == "b"):
            self.unsupported(_NAMED[c], at)
        if c in _SIMPLE or c == "b":
            v = _SIMPLE.get(c, 8)  # in a class, \b is a backspace
        elif c in "xuU":  # exactly 2, 4 or 8 hex digits
            j += {"x": 2, "u": 4, "U": 8}[c]
            v = int(p[self.i:j], 16)
        elif c == "N":
            j = p.index("}", j) + 1
            v = ord(unicodedata.lookup(p[self.i + 1:j - 1]))
        elif c in "0123456789":  # octal (\0 and up to 2 more digits, 3 digits, up to 3 in a class) or a group
            while j < len(p) and j - self.i < 2 and p[j] in _OCT:
                j += 1
            if not (c in _OCT and (in_class or c == "0" or j - self.i == 2)):
                self.unsupported(f"backreference \\{c}", at)
            v = int(p[self.i - 1:j], 8)
        else:
            v = ord(c)
        self.i = j
        return ((v, v),)

    def char_class(self) -> tuple:
        """Code-point ranges of the class whose '[' was just read (as in Python, a ']' first and a
        '-' first or last are literals)."""
        negate = self.peek("^")
        self.i += negate
        ranges: list = []
        while not (self.peek("]") and ranges):
            self.i += 1
            item = self.one(self.p[self.i - 1], True)
            if self.peek("-") and not self.peek("-]"):  # a range of two characters
                self.i += 2
                item = ((item[0][0], self.one(self.p[self.i - 1], True)[0][1]),)
            ranges += item
        self.i += 1
        return _negate(ranges) if negate else tuple(ranges)


# ----------------------------------------------------------------------------- NFA

class _NFA:
    """Thompson NFA over bytes: per state its epsilon targets and its (lo, hi, target) byte edges."""

    def __init__(self, limit: int, pattern: str, surrogates: bool = False):
        self.eps, self.edges, self.limit, self.pattern = [], [], limit, pattern
        self.surrogates = surrogates  # code-point sets keep their surrogates (_utf8_seqs)

    def new(self) -> int:
        if len(self.eps) >= self.limit:
            raise RegexUnsupported(f"regex {self.pattern!r}: more than {self.limit} NFA states (too many states)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def then(self, cur: int, node) -> int:
        """Append a fresh copy of node's fragment after state cur; its end state."""
        a, b = self.build(node)
        self.eps[cur].append(a)
        return b

    def build(self, node) -> tuple[int, int]:
        """(start, end) states of a fresh copy of node's fragment."""
        kind, s = node[0], self.new()
        if kind == "set":
            e = self.new()
            for seq in _utf8_seqs(node[1], self.surrogates):  # a chain of byte ranges per sequence, from s to e
                cur = s
                for lo, hi in seq[:-1]:
                    self.edges[cur].append((lo, hi, cur := self.new()))
                self.edges[cur].append((*seq[-1], e))
            return s, e
        if kind == "alt":
            e = self.new()
            for item in node[1]:
                self.eps[self.then(s, item)].append(e)
            return s, e
        cur = s
        for item in node[1] if kind == "cat" else [node[1]] * node[2]:  # the items, or lo copies
            cur = self.then(cur, item)
        if kind == "cat":
            return s, cur
        _, sub, lo, hi = node
        e = self.new()
        for _ in range(hi - lo if hi is not None else 0):  # hi - lo optional copies, each may leave
            self.eps[cur].append(e)
            cur = self.then(cur, sub)
        if hi is None:  # a loop: from cur, run sub again or leave
            self.eps[self.then(cur, sub)].append(cur)
        self.eps[cur].append(e)
        return s, e


def _subset(nfa: _NFA, start: int, final: int, max_states: int, pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction: (trans [S, 256] int32, accept [S] bool)."""
    memo: dict[int, frozenset] = {}

    def closure1(q: int) -> frozenset:  # the states reached from q by epsilon moves
        if q not in memo:
            seen, stack = {q}, [q]
            while stack:
                for t in nfa.eps[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            memo[q] = frozenset(seen)
        return memo[q]

    first = closure1(start)
    index, sets, rows = {first: 0}, [first], []
    while len(rows) < len(sets):
        edges = [e for q in sets[len(rows)] for e in nfa.edges[q]]
        row = np.full(256, -1, np.int32)
        cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
        for lo, end in zip(cuts, cuts[1:]):  # bytes [lo, end) behave alike
            if not (targets := {t for a, b, t in edges if a <= lo <= b}):
                continue
            to = frozenset().union(*(closure1(t) for t in targets))
            if to not in index:
                if len(sets) >= max_states:
                    raise RegexUnsupported(f"regex {pattern!r}: more than {max_states} DFA states (too many states)")
                index[to] = len(sets)
                sets.append(to)
            row[lo:end] = index[to]
        rows.append(row)
    return np.stack(rows), np.array([final in q for q in sets], bool)


# ----------------------------------------------------------------------------- DFA clean-up

def _hopcroft(T: np.ndarray, accept: np.ndarray) -> np.ndarray:
    """Block id [S] of each state of a complete DFA T [S, K] (K byte classes): equal ids = equivalent."""
    S, K = T.shape
    block = accept.astype(np.int64)
    members = [set(np.flatnonzero(~accept).tolist()), set(np.flatnonzero(accept).tolist())]
    orders = [np.argsort(T[:, c], kind="stable") for c in range(K)]  # per byte class: states by target,
    pre = [(o, np.searchsorted(T[o, c], np.arange(S + 1))) for c, o in enumerate(orders)]  # each target's run
    work = {0 if len(members[0]) <= len(members[1]) else 1} if members[0] and members[1] else set()
    while work:
        A = np.fromiter(members[work.pop()], np.int64)
        for order, starts in pre:
            lens = starts[A + 1] - starts[A]
            if not lens.sum():
                continue
            X = order[np.repeat(starts[A] - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())]  # preimage
            X = X[np.argsort(block[X], kind="stable")]
            for hit in np.split(X, np.flatnonzero(np.diff(block[X])) + 1):  # X's states per block
                b = int(block[hit[0]])
                if len(hit) == len(members[b]):
                    continue
                members[b] -= (new := set(hit.tolist()))
                members.append(new)
                block[hit] = nb = len(members) - 1
                work.add(nb if b in work or len(new) <= len(members[b]) else b)
    return block


def _minimize(trans: np.ndarray, accept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The minimal DFA of trans / accept (start 0), states numbered by their first state in trans. The
    states that cannot reach an accepting state join the sink's (missing transitions) block and are
    dropped with it: transitions to them become -1. An empty language leaves no state."""
    S = trans.shape[0]
    _, rep = np.unique(trans.T, axis=0, return_index=True)  # one byte per class of bytes that act alike
    T = np.where(trans[:, rep] >= 0, trans[:, rep], S)  # [S, K] with a sink state S for "no transition"
    T = np.concatenate([T, np.full((1, T.shape[1]), S)]).astype(np.int64)
    block = _hopcroft(T, np.append(accept, False))
    blocks, first = np.unique(block[:S], return_index=True)  # each block's first state
    order = np.argsort(first)
    keep = order[blocks[order] != block[S]]  # by first state, the sink's block left out
    lut = np.full(int(block.max()) + 1, -1, np.int32)
    lut[blocks[keep]] = np.arange(keep.shape[0])
    return lut[block[np.where(trans >= 0, trans, S)[first[keep]]]], accept[first[keep]]


# ----------------------------------------------------------------------------- entry point

def compile_regex(pattern: str, max_states: int = 4096, *, xgrammar: bool = False) -> ByteDFA:
    """The minimal ByteDFA of pattern (full-match semantics over UTF-8 bytes, see the module
    docstring). Raises RegexError (invalid pattern), RegexUnsupported (a construct not handled,
    more than max_states DFA states, or a pattern that matches no string)."""
    if not isinstance(pattern, str):  # (re.compile takes bytes too)
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            re.compile(pattern)
    except (re.error, OverflowError) as e:
        raise RegexError(f"invalid regex {pattern!r}: {e}") from None
    nfa = _NFA(max(64 * max_states, 1 << 16), pattern, surrogates=xgrammar)
    start, final = nfa.build(_Parser(pattern, xgrammar).alt())
    trans, accept = _minimize(*_subset(nfa, start, final, max_states, pattern))
    if not accept.shape[0]:
        raise RegexUnsupported(f"regex {pattern!r} matches no string (as UTF-8 text)")
    return ByteDFA(np.ascontiguousarray(trans, np.int32), np.ascontiguousarray(accept, bool))
