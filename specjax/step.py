"""The fused speculative step: ONE jitted program per step, state donated, no host round trip.

    verify the stored draft tree with the target (tree-masked attention over the paged cache)
    -> accept (greedy, or recursive rejection sampling: specjax.verify)
    -> KV compaction of the accepted path (pallas_kernels.kv_compact, the implementation named by
       the static `Kernels` the caller chose once: specjax.kernels; trees only)
    -> sequence lengths updated on the device
    -> draft extend over the accepted tokens (EAGLE: with the target's features for them)
    -> grow the next draft tree (EAGLE-2 style; topk = 1 is a chain), stored in the state.

The lite step (a draft-synced plain step over the stored tree's root only): specjax.step_lite.

Prefill (the target cache, the draft and the first tree seeded from prompt pieces): specjax.step_prefill.

Per slot (see specjax.drafter for the draft methods and their shift s):
  target: cache.seq_lens = L; tokens x_0 .. x_{L-1} have K/V; the tree's root (node 0) is x_L,
          the last accepted token. Tree node i sits at position L + depth[i] and is written to
          cache index L + i during verification; compaction moves the accepted path to L .. L+n-1.
          A step writes at most lookahead(spec, info) entries past L (target and draft), so a slot
          must address L + lookahead entries for every L it decodes at: the engine gives each slot
          max_seq_len + lookahead entries (specjax.scheduler, "Capacity").
  draft:  draft_seq_lens = Ld = L + 1 - s committed entries. Tree growth writes the frontier
          nodes of step j (1 <= j < num_steps) as scratch entries Ld + (j-1)*topk + f; a node sees
          the committed prefix and its own ancestors' scratch entries (AttnMeta.mask_start = Ld).
          After verification the extend overwrites the scratch with the n accepted entries.
Inactive rows write only to the trash page and keep their state; rows whose slot is >= max_slots
are padding (reads clamp, updates drop).

The n-gram drafter (info.method "ngram", specjax.ngram) has no model: the state keeps each slot's
tokens x_0 .. x_L (SpecState.history; admission (admit_slots) writes the whole prompt, the final
prefill piece the first token, each step appends its emitted tokens) and the next tree is looked up in them; draft_kv is empty and
draft_seq_lens unused. Its drafts are point masses (draft_probs None). A model draft's tree with
SpecConfig.ngram_branch keeps the same history and gets the lookup's best continuation merged in
(ngram.add_branch) after each growth; the branch's nodes have no draft KV (the extend over the
accepted entries writes it, as for any accepted node).

Grammar drafts (specjax.grammar_drafts; constrained batches): the host passes the grammar's
continuation after each node of the verified tree ([B, N, S + 1] int32, -1 padded; after the prompt
for a prefill). draft_tree.grammar_levels takes the one after the accepted node where it starts with the bonus
token, and draft_tree.grow forces those tokens as the first levels of the next tree: a chain's tokens (their
proposal in draft_probs the one-hot), or a tree level's only candidate (candidate 0, score 0; the
other candidates of the level are displaced to score -1e30). The draft is fed them as its own
tokens, so later levels continue from them. Point-mass proposals keep verification exact.

Device DFAs (SpecState.dfa, specjax.device_dfa; the static flag `dfa` of a dispatch with a DFA
row): the state after the root is the slot's; the state at each tree node follows its path, the
target's logits after each node are masked by it before acceptance (lossless: the masked target is
what constrained plain decoding samples from), and the slot's new state is the accepted node's,
stepped by the bonus token. The draft drafts from its logits masked by each frontier node's state
(an EAGLE-3 head over its reduced vocabulary, through its draft -> target id map; a node whose
state allows none of the head's tokens keeps its unmasked law): a sampled chain's proposal is the
law it drew from, so the rule stays exact, and where the regex fixes the text the draft proposes it.

Penalties (SpecState.penalties set; specjax.penalties): acceptance sees the target's logits after
each node penalised with the slot's counts plus the tokens on the node's path, i.e. exactly what
plain decoding would sample from, so speculation stays lossless; the emitted tokens are counted
before the next tree is drafted. A draft sharing the target's vocabulary ("draft", "eagle") drafts
from penalised logits too (same counts along its own paths), which keeps acceptance up; an EAGLE-3
head (own vocabulary) drafts unpenalised, which costs acceptance only.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from pallas_kernels.kv_compact import kv_compact
from specjax import draft_tree, drafter, ngram, sampling, tree as tree_lib, verify
from specjax import device_dfa as dfa_lib
from specjax import penalties as pen_lib
from specjax.drafter import DraftInfo
from specjax.kernels import Kernels
from specjax.kv_cache import KVCache, meta_at
from specjax.penalties import PenaltyState
from specjax.sampling import SamplingArrays
from specjax.token_mask import apply_token_mask
from specjax.tree import SpecConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: KVCache  # target cache; its page_table is shared with the draft
    draft_kv: list  # per draft layer [num_pages, page_size, 2, Hkv_d, D_d]
    draft_seq_lens: jax.Array  # [max_slots] int32: Ld = L + 1 - shift
    tree: jax.Array  # [max_slots, 3, N] int32 the next tree to verify: its tokens (node 0 = root), parents and
    #                  depths (one array: one write per step; tree_tokens / tree_parents / tree_depth view it)
    draft_probs: jax.Array | None  # [max_slots, N, V] float32: proposal of each chain node (sampling)
    penalties: PenaltyState | None = None  # None: no penalties (compiled out)
    history: jax.Array | None = None  # [max_slots, W] int32 tokens x_0 .. x_L (n-gram drafter only)
    dfa: dfa_lib.DFATables | None = None  # per-slot regex DFAs, state after the root (specjax.device_dfa)
    done: jax.Array | None = None  # [max_slots] bool: the slot's request finished on the device (a stop id or
    #                                its length limit in a multi-step dispatch; cleared by its prefill), so
    #                                later dispatches leave it alone (specjax.programs, row hand-over)

    @property
    def tree_tokens(self):  # [max_slots, N]
        return self.tree[:, 0]

    @property
    def tree_parents(self):  # [max_slots, N]
        return self.tree[:, 1]

    @property
    def tree_depth(self):  # [max_slots, N]
        return self.tree[:, 2]


def tree_rows(tree) -> jax.Array:
    """A Tree's tokens, parents and depths as SpecState.tree rows [B, 3, N] int32."""
    return jnp.stack([tree.tokens, tree.parents, tree.depth], axis=1).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecOut:
    tokens: jax.Array  # [B, num_steps + 1] int32 emitted tokens, padded with -1
    num_accepted: jax.Array  # [B] int32 in 1 .. num_steps + 1 (0 for inactive rows)
    accept_hist: jax.Array  # [num_steps + 2] int32 histogram of num_accepted over active rows
    logprob: jax.Array | None = None  # [B, num_steps + 1] float32
    top_logprobs: jax.Array | None = None  # [B, num_steps + 1, K]
    top_ids: jax.Array | None = None  # [B, num_steps + 1, K]
    slot: jax.Array | None = None  # [B] int32 the slot each row ran (row hand-over: specjax.programs)


def init_spec_state(cache: KVCache, draft_kv: list, spec: SpecConfig, vocab_size: int,
                    sample_drafts: bool = True, penalties: PenaltyState | None = None,
                    tiers: tuple[SpecConfig, ...] = ()) -> SpecState:
    """Empty state around a target cache and draft pages (same page count / page size; [] for the
    n-gram drafter). sample_drafts: keep chain proposals for speculative sampling (chains of a
    draft model or head; n-gram drafts are point masses).
    penalties: a penalty state (penalties.init_penalty_state(max_slots, vocab_size)) or None.
    tiers: every tree shape the engine runs (specjax.spec_tiers): the tree arrays hold the largest."""
    S = cache.seq_lens.shape[0]
    specs = tiers or (spec,)
    N = max(s.num_nodes for s in specs)
    is_ngram = spec.method == "ngram"
    chain = any(s.is_chain for s in specs)
    probs = jnp.zeros((S, N, vocab_size), jnp.float32) if chain and sample_drafts and not is_ngram else None
    with_history = is_ngram or any(s.ngram_branch > 0 for s in specs)  # a tier without a branch appends too
    history = ngram.init_history(S, cache.pages_per_slot * cache.page_size) if with_history else None
    return SpecState(cache=cache, draft_kv=list(draft_kv), draft_seq_lens=jnp.zeros((S,), jnp.int32),
                     tree=jnp.zeros((S, 3, N), jnp.int32).at[:, 1].set(-1), draft_probs=probs, penalties=penalties,
                     history=history, done=jnp.zeros((S,), bool))


def lookahead(spec: SpecConfig, info: DraftInfo) -> int:
    """Cache entries a slot may touch beyond its length L in one step (pages to reserve)."""
    if not info.has_model:  # n-gram: only the tree's K/V
        return spec.num_nodes
    draft = 1 - info.shift + (spec.num_steps + 1) + (spec.num_steps - 1) * spec.topk
    return max(spec.num_nodes, draft)


# ----------------------------------------------------------------------------- draft side


def draft_penalty_rows(info, pen: PenaltyState | None, slots):
    """Penalty rows for drafting (None: the draft does not share the target's vocabulary)."""
    if pen is None or info.method == "eagle3":
        return None
    return pen_lib.rows(pen, slots)


def draft_dfa_view(info, state: SpecState, rs, root_states):
    """(DFAView, the next roots' states [B]) for drafting under the rows' DFAs (None: no DFA in the
    dispatch). An EAGLE-3 head drafts in its own vocabulary: draft_tree.grow masks its logits through
    draft_tree.draft_vocab_view."""
    if root_states is None:
        return None
    return dfa_lib.view(state.dfa, rs)._replace(state=root_states), root_states


# ----------------------------------------------------------------------------- steps


def merge_draft(dgd, dp):
    """The draft module (None without one: the n-gram drafter)."""
    return None if dgd is None else nnx.merge(dgd, dp)


def merge_models(tgd, tp, dgd, dp):
    return nnx.merge(tgd, tp), merge_draft(dgd, dp)


def set_rows(arr, rows, val):
    """arr.at[rows].set(val, mode="drop") (rows [B] int32; rows out of range are dropped, negative ones count
    from the end). One row: a dynamic update of the clamped row with the old row kept where the index is out
    of range, elementwise: XLA turns a one-row scatter into an update whose bounds check is a reduction kernel
    of its own (the batch-1 fused step on a GPU: one kernel per step for the tree's rows)."""
    if rows.shape[0] != 1:
        return arr.at[rows].set(val, mode="drop")
    n = arr.shape[0]
    i = rows[0].astype(jnp.int32)
    i = jnp.where(i < 0, i + n, i)
    ok = (i >= 0) & (i < n)
    j = jnp.clip(i, 0, n - 1)
    new = jnp.broadcast_to(jnp.asarray(val, arr.dtype), (1,) + arr.shape[1:])[0]
    return lax.dynamic_update_index_in_dim(arr, jnp.where(ok, new, lax.dynamic_index_in_dim(arr, j, keepdims=False)),
                                           j, 0)


def store_slots(state: SpecState, upd, tree, probs, draft_kv, draft_seq_lens, cache, penalties=None, history=None,
           dfa=None):
    """Write the per-slot results of rows `upd` (out-of-range rows dropped); penalties / history / dfa:
    the new penalty state / token history / DFA tables (None: keep the state's)."""
    def put(arr, val):
        return set_rows(arr, upd, val)
    return SpecState(cache=cache, draft_kv=draft_kv, draft_seq_lens=draft_seq_lens,
                     tree=put(state.tree, tree_rows(tree)),
                     draft_probs=None if state.draft_probs is None else put(
                         state.draft_probs, probs if probs is not None else 0.0),
                     penalties=state.penalties if penalties is None else penalties,
                     history=state.history if history is None else history,
                     dfa=state.dfa if dfa is None else dfa, done=state.done)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Verified:
    """What the target forward over the tree hands to acceptance (the three parts of a step can run
    as one program or, for grammar overlap / the unfused benchmark, as separate ones)."""
    logits: jax.Array  # [B, N, V] float32 target logits after each node
    h: jax.Array  # [B, N, E] final-normed target hidden states
    aux: tuple  # target hidden states of info.aux_layers, each [B, N, E]
    cache: KVCache  # target cache with the tree's K/V written at L .. L + N - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accepted:
    out: SpecOut
    accept_idx: jax.Array  # [B, S + 1] accepted node indices (-1 padded)
    bonus: jax.Array  # [B] int32 the next root
    cache: KVCache  # compacted target cache (lengths not yet updated)
    dfa_state: jax.Array | None = None  # [B] int32 the rows' DFA states after the bonus (None: dfa off)


class TreeShape(NamedTuple):
    """What verify_forward and accept read of a SpecConfig (a SpecConfig serves as one)."""
    num_nodes: int
    num_steps: int  # the tree's max depth
    is_chain: bool  # the accepted path is in place (no compaction)


def live_rows(state: SpecState, slots, active):
    max_slots = state.cache.seq_lens.shape[0]
    rs = jnp.minimum(slots, max_slots - 1)  # read slots (padding rows clamp)
    return rs, active & (slots < max_slots)


def verify_forward(info: DraftInfo, spec: SpecConfig | TreeShape, target, state: SpecState, slots,
                   active) -> Verified:
    """Target forward over the stored tree of rows `slots`: node i at position L + depth[i],
    written to cache index L + i, attending to the prefix and its ancestors. spec: the SpecConfig,
    or ROOT_ONLY with root_view(state) (the root alone: plain decoding's forward)."""
    rs, active = live_rows(state, slots, active)
    N = spec.num_nodes
    L = state.cache.seq_lens[rs]  # [B]
    tree = tree_lib.make_tree(state.tree_tokens[rs], state.tree_parents[rs], state.tree_depth[rs], spec.num_steps)
    meta = meta_at(state.cache.page_table[rs], L, active.astype(jnp.int32) * N, N, state.cache.page_size,
                   block_mask=tree.mask if N > 1 else None)  # one node: causal, the attention's decode path
    h, cache, aux = target(tree.tokens, tree_lib.positions(tree, L), state.cache, meta, info.aux_layers)
    return Verified(logits=target.logits(h), h=h, aux=tuple(aux), cache=cache)


def accept(spec: SpecConfig | TreeShape, state: SpecState, ver: Verified, slots, active, samp, want_logprobs,
           stochastic, token_mask=None, kernels: Kernels = Kernels(), dfa: bool = False) -> Accepted:
    """Acceptance (greedy or rejection sampling) and compaction of the accepted path (spec: as for
    verify_forward; ROOT_ONLY: the bonus alone, drawn as when every child of the root is rejected).
    token_mask: optional grammar masks of the tokens allowed after each node: token_mask.RowMasks
    (bits [R, N, W] of some rows) or a dense [B, N, W] int32 bitmask.
    kernels: the implementations chosen by the caller (default: the jnp references).
    With state.penalties, the logits after each node are penalised first (counts + the node's path).
    dfa (static): the rows' device DFAs mask the logits after each node by the node's state (its
    path's: device_dfa.tree_states); Accepted.dfa_state is the accepted node's state after the bonus."""
    rs, active = live_rows(state, slots, active)
    S = spec.num_steps
    act = active.astype(jnp.int32)
    L = state.cache.seq_lens[rs]
    tree = tree_lib.make_tree(state.tree_tokens[rs], state.tree_parents[rs], state.tree_depth[rs], S)
    logits = ver.logits
    if state.penalties is not None:
        logits = pen_lib.apply(logits, pen_lib.rows(state.penalties, rs), pen_lib.tree_path_tokens(tree))
    logits = apply_token_mask(logits, token_mask)  # grammar: the constrained rows only (token_mask.RowMasks)
    dv = node_states = None
    if dfa:
        dv = dfa_lib.view(state.dfa, rs)
        node_states = dfa_lib.tree_states(dv, tree.tokens, tree.parents, max_depth=S)  # [B, N]
        logits = dfa_lib.mask_logits(logits, dv, node_states)
    q = state.draft_probs[rs] if (stochastic and state.draft_probs is not None) else None
    acc, n, bonus = verify.verify_tree(tree, logits, samp, L, draft_probs=q, stochastic=stochastic)
    n = n * act  # [B]; acc [B, S + 1]
    toks = tree_lib.accepted_tokens(tree, acc, jnp.maximum(n, 1), bonus)  # [B, S + 1]
    toks = jnp.where(active[:, None], toks, -1)
    cache = ver.cache
    if not spec.is_chain:  # a chain's accepted path is already in place
        with jax.named_scope("compact"):
            kv = kv_compact(cache.kv, state.cache.page_table[rs], L, acc, n, impl=kernels.kv_compact)
            cache = dataclasses.replace(cache, kv=kv)
    hist = jnp.zeros((S + 2,), jnp.int32).at[n].add(act)
    out = SpecOut(tokens=toks, num_accepted=n, accept_hist=hist)
    if want_logprobs:  # of the unmasked, unscaled target distribution, as plain decoding reports
        lg = jnp.take_along_axis(ver.logits, jnp.maximum(acc, 0)[:, :, None], axis=1)  # [B, S + 1, V]
        B = toks.shape[0]
        chosen, top_v, top_i = sampling.token_logprobs(lg.reshape(B * (S + 1), -1), jnp.maximum(toks, 0).reshape(-1))
        out = dataclasses.replace(out, logprob=chosen.reshape(B, S + 1), top_logprobs=top_v.reshape(B, S + 1, -1),
                                  top_ids=top_i.reshape(B, S + 1, -1))
    dfa_state = None
    if dv is not None:  # the accepted node's state, stepped by the bonus (the next root)
        last = jnp.take_along_axis(acc, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]  # [B]
        at = jnp.take_along_axis(node_states, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]
        dfa_state = jnp.where(active, dfa_lib.step_states(dv, at, bonus), dv.state)
    return Accepted(out=out, accept_idx=acc, bonus=bonus, cache=cache, dfa_state=dfa_state)


def commit_target(state: SpecState, acc: Accepted, slots, active) -> SpecState:
    """The target's side of _commit: lengths L + n, penalty counts, DFA states and the n-gram history
    of the n emitted tokens (the draft's lengths and KV untouched)."""
    rs, active = live_rows(state, slots, active)
    max_slots = state.cache.seq_lens.shape[0]
    L = state.cache.seq_lens[rs]
    n = acc.out.num_accepted  # [B]; 0 for inactive rows
    upd = jnp.where(active, slots, max_slots)  # inactive rows: out of range -> dropped
    pen = state.penalties
    if pen is not None:
        pen = pen_lib.add_tokens(pen, upd, acc.out.tokens, n)
    cache = dataclasses.replace(acc.cache, seq_lens=state.cache.seq_lens.at[upd].set(L + n, mode="drop"))
    tables = state.dfa
    if acc.dfa_state is not None:
        tables = dataclasses.replace(tables, state=tables.state.at[upd].set(acc.dfa_state, mode="drop"))
    state = dataclasses.replace(state, cache=cache, penalties=pen, dfa=tables)
    if state.history is not None:  # the n-gram drafter, or a model draft's n-gram branch
        state = dataclasses.replace(state, history=ngram.append(state.history, upd, L, acc.out.tokens, n))
    return state


def _accepted_outputs(info: DraftInfo, ver: Verified, acc: Accepted):
    """The target's outputs at the accepted nodes that the draft extend consumes: (h, aux), each
    [B, S + 1, E] (None where the draft takes no features)."""
    if not info.uses_features:
        return None, None
    idx = jnp.maximum(acc.accept_idx, 0)[:, :, None]  # [B, S + 1, 1]
    take = functools.partial(jnp.take_along_axis, indices=idx, axis=1)
    return take(ver.h), tuple(take(a) for a in ver.aux)


def extend_draft(info: DraftInfo, target, draft, state: SpecState, slots, active, tokens, h, aux, n):
    """The draft's side of _commit: the draft extend over the n [B] entries tokens [B, T] (with the
    target's outputs h / aux [B, T, E] there) from each row's draft length Ld, and Ld + n.
    Returns (state, h_last [B, E], logits_last [B, Vd])."""
    rs, active = live_rows(state, slots, active)
    Ld = state.draft_seq_lens[rs]
    feats = drafter.target_features(info, draft, h, aux) if info.uses_features else None
    h_last, lg_last, dkv = draft_tree.extend(info, draft, target, state.draft_kv, state.cache.page_table[rs],
                                             state.cache.page_size, jnp.maximum(tokens, 0), feats, Ld, n)
    upd = jnp.where(active, slots, state.cache.seq_lens.shape[0])
    draft_seq_lens = state.draft_seq_lens.at[upd].set(Ld + n, mode="drop")
    return dataclasses.replace(state, draft_kv=dkv, draft_seq_lens=draft_seq_lens), h_last, lg_last


def _commit(info: DraftInfo, target, draft, state: SpecState, ver: Verified, acc: Accepted, slots, active):
    """What a step commits for its n emitted tokens, the next tree aside (draft_next and the lite step):
    lengths L + n (target) and Ld + n (draft), penalty counts, the draft extend over the accepted
    entries (EAGLE: with the target's features at the accepted nodes), or for the n-gram drafter the
    tokens appended to the history. Returns (state, h_last [B, E], logits_last [B, Vd]) (None, None
    for the n-gram drafter): the draft's output after the last accepted entry."""
    state = commit_target(state, acc, slots, active)
    if not info.has_model:
        return state, None, None
    h, aux = _accepted_outputs(info, ver, acc)
    return extend_draft(info, target, draft, state, slots, active, acc.out.tokens, h, aux, acc.out.num_accepted)


def draft_next(info: DraftInfo, spec: SpecConfig, target, draft, state: SpecState, ver: Verified, acc: Accepted,
               slots, active, samp, stochastic, grammar_drafts=None, kernels: Kernels = Kernels()) -> SpecState:
    """Lengths update, penalty counts of the emitted tokens, draft extend over the accepted entries and
    the next tree -> the new state. grammar_drafts: optional [B, N, S + 1] int32, the grammar's
    continuation after each node of the verified tree (specjax.grammar_drafts), drafted into the
    next tree where it starts with the bonus token (not used by the n-gram drafter)."""
    rs, active = live_rows(state, slots, active)
    upd = jnp.where(active, slots, state.cache.seq_lens.shape[0])
    n = acc.out.num_accepted
    L2 = state.cache.seq_lens[rs] + n
    new, h_last, lg_last = _commit(info, target, draft, state, ver, acc, slots, active)
    if not info.has_model:  # the next tree looked up in the history
        nxt = ngram.propose(new.history[rs], L2 + 1, acc.bonus, spec)
        return store_slots(new, upd, nxt, None, new.draft_kv, new.draft_seq_lens, new.cache)
    forced = None
    if grammar_drafts is not None:
        last = jnp.take_along_axis(acc.accept_idx, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]  # [B] node n*
        forced = draft_tree.grammar_levels(grammar_drafts, jnp.maximum(last, 0), acc.bonus, spec.num_steps)
    pt, ps = state.cache.page_table[rs], state.cache.page_size
    nxt, probs, dkv = draft_tree.grow(info, spec, draft, target, new.draft_kv, pt, ps, active.astype(jnp.int32),
                                      acc.bonus, L2, state.draft_seq_lens[rs] + n, h_last, lg_last, samp,
                                      (stochastic if state.draft_probs is not None else False),  # UNFILTERED kept
                                      draft_penalty_rows(info, new.penalties, rs), forced,
                                      draft_dfa_view(info, state, rs, acc.dfa_state), kernels.draft_topk)
    if spec.ngram_branch:
        nxt = ngram.add_branch(new.history[rs], L2 + 1, nxt, spec)
    return store_slots(new, upd, nxt, probs, dkv, new.draft_seq_lens, new.cache)


def spec_step(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState, slots, active,
              samp: SamplingArrays, want_logprobs=False, stochastic=True, token_mask=None,
              kernels: Kernels = Kernels(), grammar_drafts=None, dfa: bool = False):
    """One fused speculative step for rows `slots` [B] with `active` [B] bool -> (SpecOut, state).
    The caller must have pages for lookahead(spec, info) entries past L of every active slot.
    kernels: static kernel choices (specjax.kernels; default: the jnp references).
    token_mask [B, N, W] / grammar_drafts [B, N, S + 1]: grammar masks of the stored tree and the
    grammar's continuations after its nodes (draft_next). dfa (static): device DFAs (accept)."""
    target, draft = merge_models(tgd, tp, dgd, dp)
    with jax.named_scope("verify"):
        ver = verify_forward(info, spec, target, state, slots, active)
    with jax.named_scope("accept"):
        acc = accept(spec, state, ver, slots, active, samp, want_logprobs, stochastic, token_mask, kernels, dfa)
    with jax.named_scope("draft"):
        new_state = draft_next(info, spec, target, draft, state, ver, acc, slots, active, samp, stochastic,
                               grammar_drafts, kernels)
    return acc.out, new_state
