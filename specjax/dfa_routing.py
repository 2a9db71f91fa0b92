"""Which regex / choice / JSON-schema constraints run on the device DFA (specjax.device_dfa), and
their tables.

`DFARouter.route(key, tokenizer_info, eos_ids)` gives a request's token DFA (specjax.token_dfa),
or the reason it takes the host grammar path (specjax.grammar, xgrammar) instead:

    kind grammar (EBNF)         host (not a fallback, not counted)
    RegexUnsupported            a construct specjax.regex_dfa does not compile: host, counted
    SchemaUnsupported           a JSON schema outside specjax.json_schema_regex's subset (or invalid
                                there): host, counted
    RegexError, GrammarError    invalid (for Python's re; a converted schema that xgrammar or jsonschema
                                rejects): host, where xgrammar decides (it fails the request with its
                                reason, as without device DFAs), counted
    over the limits             more DFA states than max_states, or token classes than max_classes
                                (the static shapes of the device tables): host, counted

Choices become the regex of their alternatives (regex_dfa.choice_regex: the same strings as the
host path's EBNF), JSON schemas the regex of xgrammar's grammar for them
(json_schema_regex.schema_regex: the same language). Patterns take xgrammar's meaning
(compile_regex(xgrammar=True)), so both paths allow the same tokens. Token DFAs (and their padded
tables) are kept in a small LRU cache by (constraint, EOS ids, vocabulary size).
"""
from __future__ import annotations

import collections
import json
import threading

import numpy as np

from specjax.grammar import GrammarError, build_grammar
from specjax.json_schema_regex import SchemaUnsupported, schema_regex
from specjax.regex_dfa import RegexError, RegexUnsupported, choice_regex, compile_regex
from specjax.token_dfa import TokenDFA, build_token_dfa, vocab_token_bytes

__all__ = ["DFARouter", "DeviceDFA", "DFA_KINDS"]

DFA_KINDS = ("regex", "choice", "json_schema")
_BYTE_STATES = 4096  # the subset construction's own limit (compile_regex)


def _short(err, limit: int = 300) -> str:
    """An error's message, cut (a JSON schema's regex can be long)."""
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "..."


class DeviceDFA:
    """A request's token DFA (specjax.token_dfa.TokenDFA) and the EOS ids it allows at its ends."""

    def __init__(self, token_dfa: TokenDFA, eos_ids: tuple[int, ...]):
        self.token_dfa = token_dfa
        self.eos_ids = eos_ids

    def fits(self, max_states: int, max_classes: int) -> bool:
        return self.token_dfa.num_states <= max_states and self.token_dfa.num_classes <= max_classes

    def padded(self, max_states: int, max_classes: int) -> tuple[np.ndarray, np.ndarray]:
        """(cls [V] int32, next [max_states, max_classes] int32, -1 padded): the device tables' rows."""
        nxt = np.full((max_states, max_classes), -1, np.int32)
        nxt[:self.token_dfa.num_states, :self.token_dfa.num_classes] = self.token_dfa.next
        return self.token_dfa.token_class, nxt

    def state_after(self, tokens) -> int:
        """The state after tokens from the start (a preempted request's generated tokens); ValueError
        on a token the DFA forbids."""
        s = 0
        for t in tokens:
            s = self.token_dfa.step(s, t)
        return s


class DFARouter:
    """Token DFAs of constraints against one vocabulary, within the device limits (see the module)."""

    def __init__(self, vocab_size: int, cache_size: int = 64):
        self.vocab_size = vocab_size
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size
        self._token_bytes = None
        self._lock = threading.Lock()

    def _bytes(self, tokenizer_info):
        if self._token_bytes is None or self._token_bytes[0] is not tokenizer_info:
            self._token_bytes = (tokenizer_info, vocab_token_bytes(tokenizer_info))
        return self._token_bytes[1]

    def route(self, key, tokenizer_info, eos_ids, max_states: int, max_classes: int
              ) -> tuple[DeviceDFA | None, str | None]:
        """(the constraint's DeviceDFA, None), or (None, why it runs on the host path); max_states /
        max_classes: the limits (SchedulerOptions.dfa_max_states / dfa_max_classes)."""
        kind, text = key
        if kind not in DFA_KINDS:
            return None, f"{kind} constraints run on the host grammar path"
        eos = tuple(sorted(int(t) for t in eos_ids))
        ck = (key, eos, max_states)
        with self._lock:
            got = self._cache.get(ck)
            if got is not None:
                self._cache.move_to_end(ck)
        if got is None:
            got = self._build(kind, text, tokenizer_info, eos, max_states)
            with self._lock:
                self._cache[ck] = got
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        dfa, why = got
        if dfa is not None and dfa.token_dfa.num_classes > max_classes:
            return None, f"{dfa.token_dfa.num_classes} token classes > dfa_max_classes={max_classes}"
        return got

    def _build(self, kind, text, tokenizer_info, eos, max_states) -> tuple[DeviceDFA | None, str | None]:
        try:
            if kind == "json_schema":  # (converted first: xgrammar may take long on what it leaves to the host)
                pattern = schema_regex(text)
                build_grammar(("json_schema", text))  # a schema the host path rejects stays its to reject
            else:
                pattern = text if kind == "regex" else choice_regex(json.loads(text))
            byte_dfa = compile_regex(pattern, max(_BYTE_STATES, max_states), xgrammar=True)
        except SchemaUnsupported as e:
            return None, f"json_schema not supported on the device: {e}"
        except RegexUnsupported as e:
            what = "json_schema" if kind == "json_schema" else "regex"
            return None, f"{what} not supported on the device: {_short(e)}"
        except (RegexError, GrammarError, ValueError) as e:  # invalid: the host path reports it as it always did
            return None, f"invalid {kind} for the device DFA compiler: {_short(e)}"
        if byte_dfa.num_states > max_states:  # checked before the (costlier) lift to tokens
            return None, f"{byte_dfa.num_states} DFA states > dfa_max_states={max_states}"
        token_bytes = self._bytes(tokenizer_info)
        if len(token_bytes) > self.vocab_size:
            return None, f"the tokenizer's {len(token_bytes)} tokens exceed the model's vocabulary {self.vocab_size}"
        return DeviceDFA(build_token_dfa(byte_dfa, token_bytes, eos, self.vocab_size), eos), None
