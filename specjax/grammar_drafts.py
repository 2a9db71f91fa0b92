"""Grammar drafts: the continuation a grammar dictates, drafted into the next speculative tree.

Under a grammar a draft head proposes poorly where the grammar fixes the text (JSON keys,
punctuation, the fixed parts of a regex): the head was trained on free text, the masked target
follows the grammar. The host knows those continuations, so it drafts them itself.

Host (with the tree masks of step t+1, specjax.engine):

    drafts[b, i] = continuation(grammar state after root..i of row b's tree)   # [B, N, S + 1] int32

where the continuation is built token by token (at most S + 1 = num_steps + 1 tokens, -1 padded):
  * the grammar allows exactly one token next: that token. CERTAIN: the masked target puts all its
    mass on it, so verification accepts it (greedy and sampling alike);
  * otherwise, when the grammar's jump-forward string (the text that must come next) is not empty:
    the longest allowed token that spells a prefix of it. LIKELY: the text is fixed, its tokenization
    is the model's choice (with a BPE vocabulary few tokens are certain: after `{"` a JSON object
    may continue with `title` or `t`; the model almost always takes the canonical one);
  * otherwise (a free choice) the continuation ends; it also ends after a stop token.

Device (specjax.draft_tree.grammar_levels, in the accept + draft program): after acceptance ends at node n*
with the bonus token b (the next root), when drafts[n*, 0] == b (always so for a certain token) the
tokens drafts[n*, 1:] become the first levels of the next tree: a chain's first nodes, or for an
EAGLE-2 tree the only candidate of each of those levels (score 0: kept first; the other candidates
of the level are displaced). The draft runs over them as over its own tokens (its KV / hidden states
for those positions are computed from them), so its later levels continue from them. After a
prefill, drafts[b, 0] is the continuation after the prompt and b the first sampled token.

Lossless: a grammar draft is a deterministic function of the accepted prefix, i.e. a point-mass
proposal (draft probability q = 1 on it; a sampled chain's draft_probs row is that one-hot), so
greedy verification and recursive rejection sampling (specjax.verify) are exact as they stand.

Cost (`Pause`): a tree's drafts cost the host ~40 us per node (measured on an H100 machine: 17-21 ms
per step for 32 rows of 16 nodes), paid also by grammars that never fix the next text (a
permissive regex). A request whose tree drafts found no token for IDLE_STEPS steps in a row skips
them for PAUSE_STEPS steps, then probes one step again; any token found resumes them at once. Which
steps get drafts changes only the trees, never the outputs (lossless either way).
"""
from __future__ import annotations

import numpy as np

from specjax.grammar import RequestGrammar, _sibling_links


IDLE_STEPS = 8  # steps of tree drafts without a token before they pause
PAUSE_STEPS = 8  # steps skipped per pause


class Pause:
    """When a request computes its tree drafts (see "Cost" above); one per request grammar."""

    def __init__(self):
        self.idle = 0  # steps in a row whose drafts found nothing
        self.skip = 0  # steps left to skip

    def wanted(self) -> bool:
        """Whether this step computes the drafts (a skipped step counts down the pause)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def record(self, found: bool) -> None:
        """The drafts of a computed step found a token (found) or none."""
        if found:
            self.idle = 0
            return
        self.idle += 1
        if self.idle >= IDLE_STEPS:
            self.skip = PAUSE_STEPS
            self.idle = IDLE_STEPS - 1  # after the pause one empty probe pauses again


def pause_of(grammar: RequestGrammar) -> Pause:
    """The request grammar's Pause (made on first use)."""
    p = getattr(grammar, "draft_pause", None)
    if p is None:
        p = grammar.draft_pause = Pause()
    return p


class TokenTable:
    """The tokens of a vocabulary by their bytes (stop tokens excluded), to spell a jump-forward
    string with tokens. Built once per tokenizer (GrammarCompiler.token_table)."""

    def __init__(self, tokenizer_info):
        stops = set(int(t) for t in tokenizer_info.stop_token_ids)
        self.ids: dict[bytes, int] = {}
        for i, text in enumerate(tokenizer_info.decoded_vocab):
            text = bytes(text)
            if text and i not in stops:
                self.ids.setdefault(text, i)
        self.longest = max((len(t) for t in self.ids), default=0)

    def prefixes(self, text: bytes):
        """Token ids spelling a prefix of text, longest first."""
        for n in range(min(len(text), self.longest), 0, -1):
            t = self.ids.get(text[:n])
            if t is not None:
                yield t


def table_of(grammar: RequestGrammar) -> TokenTable:
    """The grammar's token table (built from its tokenizer on first use when none was given)."""
    if grammar.token_table is None:
        grammar.token_table = TokenTable(grammar.tokenizer_info)
    return grammar.token_table


def _single(mask: np.ndarray) -> int | None:
    """The token of a [W] mask that allows exactly one token (None otherwise)."""
    nz = np.flatnonzero(mask)
    if nz.shape[0] != 1:
        return None
    word = int(mask[nz[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return 32 * int(nz[0]) + word.bit_length() - 1


def _next_token(grammar: RequestGrammar, table: TokenTable, mask: np.ndarray | None, scratch: np.ndarray) -> int | None:
    """The next token of the continuation from the matcher's state, accepted into the matcher (a
    stop token is returned unaccepted); None: a free choice. mask: the state's [W] mask if known
    (otherwise one is filled only where the grammar may end, to see whether a stop token is all it
    allows: elsewhere a single allowed token spells a prefix of the jump-forward string)."""
    m = grammar.matcher
    jump = m.find_jump_forward_string()
    if jump:
        for t in table.prefixes(jump.encode("utf-8")):
            if m.accept_token(t):
                return t
    if mask is None:
        if not m.is_completed():  # nothing fixed: a free choice (one allowed token spells the jump string)
            return None
        m.fill_next_token_bitmask(scratch)  # the grammar may end here: maybe only the stop token is allowed
        mask = scratch
    t = _single(mask)
    if t is None or t in grammar.stop_token_ids:
        return t
    return t if m.accept_token(t) else None


def continuation(grammar: RequestGrammar, max_len: int, mask: np.ndarray | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """The grammar's continuation from the matcher's state: [max_len] int32, -1 padded (see the
    module docstring). mask: the state's next-token mask [W] if already computed. The matcher's
    state is unchanged afterwards."""
    if out is None:
        out = np.full(max_len, -1, np.int32)
    if grammar.is_terminated:
        return out
    table, scratch = table_of(grammar), np.empty(grammar.width, np.int32)
    accepted = 0
    try:
        for j in range(max_len):
            t = _next_token(grammar, table, mask if j == 0 else None, scratch)
            if t is None:
                break
            out[j] = t
            if t in grammar.stop_token_ids:
                break
            accepted += 1
    finally:
        if accepted:
            grammar.matcher.rollback(accepted)
    return out


def tree_drafts(grammar: RequestGrammar, tokens: np.ndarray, parents: np.ndarray, max_len: int,
                masks: np.ndarray | None = None) -> np.ndarray:
    """Continuations [N, max_len] int32 (-1 padded) after each node of a draft tree (tokens [N],
    parents [N]; the root is already in the matcher). Nodes the grammar rejects, and those below a
    stop token, get none. masks: the tree's [N, W] masks (RequestGrammar.tree_masks) if computed.
    The matcher's state is unchanged afterwards."""
    tokens = np.asarray(tokens).astype(np.int64)
    parents = np.asarray(parents).astype(np.int64)
    n = tokens.shape[0]
    out = np.full((n, max_len), -1, np.int32)
    if grammar.is_terminated:
        return out
    stop = np.isin(tokens, grammar.stop_token_ids)
    stop[0] = False
    first, sibling = _sibling_links(parents, stop)
    m = grammar.matcher

    def visit(node: int) -> None:
        continuation(grammar, max_len, None if masks is None else masks[node], out[node])
        child = int(first[node])
        while child >= 0:
            t = int(tokens[child])
            if not stop[child] and 0 <= t < grammar.vocab_size and m.accept_token(t):
                try:
                    visit(child)
                finally:
                    m.rollback(1)
            child = int(sibling[child])

    visit(0)
    return out
