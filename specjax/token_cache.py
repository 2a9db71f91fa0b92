"""Prompt tokenization with a cache of the segments between added tokens (a shared system prompt is
tokenized once, not on every request).

HF `tokenizers` first splits the text on the added vocabulary (`<|im_start|>`, `<|im_end|>`, ...:
leftmost-longest match), then normalizes, pre-tokenizes and runs the model on each other piece on
its own, then post-processes. So the ids of a text are the ids of its pieces concatenated, provided
the pieces are split exactly as tokenizers splits them and nothing in the pipeline looks beyond a
piece. PromptEncoder checks the second at construction (`qualifies`) and otherwise encodes the plain
way: the ids are the same on both paths, only the time differs. `info` says which path runs.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

MAX_CHARS = 1 << 20  # cached piece text in all (about 10 MB with the ids)
MIN_CHARS = 64  # shorter pieces are encoded each time (cheap; they would only churn the cache)
# probes run both ways at construction: empty pieces, adjacent / repeated tokens, whitespace, digits
_PROBES = ("", " ", "a", "\n", "Hi there!", " 12 ab \n\n", "x  y", "é 中文 🙂")


def _metaspace_first(node) -> bool:
    """Whether a pre-tokenizer (JSON, nested Sequences) has a Metaspace that prepends only at offset 0
    of the whole text (prepend_scheme "first"): a piece encoded alone would get the prefix too."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return True
        return any(_metaspace_first(v) for v in node.values())
    if isinstance(node, list):
        return any(_metaspace_first(v) for v in node)
    return False


def _splitter(contents):
    """A regex matching the added tokens leftmost-longest, as tokenizers' Aho-Corasick trie does (the
    alternatives longest first: of the tokens matching at one position, the longest wins)."""
    if not contents:
        return None
    return re.compile("|".join(re.escape(c) for c in sorted(set(contents), key=len, reverse=True)))


class PromptEncoder:
    """`encode(text)` == `tokenizer.encode(text, add_special_tokens=False)` (how specjax tokenizes
    prompts), with the pieces between added tokens of a qualifying fast tokenizer looked up in an LRU
    cache keyed by their text (bounded to max_chars of text; pieces under min_chars not cached)."""

    def __init__(self, tokenizer, max_chars: int = MAX_CHARS, min_chars: int = MIN_CHARS):
        self.tokenizer, self.max_chars, self.min_chars = tokenizer, max_chars, min_chars
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # LLM.generate's thread and the server's loop may both encode
        self.hits = self.misses = 0
        self._rust = getattr(tokenizer, "_tokenizer", None)
        why = self._disqualify()
        self.cached = why is None
        self.info = ("cached per segment between added tokens" if self.cached
                     else f"plain (no segment cache: {why})")

    def _disqualify(self) -> str | None:
        """None where splitting on the added tokens gives the plain ids, else why not."""
        rust = self._rust
        if rust is None or not hasattr(rust, "get_added_tokens_decoder"):
            return "not a HF fast tokenizer"
        if getattr(self.tokenizer, "split_special_tokens", False):
            return "split_special_tokens is on (special tokens are encoded as text)"
        added = list(rust.get_added_tokens_decoder().values())
        odd = [t.content for t in added if t.lstrip or t.rstrip or t.single_word or not t.content]
        if odd:
            return f"added token(s) with lstrip / rstrip / single_word: {odd[:3]}"
        if rust.normalizer is not None and any(t.normalized for t in added):
            return "normalized added tokens under a normalizer (matched in normalized text)"
        pre = rust.pre_tokenizer
        if pre is not None and _metaspace_first(json.loads(pre.__getstate__())):
            return "a Metaspace pre-tokenizer with prepend_scheme 'first' (depends on the text's start)"
        if rust.encode("", add_special_tokens=False).ids:
            return "the post-processor adds tokens with add_special_tokens=False"
        # tokenizers splits on the non-normalized tokens first, then on the normalized ones
        self._passes = [p for p in (_splitter([t.content for t in added if not t.normalized]),
                                    _splitter([t.content for t in added if t.normalized])) if p]
        self._ids = {t.content: rust.token_to_id(t.content) for t in added}
        specials = [t.content for t in added][:4] or [""]
        for probe in _PROBES:  # a last check, the whole pipeline both ways
            text = probe.join(specials + [probe, probe + specials[0] * 2 + probe])
            if self._split_encode(text) != self._plain(text):
                return f"probe {text!r} differs"
        self._cache.clear()
        self._chars = 0
        return None

    def _plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids (add_special_tokens=False)."""
        # the transformers wrapper turns truncation / padding off for its own calls; where another
        # caller left them on in the backend, a direct call would be cut or padded: plain path
        if not self.cached or self._rust.truncation is not None or self._rust.padding is not None:
            return self._plain(text)
        return self._split_encode(text)

    def _pieces(self, text: str, passes) -> list[str]:
        """text split on the added tokens of passes[0], then the rest on those of passes[1]; added
        tokens are kept as pieces of their own (looked up in _ids), empty pieces dropped."""
        if not passes:
            return [text] if text else []
        out, at = [], 0
        for m in passes[0].finditer(text):
            out += self._pieces(text[at:m.start()], passes[1:])
            out.append(m.group())
            at = m.end()
        return out + self._pieces(text[at:], passes[1:])

    def _split_encode(self, text: str) -> list[int]:
        pieces = self._pieces(text, self._passes)
        out: list[tuple[int, ...] | None] = [None] * len(pieces)
        todo = []
        for i, piece in enumerate(pieces):
            tok = self._ids.get(piece)
            out[i] = (tok,) if tok is not None else self._lookup(piece)
            if out[i] is None:
                todo.append(i)
        if todo:  # one encode_batch call: it releases the GIL (encode does not), so the engine's thread
            #       keeps dispatching while a long prompt is tokenized in the server's thread
            encs = self._rust.encode_batch([pieces[i] for i in todo], add_special_tokens=False)
            for i, enc in zip(todo, encs):
                out[i] = tuple(enc.ids)
                self._store(pieces[i], out[i])
        return [t for ids in out for t in ids]

    def _cacheable(self, piece: str) -> bool:
        return self.min_chars <= len(piece) <= self.max_chars

    def _lookup(self, piece: str) -> tuple[int, ...] | None:
        """The cached ids of a text without added tokens (None: not cached)."""
        if not self._cacheable(piece):
            return None
        with self._lock:
            got = self._cache.get(piece)
            if got is None:
                self.misses += 1
            else:
                self._cache.move_to_end(piece)
                self.hits += 1
            return got

    def _store(self, piece: str, ids: tuple[int, ...]) -> None:
        if not self._cacheable(piece):
            return
        with self._lock:
            if piece not in self._cache:
                self._cache[piece] = ids
                self._chars += len(piece)
                while self._chars > self.max_chars:  # least recently used first
                    old, _ = self._cache.popitem(last=False)
                    self._chars -= len(old)

    def cache_chars(self) -> int:
        """Characters of piece text held in the cache (<= max_chars)."""
        return self._chars
