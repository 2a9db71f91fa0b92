"""Prefill seeds the target cache, the draft and the first tree. It runs on pieces (decode.PrefillRows):
a piece at cache index a with n new tokens writes target entries a .. a+n-1 and draft entries
a .. a+n-1 (+1 for a final piece of a shift-0 draft: its entry for the sampled token); the token
after the piece is the next prompt token, or the sampled one for the final piece. The draft entries
before a are in the cache already (a shared prefix: specjax.prefix_cache keys pages by the s tokens
after them too; an earlier chunk). Only final pieces grow the first tree.

admit_slots writes what the pieces do not carry (a piece may hold part of the sequence only): the
penalty state and the n-gram history. The cache layout per slot and the fused step: specjax.step."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax import decode, draft_tree, drafter, ngram
from specjax.drafter import DraftInfo
from specjax.kernels import Kernels
from specjax.penalties import PenaltyParams
from specjax.sampling import SamplingArrays
from specjax.step import SpecState, draft_dfa_view, draft_penalty_rows, merge_models, store_slots
from specjax.tree import SpecConfig


def spec_prefill_rows(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState,
                      rows: decode.PrefillRows, samp: SamplingArrays, want_logprobs=False, stochastic=True,
                      token_mask=None, grammar_drafts=None, dfa=False, kernels: Kernels = Kernels()):
    """Prefill pieces into the target and the draft; final rows sample the first token and grow the
    first tree. The penalty state (and DFA tables) of the admitted slots must already be written;
    dfa (static): the rows' device DFAs mask the first token and advance. token_mask: optional
    [B, W] grammar bitmask of the first token. grammar_drafts: optional [B, 1, S + 1] int32, the
    grammar's continuation after each prompt (specjax.grammar_drafts), drafted into the first tree.
    Returns (decode.StepOut, state)."""
    target, draft = merge_models(tgd, tp, dgd, dp)
    T = rows.tokens.shape[1]
    max_slots = state.cache.seq_lens.shape[0]
    pen = state.penalties
    v = decode.prefill_dfa(state, rows, dfa)
    out, h, aux, cache = decode.target_prefill(target, state.cache, rows, samp, want_logprobs, stochastic,
                                               info.aux_layers, pen=pen, token_mask=token_mask, dfa_view=v)
    fin = decode.final_slots(rows, max_slots)
    final = (fin < max_slots).astype(jnp.int32)
    # rows that end at a tree's root: final rows (root = the sampled token) and regrown ones (root =
    # next_ids, the slot's last token, already counted by penalties, DFAs and the history)
    ends = final if rows.regrow is None else jnp.maximum(final, (rows.regrow & (rows.lens > 0)).astype(jnp.int32))
    grown = jnp.where(ends > 0, rows.slots, max_slots)
    root = out.tokens if rows.regrow is None else jnp.where(final > 0, out.tokens, rows.next_ids)
    pen = decode.count_first(pen, fin, rows.lens, out.tokens)
    tables = decode.prefill_dfa_advance(state.dfa, v, fin, rows, out.tokens)
    if not info.has_model:  # n-gram: the history holds the sequence (written at admission); add x_P
        end = rows.start + rows.lens  # P, the position of the first sampled token
        hist = ngram.append(state.history, fin, end - 1, out.tokens[:, None], final)
        tree = ngram.propose(hist[jnp.clip(rows.slots, 0, max_slots - 1)], end + 1, out.tokens, spec)
        return out, store_slots(state, fin, tree, None, state.draft_kv, state.draft_seq_lens, cache, pen, hist, tables)
    pt = cache.page_table[jnp.clip(rows.slots, 0, max_slots - 1)]
    ps = cache.page_size
    act = (rows.lens > 0).astype(jnp.int32)
    # draft entry p holds token x_{p + shift}; x_{start + lens} is the sampled token (final rows) or
    # the next prompt token
    sh = info.shift
    after = jnp.where(final > 0, out.tokens, rows.next_ids)
    col = jnp.arange(T + 1, dtype=jnp.int32)[None, :]
    end = (rows.lens - sh)[:, None]  # [B, 1] index of the entry holding x_{start + lens}
    src = jnp.take_along_axis(rows.tokens, jnp.clip(col + sh, 0, T - 1), axis=1)
    dtoks = jnp.where(col < end, src, jnp.where(col == end, after[:, None], 0))  # [B, T + 1]
    feats = drafter.target_features(info, draft, h, aux)
    if feats is not None:
        feats = jnp.pad(feats, ((0, 0), (0, 1), (0, 0)))  # [B, T + 1, E]
    n_d = (rows.lens + (1 - sh) * ends) * act  # draft entries this piece writes
    h_last, lg_last, dkv = draft_tree.extend(info, draft, target, state.draft_kv, pt, ps, dtoks, feats, rows.start,
                                             n_d)
    Ld = rows.start + n_d
    forced = None
    if grammar_drafts is not None:
        forced = draft_tree.grammar_levels(grammar_drafts, jnp.zeros_like(out.tokens), out.tokens, spec.num_steps)
    roots = None if v is None else tables.state[jnp.clip(rows.slots, 0, max_slots - 1)]  # after the root
    tree, probs, dkv = draft_tree.grow(info, spec, draft, target, dkv, pt, ps, act * ends, root,
                                       rows.start + rows.lens, Ld, h_last, lg_last, samp,
                                       (stochastic if state.draft_probs is not None else False),
                                       draft_penalty_rows(info, pen, rows.slots), forced,
                                       draft_dfa_view(info, state, jnp.clip(rows.slots, 0, max_slots - 1), roots),
                                       kernels.draft_topk)
    draft_seq_lens = state.draft_seq_lens.at[rows.slots].set(Ld, mode="drop")
    hist = None
    if state.history is not None:  # the history holds the sequence (written at admission); add x_P
        end = rows.start + rows.lens  # (kept by every tier when one has a branch: specjax.spec_tiers)
        hist = ngram.append(state.history, fin, end - 1, out.tokens[:, None], final)
        if spec.ngram_branch:
            tree = ngram.add_branch(hist[jnp.clip(rows.slots, 0, max_slots - 1)], end + 1, tree, spec)
    return out, store_slots(state, grown, tree, probs, dkv, draft_seq_lens, cache, pen, hist, dfa=tables)


def spec_prefill(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState, tokens, lens, slots,
                 samp: SamplingArrays, want_logprobs=False, stochastic=True,
                 penalty_params: PenaltyParams | None = None, token_mask=None, grammar_drafts=None,
                 kernels: Kernels = Kernels()):
    """Prefill ragged prompts (tokens [B, T], lens [B], slots [B]) into the target, sample the first
    token, seed the draft over the prompt and grow the first tree. penalty_params: the rows'
    penalties (needs state.penalties; None: off for these slots). token_mask: optional [B, W] grammar
    bitmask of the first token; grammar_drafts: optional [B, 1, S + 1] (spec_prefill_rows).
    Returns (decode.StepOut, state)."""
    state = admit_slots(state, tokens, lens, slots, penalty_params)
    return spec_prefill_rows(info, spec, tgd, tp, dgd, dp, state, decode.whole_prompts(tokens, lens, slots), samp,
                             want_logprobs, stochastic, token_mask, grammar_drafts, kernels=kernels)


def admit_slots(state: SpecState, tokens, lens, slots, penalty_params: PenaltyParams | None = None) -> SpecState:
    """The per-slot state of admissions that prefill pieces do not carry (a piece may hold part of the
    sequence only): the penalty state (decode.prefill_penalties) and the n-gram history, over the
    whole sequences tokens [B, T] (lens [B]) of the rows `slots` [B]."""
    state = dataclasses.replace(state, penalties=decode.prefill_penalties(state.penalties, tokens, lens, slots,
                                                                          penalty_params))
    if state.history is None:
        return state
    return dataclasses.replace(state, history=ngram.write_prompt(state.history, slots, tokens, lens, jnp.zeros_like(lens)))
