"""Grammar-constrained decoding: compile output constraints with xgrammar, track each request's
parse state on the host, and turn it into token masks that a jitted step applies to the logits.

Masks are xgrammar's packed layout: a row of ``W = ceil(vocab_size / 32)`` int32 words where bit
``j`` of word ``w`` (least significant bit first) allows token ``32 * w + j``.

Flow for one request:

* :class:`GrammarCompiler` (one per engine/tokenizer) turns a constraint key, the
  ``SamplingParams.constraint`` tuple ``(kind, text)``, into a compiled grammar; every distinct key
  is compiled once and kept in a small LRU cache. Bad schemas, regexes, grammars or choices raise
  :class:`GrammarError` (a ``ValueError``).
* :class:`RequestGrammar` holds the request's matcher. The engine feeds it the accepted tokens
  (:meth:`RequestGrammar.accept`) and asks for the mask of the next token
  (:meth:`RequestGrammar.next_mask`) or, for speculative decoding, for one mask per node of a
  draft tree (:meth:`RequestGrammar.tree_masks`).
* specjax.token_mask applies the masks on the device (``apply_bitmask``, re-exported here, sets the
  logits of disallowed tokens to ``-inf``); specjax.grammar_masks builds a batch's masks.
* specjax.grammar_drafts walks the matcher (:attr:`RequestGrammar.matcher`) for the text the
  grammar fixes, spelled with the compiler's token table (:attr:`GrammarCompiler.token_table`).

Once the grammar is finished and a stop token was accepted, the request is over; masks computed
from that state allow the stop tokens only, so a bonus token sampled there is a stop token too.
"""
from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from specjax.token_mask import apply_bitmask  # noqa: F401 - the device op, re-exported here

Constraint = tuple[str, str]  # (kind, canonical text), as SamplingParams.constraint returns it
KINDS = ("json_schema", "regex", "grammar", "choice")
_XGR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?", re.MULTILINE)


class GrammarError(ValueError):
    """The constraint itself is invalid (bad JSON schema, regex, EBNF grammar or choice list)."""


class GrammarStateError(RuntimeError):
    """Internal error: the engine fed a request's grammar a token that the grammar forbids."""


def _xg():
    import xgrammar

    return xgrammar


# ----------------------------------------------------------------------------- packed masks (numpy)

def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words per mask row."""
    return (int(vocab_size) + 31) // 32


def pack_bool_mask(allowed: np.ndarray) -> np.ndarray:
    """bool [..., V] -> packed int32 [..., ceil(V/32)]."""
    allowed = np.asarray(allowed, bool)
    v = allowed.shape[-1]
    pad = np.zeros(allowed.shape[:-1] + (32 * bitmask_width(v) - v,), bool)
    packed = np.packbits(np.concatenate([allowed, pad], -1), axis=-1, bitorder="little")  # [..., 4W] uint8
    return np.ascontiguousarray(packed).view("<i4").astype(np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """packed int32 [..., W] -> bool [..., vocab_size]; tokens beyond 32*W are disallowed."""
    words = np.ascontiguousarray(np.asarray(bitmask, np.int32)).astype("<i4")
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little").astype(bool)  # [..., 32W]
    if bits.shape[-1] >= vocab_size:
        return bits[..., :vocab_size]
    return np.concatenate([bits, np.zeros(bits.shape[:-1] + (vocab_size - bits.shape[-1],), bool)], -1)


def full_mask(vocab_size: int) -> np.ndarray:
    """[W] int32 allowing every token below vocab_size."""
    return pack_bool_mask(np.ones(vocab_size, bool))


def mask_of_tokens(token_ids: Iterable[int], vocab_size: int) -> np.ndarray:
    """[W] int32 allowing exactly token_ids."""
    allowed = np.zeros(vocab_size, bool)
    allowed[np.asarray(list(token_ids), np.int64)] = True
    return pack_bool_mask(allowed)


def _allows(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


# ----------------------------------------------------------------------------- building grammars

def _reason(err: Exception) -> str:
    """xgrammar's message without its log prefix (timestamp, C++ file and line)."""
    return _XGR_LOG_PREFIX.sub("", str(err)).strip()


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _check_schema(text: str) -> None:
    try:
        import jsonschema
    except ImportError:  # optional: xgrammar still rejects schemas it cannot compile
        return

    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid json_schema: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"invalid json_schema: expected a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise GrammarError(f"invalid json_schema at {where}: {e.message}") from None


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """EBNF whose root matches exactly one of the strings (JSON string escapes are valid EBNF)."""
    if isinstance(choices, str) or not choices or any(not isinstance(c, str) or not c for c in choices):
        raise GrammarError(f"invalid choice: expected a non-empty list of non-empty strings, got {choices!r}")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(key: Constraint):
    """xgrammar.Grammar for a constraint key (no tokenizer needed); GrammarError when invalid."""
    xg = _xg()
    if not (isinstance(key, tuple) and len(key) == 2 and key[0] in KINDS and isinstance(key[1], str)):
        raise GrammarError(f"constraint must be a (kind, text) tuple with kind in {KINDS}, got {key!r}")
    kind, text = key
    try:
        if kind == "json_schema":
            _check_schema(text)
            return xg.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xg.Grammar.from_regex(text)
        if kind == "grammar":
            return xg.Grammar.from_ebnf(text)
        try:
            choices = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid choice: not a JSON list ({e})") from None
        return xg.Grammar.from_ebnf(choice_to_ebnf(choices))
    except RuntimeError as e:
        raise GrammarError(f"invalid {kind} {_short(text)!r}: {_reason(e)}") from None


# ----------------------------------------------------------------------------- compiler

class GrammarCompiler:
    """Compiles constraint keys against one tokenizer, once per distinct key (LRU cache).

    ``vocab_size`` is the model's vocabulary size (the logits' last dimension); it may exceed the
    tokenizer's, the extra ids are then never allowed. ``stop_token_ids`` defaults to the
    tokenizer's EOS. ``tokenizer`` is a Hugging Face tokenizer, or an ``xgrammar.TokenizerInfo``
    used as is (its own vocab_size and stop tokens apply).
    """

    def __init__(self, tokenizer, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 max_threads: int = 2, cache_size: int = 256):
        xg = _xg()
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        stops = list(stop_token_ids) if stop_token_ids else None
        if isinstance(tokenizer, xg.TokenizerInfo):  # a vocabulary described directly (tests, custom tokenizers)
            self.tokenizer_info = tokenizer
        else:
            self.tokenizer_info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                    stop_token_ids=stops)
        self._compiler = xg.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations done (cache misses)
        self._token_table = None

    @property
    def token_table(self):
        """The vocabulary's tokens by their bytes (specjax.grammar_drafts.TokenTable), built on first use."""
        with self._lock:
            if self._token_table is None:
                from specjax.grammar_drafts import TokenTable
                self._token_table = TokenTable(self.tokenizer_info)
            return self._token_table

    def compile(self, key: Constraint):
        """The compiled grammar (xgrammar.CompiledGrammar) of a constraint key; GrammarError if invalid."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = build_grammar(key)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise GrammarError(f"cannot compile {key[0]} {_short(key[1])!r}: {_reason(e)}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, key: Constraint, stop_token_ids: Sequence[int] | None = None) -> RequestGrammar:
        """A fresh RequestGrammar for a constraint key."""
        return RequestGrammar(self.compile(key), stop_token_ids, token_table=self.token_table)


# ----------------------------------------------------------------------------- per-request state

def tree_links(parents: np.ndarray, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First-child / next-sibling arrays [R, N] int64 (-1 = none) of trees parents [R, N] (node i's
    parent in [0, i)); the children of skip [R, N] nodes are cut. Vectorised over the R rows."""
    R, n = parents.shape
    first = np.full((R, n), -1, np.int64)
    sibling = np.full((R, n), -1, np.int64)
    last = np.full((R, n), -1, np.int64)
    rows = np.arange(R)
    for i in range(1, n):
        p = parents[:, i]
        keep = ~skip[rows, p]
        older = keep & (first[rows, p] >= 0)  # p has a child already: i is its last child's sibling
        new = keep & ~older
        first[rows[new], p[new]] = i
        sibling[rows[older], last[rows[older], p[older]]] = i
        last[rows[keep], p[keep]] = i
    return first, sibling


def _sibling_links(parents: np.ndarray, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tree_links of one tree: first-child / next-sibling arrays [N] int64 of parents [N]."""
    first, sibling = tree_links(parents[None], skip[None])
    return first[0], sibling[0]


def bad_trees(tokens: np.ndarray, parents: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R] bool: rows of tokens / parents [R, N] that are no tree (node 0 the root, parent of node i
    in [0, i), draft tokens in the vocabulary)."""
    n = tokens.shape[1]
    bad = (parents[:, 0] != -1) | np.any(parents[:, 1:] < 0, axis=1) | np.any(parents[:, 1:] >= np.arange(1, n), axis=1)
    return bad | np.any(tokens[:, 1:] < 0, axis=1) | np.any(tokens[:, 1:] >= vocab_size, axis=1)


def settle_tree_masks(tokens: np.ndarray, parents: np.ndarray, stop: np.ndarray, terminated: np.ndarray,
                      stop_masks: np.ndarray, out: np.ndarray) -> None:
    """After the traversals: zero the rows of unreachable nodes (illegal after their parent, or
    below such a node) and give stop-token nodes and the roots of terminated grammars the stop
    masks. tokens, parents, stop [R, N]; terminated [R]; stop_masks [R, W]; out [R, N, W]."""
    R, n = tokens.shape
    rows = np.arange(R)
    out[terminated, 0] = stop_masks[terminated]
    legal = np.zeros((R, n), bool)
    legal[:, 0] = True
    for i in range(1, n):  # parents come first: their rows are final when a child reads them
        p, t = parents[:, i], tokens[:, i]
        word = out[rows, p, t >> 5]
        legal[:, i] = legal[rows, p] & ((word >> (t & 31)) & 1).astype(bool)
        out[~legal[:, i], i] = 0
        s = legal[:, i] & stop[:, i]
        out[s, i] = stop_masks[s]


def stop_nodes(grammars, tokens: np.ndarray) -> np.ndarray:
    """[R, N] bool: nodes holding one of their row's stop tokens (never the root)."""
    stop = np.zeros(tokens.shape, bool)
    groups: dict[tuple, list[int]] = {}
    for r, g in enumerate(grammars):
        groups.setdefault(g.stop_token_ids, []).append(r)
    for ids, rs in groups.items():
        stop[rs] = np.isin(tokens[rs], ids)
    stop[:, 0] = False
    return stop


class RequestGrammar:
    """One request's position in its grammar.

    The matcher's state is "after the last accepted token". ``stop_token_ids`` (the request's EOS
    ids) end the grammar; None keeps the compiler's. Rollback is unlimited in xgrammar 0.2.8
    (its ``max_rollback_tokens`` is deprecated and only warns), so tree traversals need no setting.
    ``token_table``: the vocabulary's tokens by their bytes, for grammar drafts
    (specjax.grammar_drafts; None: built from the tokenizer on first use).
    """

    def __init__(self, compiled, stop_token_ids: Sequence[int] | None = None, token_table=None):
        xg = _xg()
        self.tokenizer_info = compiled.tokenizer_info
        self.token_table = token_table
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.width = bitmask_width(self.vocab_size)
        stops = [int(t) for t in stop_token_ids] if stop_token_ids else None
        if stops and not all(0 <= t < self.vocab_size for t in stops):
            raise ValueError(f"stop_token_ids must lie in [0, {self.vocab_size}), got {stops}")
        self._matcher = xg.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.stop_token_ids = tuple(int(t) for t in self._matcher.stop_token_ids)
        self.stop_mask = mask_of_tokens(self.stop_token_ids, self.vocab_size)  # [W]
        self.num_accepted = 0

    @property
    def matcher(self):
        """The xgrammar.GrammarMatcher (state after the last accepted token); walks that accept
        tokens must roll them back."""
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """True when the tokens so far form a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def accept(self, tokens: Iterable[int]) -> None:
        """Advance by tokens the engine accepted. Stop tokens after termination are ignored; any
        other token the grammar forbids raises GrammarStateError (verification never accepts one)."""
        tokens = [int(t) for t in tokens]
        k, _ = self.advance(tokens)
        for t in tokens[k:]:  # after the end
            if t not in self.stop_token_ids:
                raise GrammarStateError(f"grammar (terminated) rejected token {t} after {self.num_accepted} "
                                        "accepted tokens; masked verification should never accept it")

    def advance(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """Accept tokens up to the one that ends the grammar: (tokens taken, terminated). A token the
        grammar forbids raises GrammarStateError (num_accepted counts the tokens taken before it).
        Two matcher calls per token (the engine's accept path)."""
        m = self._matcher
        if m.is_terminated():
            return 0, True
        for i, t in enumerate(tokens):
            t = int(t)
            if not 0 <= t < self.vocab_size or not m.accept_token(t):
                raise GrammarStateError(f"grammar (active) rejected token {t} after {self.num_accepted} "
                                        "accepted tokens; masked verification should never accept it")
            self.num_accepted += 1
            if m.is_terminated():
                return i + 1, True
        return len(tokens), False

    def next_mask(self, out: np.ndarray | None = None) -> np.ndarray:
        """Fill (and return) out [W] int32 with the tokens allowed next."""
        if out is None:
            out = np.empty(self.width, np.int32)
        if out.shape != (self.width,) or out.dtype != np.int32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous int32 array of shape ({self.width},), got "
                             f"{out.dtype} {out.shape}")
        if self.is_terminated:
            out[:] = self.stop_mask
        else:
            self._matcher.fill_next_token_bitmask(out)
        return out

    def tree_masks(self, tokens: np.ndarray, parents: np.ndarray, *, native: bool = True) -> np.ndarray:
        """Masks [N, W] int32 for a draft tree (tokens [N], parents [N], node 0 = the root).

        Row i allows the tokens that may follow the path root..i; the root is already in the
        matcher. A node whose token is illegal after its parent, and every node below it, gets an
        all-zero row; a node that accepts a stop token (the grammar ends there) allows only the
        stop tokens. The matcher's state is unchanged afterwards. ``native`` uses xgrammar's C++
        traversal when it exists; False walks the tree in Python (accept + rollback). A batch of
        rows: specjax.grammar_masks (the same steps, vectorised over the rows).
        """
        tokens = np.asarray(tokens).astype(np.int64)
        parents = np.asarray(parents).astype(np.int64)
        if tokens.ndim != 1 or parents.shape != tokens.shape or tokens.shape[0] < 1:
            raise ValueError(f"tree_masks wants tokens [N] and parents [N], got {tokens.shape} and {parents.shape}")
        if bad_trees(tokens[None], parents[None], self.vocab_size)[0]:
            raise ValueError(f"not a draft tree: parents must be -1 for node 0 and in [0, i) for node i, draft "
                             f"tokens in [0, {self.vocab_size}); got parents {parents.tolist()}, tokens {tokens.tolist()}")
        out = np.zeros((1, tokens.shape[0], self.width), np.int32)
        stop = stop_nodes([self], tokens[None])
        first, sibling = tree_links(parents[None], stop)  # nothing is walked below a stop token
        self.traverse(first[0], sibling[0], tokens, stop[0], out[0], native=native)
        settle_tree_masks(tokens[None], parents[None], stop, np.array([self.is_terminated]), self.stop_mask[None], out)
        return out[0]

    def traverse(self, first: np.ndarray, sibling: np.ndarray, tokens: np.ndarray, stop: np.ndarray,
                 out: np.ndarray, *, native: bool = True) -> None:
        """Fill out [N, W] (zeros) with the masks of the tree's reachable non-stop nodes (first /
        sibling links [N] int64 with stop nodes' children cut, tokens [N] int64, stop [N] bool);
        nothing for a terminated grammar. The rest is settle_tree_masks' work."""
        if self.is_terminated:
            return
        if native and hasattr(self._matcher, "traverse_draft_tree"):
            self._matcher.traverse_draft_tree(first, sibling, tokens, out)
        else:
            self._walk(0, tokens, stop, first, sibling, out)

    def _walk(self, node: int, tokens: np.ndarray, stop: np.ndarray, first: np.ndarray,
              sibling: np.ndarray, out: np.ndarray) -> None:
        """Depth-first: fill node's row, then visit each non-stop child that the matcher accepts
        (stop-token rows are written by settle_tree_masks)."""
        self._matcher.fill_next_token_bitmask(out, node)
        child = int(first[node])
        while child >= 0:
            token = int(tokens[child])
            if not stop[child] and _allows(out[node], token) and self._matcher.accept_token(token):
                self._walk(child, tokens, stop, first, sibling, out)
                self._matcher.rollback(1)
            child = int(sibling[child])
