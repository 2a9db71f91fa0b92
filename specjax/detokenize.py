"""Incremental detokenization: the text of a growing token list in O(new tokens) per update.

Decoding the whole output again for every new token costs O(n) per token, O(n^2) per request.
`IncrementalDetokenizer` decodes a short window instead: the tokens since `read` (not yet turned
into text) after a few tokens of context [prefix, read) whose text is known:

    text(ids[read:]) = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

The context makes the window decode like the whole sequence where a token's text depends on its
neighbours (a leading space dropped at the start of a decode, bytes of one character split over
byte-fallback / byte-level tokens). A window ending in U+FFFD ends in an incomplete UTF-8
character: that text is kept as `tail`, not committed, and decoded again with the next tokens.
So is the text of an open run of byte-fallback tokens (a ByteFallback decoder turns a run that is
not valid UTF-8 into one U+FFFD per byte, its complete characters included). Committed text never
changes, so callers can search and stream it once.

Exact (text == tokenizer.decode(ids, skip_special_tokens=True) after every update) for tokenizers
whose decode is local: every `tokenizers` decoder (byte-level BPE, metaspace / SentencePiece with
byte fallback, WordPiece, word level; skipped special tokens decode to nothing). A decode that
rewrites text across tokens (transformers' clean_up_tokenization_spaces, which it applies to
non-BPE tokenizers) can change the window's context: when that is seen, the sequence falls back to
decoding all of its tokens on every update (exact, O(n)) and a warning says so.
"""
from __future__ import annotations

import logging
import weakref

log = logging.getLogger(__name__)

MAX_CONTEXT = 16  # context tokens the window may grow to before it is re-anchored
CONTEXT = 4  # context tokens kept when re-anchoring
_warned: set[str] = set()


def decoder(tokenizer):
    """ids -> text, equal to tokenizer.decode(ids, skip_special_tokens=True). A transformers fast
    tokenizer that does not clean up spaces decodes with its `tokenizers` backend directly (what its
    decode does, without the Python overhead of ~10 us a call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def run_ids(tokenizer) -> frozenset[int]:
    """With a ByteFallback decoder: the ids of its byte tokens <0xNN> and of the special tokens
    (skipped inside a run), which it turns into text as one run (a run that is not valid UTF-8
    becomes one U+FFFD per byte): text is not committed before the run ends. Empty for other
    decoders."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteFallback" not in str(backend.decoder):
        return frozenset()
    ids = {i for t, i in backend.get_vocab(with_added_tokens=False).items()
           if len(t) == 6 and t.startswith("<0x") and t.endswith(">")}
    ids.update(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    return frozenset(ids)


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decoding(tokenizer) -> tuple:
    """(decoder, run_ids) of a tokenizer, computed once per tokenizer object."""
    try:
        return _cache[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable / hashable: computed per request
        return decoder(tokenizer), run_ids(tokenizer)
    _cache[tokenizer] = out = (decoder(tokenizer), run_ids(tokenizer))
    return out


class IncrementalDetokenizer:
    """The text of `ids` (a list the owner appends to; read, never written). `update()` brings the
    text up to date with the tokens appended since the last call."""

    def __init__(self, tokenizer, ids: list[int]):
        self._decode, self._runs = _decoding(tokenizer)
        self._name = type(tokenizer).__name__
        self.ids = ids
        self._pieces: list[str] = []  # committed text, in order: decode(ids[:read])
        self._committed = 0  # characters in _pieces
        self._prefix = self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read])
        self.tail = ""  # text of ids[read:done] in context: may still change (incomplete character, open run)
        self._done = 0  # tokens covered by the text
        self.whole = False  # fallback: every update decodes all ids (a non-local decode was seen)

    def __len__(self) -> int:
        return self._committed + len(self.tail)

    @property
    def stable(self) -> int:
        """Characters at the start of the text that no later update changes."""
        return 0 if self.whole else self._committed

    def mark(self) -> tuple:
        """The state now, for `rewind` (within one burst of updates: no `text()` in between)."""
        return (len(self._pieces), self._committed, self._prefix, self._read, self._prefix_text, self.tail,
                self._done)

    def rewind(self, mark: tuple) -> None:
        """Back to a `mark` (to update again token by token)."""
        if self.whole:  # the next update decodes everything again
            self._done = mark[-1]
            return
        n, self._committed, self._prefix, self._read, self._prefix_text, self.tail, self._done = mark
        del self._pieces[n:]

    def update(self, end: int | None = None) -> None:
        """Cover ids[:end] (default: all of them); end must not go back before the last update."""
        end = len(self.ids) if end is None else end
        if end == self._done:
            return
        self._done = end
        if self.whole:
            self._redecode(end)
            return
        window = self._decode(self.ids[self._prefix:end])
        if not window.startswith(self._prefix_text):
            self._fall_back(end)
            return
        new = window[len(self._prefix_text):]
        if new.endswith("\ufffd") or self.ids[end - 1] in self._runs:  # may still change: decided later
            self.tail = new
            return
        self.tail = ""
        self._pieces.append(new)
        self._committed += len(new)
        self._read = end
        if end - self._prefix > MAX_CONTEXT:  # re-anchor: a short context again (a closed run may be cut)
            self._prefix = end - CONTEXT
            self._prefix_text = self._decode(self.ids[self._prefix:end])
        else:
            self._prefix_text = window

    def _fall_back(self, end: int) -> None:
        if self._name not in _warned:
            _warned.add(self._name)
            log.warning("the %s tokenizer's decode is not local (it rewrote text across tokens, e.g. "
                        "clean_up_tokenization_spaces): its requests decode their whole output on every "
                        "update (O(n) host work per token)", self._name)
        self.whole, self.tail = True, ""
        self._redecode(end)

    def _redecode(self, end: int) -> None:
        text = self._decode(self.ids[:end])
        self._pieces, self._committed = [text], len(text)

    def text(self) -> str:
        """The whole text, equal to the full decode (O(n): for final outputs)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return (self._pieces[0] if self._pieces else "") + self.tail

    def suffix(self, start: int, end: int | None = None) -> str:
        """text()[start:end] in O(len(text) - start) (recent text: stop-string search, streaming)."""
        n = len(self)
        end = n if end is None else min(end, n)
        if start >= end:
            return ""
        parts, at = [self.tail], self._committed  # `at`: where parts[0] begins
        i = len(self._pieces)
        while at > start and i > 0:
            i -= 1
            at -= len(self._pieces[i])
            parts.insert(0, self._pieces[i])  # few pieces: each one is a step's text
        return "".join(parts)[start - at: end - at]
