"""A regex's byte DFA (specjax.regex_dfa) lifted to tokens: small tables that let a jitted program
follow a constraint with no host work per token.

    token_class [V] int32     the class of each token id (tokens with the same next-state vector)
    next        [S, C] int32  the state after a token of class c in state s; -1: not allowed
    accept      [S] bool      the byte DFA's accepting states (the text so far is a complete match)

so the state after token t is ``next[s, token_class[t]]`` and the tokens allowed in state s are
``next[s, token_class] >= 0`` (a row of C entries gathered through [V] class ids instead of an
[S, V] table). Start state 0.

Token t (t < len(token_bytes)) moves s to the state its bytes walk to from s in the byte DFA, and is
not allowed at s when the walk leaves the DFA. Tokens without text (bytes None or b"": special
tokens) and the ids from len(token_bytes) up to vocab_size (the model's padding) are never allowed,
except the EOS ids, which are allowed exactly at the accepting states and keep the state there (an
EOS id never acts as text, whatever its bytes). As the byte DFA has no dead states, every prefix the
token DFA admits can be completed by bytes; whether by whole tokens depends on the vocabulary.

The walk is vectorised over all tokens at once (numpy, byte position by byte position over the
tokens sorted by length; states in chunks that bound the memory).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from specjax.grammar import bitmask_width, pack_bool_mask
from specjax.regex_dfa import ByteDFA

__all__ = ["TokenDFA", "build_token_dfa", "vocab_token_bytes"]

_CHUNK = 1 << 23  # state x token entries walked at once (int32: 32 MiB)


@dataclasses.dataclass
class TokenDFA:
    token_class: np.ndarray  # [V] int32 class of each token id
    next: np.ndarray  # [S, C] int32 next state per (state, class), -1 = disallowed
    accept: np.ndarray  # [S] bool accepting states (EOS allowed)

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.next.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.token_class.shape[0])

    def allowed(self, state: int) -> np.ndarray:
        """[V] bool: the tokens allowed in state."""
        return self.next[state, self.token_class] >= 0

    def step(self, state: int, token: int) -> int:
        """The state after token; ValueError if the token is not allowed in state."""
        token = int(token)
        nxt = int(self.next[state, self.token_class[token]]) if 0 <= token < self.vocab_size else -1
        if nxt < 0:
            raise ValueError(f"token {token} is not allowed in state {state}")
        return nxt

    def bitmask(self, state: int) -> np.ndarray:
        """[W] int32: the allowed tokens as a packed mask (specjax.grammar's layout)."""
        return pack_bool_mask(self.allowed(state))

    def bitmasks(self) -> np.ndarray:
        """[S, W] int32: the packed masks of every state."""
        out = np.empty((self.num_states, bitmask_width(self.vocab_size)), np.int32)
        step = max(1, _CHUNK // max(self.vocab_size, 1))
        for s in range(0, self.num_states, step):
            out[s:s + step] = pack_bool_mask(self.next[s:s + step, self.token_class] >= 0)
        return out


def vocab_token_bytes(tokenizer_info) -> list[bytes | None]:
    """Each token's bytes from an ``xgrammar.TokenizerInfo`` (its decoded_vocab, the ids padded up to
    its vocab_size); None for its special tokens and its stop tokens, which never match text there."""
    info = tokenizer_info
    no_text = set(int(t) for t in info.special_token_ids) | set(int(t) for t in info.stop_token_ids)
    out: list[bytes | None] = [None if i in no_text else bytes(b) for i, b in enumerate(info.decoded_vocab)]
    return out + [None] * (int(info.vocab_size) - len(out))


def _walk(trans: np.ndarray, states: np.ndarray, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """[len(states), T] int32: the state each token's bytes walk to from each of states (-1: none).
    Tokens (starts / lens [T] into buf, the concatenated bytes) sorted by decreasing length."""
    S = trans.shape[0]
    flat = np.concatenate([np.where(trans >= 0, trans, S), np.full((1, 256), S)]).astype(np.int32).ravel()
    cur = np.repeat(states.astype(np.int32)[:, None], lens.shape[0], 1)  # [n, T]
    for pos in range(int(lens[0]) if lens.shape[0] else 0):
        k = int(np.searchsorted(-lens, -pos, "left"))  # tokens 0..k-1 are longer than pos
        col = buf[starts[:k] + pos].astype(np.int32)  # [k] their bytes at pos
        cur[:, :k] = flat[cur[:, :k] * 256 + col]
    cur[cur == S] = -1
    return cur


def _column_hash(cols: np.ndarray) -> np.ndarray:
    """[V] uint64: a random linear hash (mod 2^64) of each column of cols [n, V] int32 (>= -1)."""
    w = np.random.default_rng(0).integers(1, 1 << 63, cols.shape[0], np.uint64) | np.uint64(1)
    h = np.zeros(cols.shape[1], np.uint64)
    for row, wr in zip(cols, w):
        h += (row + 1).astype(np.uint64) * wr  # wraps
    return h


def _distinct_columns(cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(uniq [n, K], inv [V]) with cols [n, V] == uniq[:, inv]: the distinct columns, grouped by their
    hash (exactness checked; on a collision np.unique over the columns, slower, decides)."""
    _, rep, inv = np.unique(_column_hash(cols), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    uniq = cols[:, rep]
    if not np.array_equal(uniq[:, inv], cols):  # a hash collision
        uniq, inv = np.unique(cols, axis=1, return_inverse=True)
        inv = inv.reshape(-1)
    return uniq, inv


def build_token_dfa(dfa: ByteDFA, token_bytes: Sequence[bytes | None], eos_ids: Sequence[int],
                    vocab_size: int) -> TokenDFA:
    """The TokenDFA of a byte DFA over a vocabulary (see the module docstring). token_bytes[i]: token
    i's bytes (None: no text); at most vocab_size of them; eos_ids in [0, vocab_size)."""
    n = len(token_bytes)
    if n > vocab_size:
        raise ValueError(f"{n} token byte strings for a vocabulary of {vocab_size}")
    eos = np.unique(np.asarray(list(eos_ids), np.int64))
    if eos.size and (eos[0] < 0 or eos[-1] >= vocab_size):
        raise ValueError(f"eos_ids must lie in [0, {vocab_size}), got {eos.tolist()}")
    S = dfa.num_states
    trans = np.asarray(dfa.trans, np.int32)
    accept = np.asarray(dfa.accept, bool)

    lens = np.array([len(b) if b else 0 for b in token_bytes] + [0] * (vocab_size - n), np.int64)  # [V]
    lens[eos] = 0
    text = np.flatnonzero(lens)
    text = text[np.argsort(-lens[text], kind="stable")]  # longest first
    buf = np.frombuffer(b"".join(bytes(token_bytes[i]) for i in text), np.uint8)
    t_lens = lens[text]
    t_starts = np.cumsum(t_lens) - t_lens

    # next state of every (state, token), in chunks of states; per chunk the distinct columns
    # (uniq [n, Ck]) and each token's column (inv [V]): two tokens share a class iff they share a
    # column in every chunk.
    step = max(1, _CHUNK // max(vocab_size, 1))
    uniqs, invs = [], []
    for s0 in range(0, S, step):
        states = np.arange(s0, min(S, s0 + step))
        cols = np.full((states.shape[0], vocab_size), -1, np.int32)  # [n, V]
        cols[:, text] = _walk(trans, states, buf, t_starts, t_lens)
        cols[:, eos] = np.where(accept[states], states, -1)[:, None]
        uniq, inv = _distinct_columns(cols)
        uniqs.append(uniq)
        invs.append(inv)
    inv = invs[0]
    for k in invs[1:]:  # the tuple of per-chunk columns, kept below V distinct values
        _, inv = np.unique(inv.astype(np.int64) * (int(k.max()) + 1) + k, return_inverse=True)
        inv = inv.reshape(-1)
    # classes numbered by their first token
    C = int(inv.max()) + 1
    first = np.full(C, vocab_size, np.int64)
    np.minimum.at(first, inv, np.arange(vocab_size))
    order = np.argsort(first)
    renum = np.empty(C, np.int64)
    renum[order] = np.arange(C)
    nxt = np.concatenate([u[:, k[first[order]]] for u, k in zip(uniqs, invs)])  # [S, C]
    return TokenDFA(renum[inv].astype(np.int32), np.ascontiguousarray(nxt, np.int32), accept.copy())
