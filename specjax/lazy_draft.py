"""Lazy drafts: plain decoding's own program on the speculative state, the draft left behind.

Where a speculative engine runs plain steps for a large batch (BatchOptions.speculate_below), a lite
step (specjax.step, "The lite step") keeps the draft in sync: it is plain decoding plus the target's
features, the draft's extend and their bookkeeping, ~1-3 % slower than plain decoding's step on an
H200 (docs/benchmarks.md). An EAGLE head (shift 1: draft entry p holds x_{p+1} with the target's
features at p) can instead be brought up to date when it is needed again:

    lazy steps (plain_steps): decode.decode_many, unchanged, over a DecodeState view of the
      speculative state (the cache, each stored tree's root as the slot's last token, penalties,
      DFAs); the emitted token becomes the tree's root, nodes 1 .. N - 1 stay (stale, verified
      losslessly like after lite steps); draft_seq_lens stay at Ld < L.
    catch-up (the engine, before the first dispatch that reads the draft: fused, gated lite or
      grammar): prefill pieces that do not end the prompt (decode.PrefillRows, final False) over
      x_Ld .. x_{L-1} from start Ld with next_ids x_L: the target's forward over them gives the
      features (its K/V entries Ld .. L-1 are written again), the draft is extended to Ld = L and
      no tree is grown (step_prefill.spec_prefill_rows); the stale tree is verified once as after lite steps.

Sampling stays exact: lazy steps draw from plain decoding's stream (fold_in(key(seed), position)),
independent of the draft's own stream the stale nodes were drawn from (specjax.step's argument for
lite steps holds unchanged). Draft models (shift 0), the n-gram drafter and an n-gram branch (both
keep a token history the steps must append to) keep lite steps. Host side: specjax.engine_catchup.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax import decode
from specjax.drafter import DraftInfo
from specjax.step import SpecOut, SpecState
from specjax.step_lite import widen_lite
from specjax.tree import SpecConfig


def supports_lazy(info: DraftInfo, spec: SpecConfig) -> bool:
    """Whether this draft may be left behind during plain steps (module doc)."""
    return info.shift == 1 and info.has_model and not spec.ngram_branch


def plain_steps(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState, slots, active, samp,
                num_steps: int, want_logprobs=False, stochastic=True, dfa=False):
    """num_steps plain decoding steps (decode.decode_many) for rows `slots` [B] with `active` [B]
    bool on the speculative state -> (SpecOut in the fused layout with [K, B] fields: one token per
    active row and step, as K lite steps give; state: lengths, roots, penalties and DFA states
    advanced, the draft untouched). Rows do not stop inside the dispatch (as in plain decoding: the
    host drops tokens past a request's end)."""
    del info, dgd, dp  # the draft is not run
    view = decode.DecodeState(cache=state.cache, last_tokens=state.tree_tokens[:, 0], penalties=state.penalties,
                              dfa=state.dfa)
    outs, view = decode.decode_many(tgd, tp, view, slots, active, samp, num_steps, want_logprobs=want_logprobs,
                                    stochastic=stochastic, dfa=dfa)  # fields [K, B, ...]
    state = dataclasses.replace(state, cache=view.cache, tree=state.tree.at[:, 0, 0].set(view.last_tokens),
                                penalties=view.penalties, dfa=view.dfa)
    on = active[None, :]  # [1, B]
    one = SpecOut(tokens=jnp.where(on, outs.tokens, -1)[..., None],  # [K, B, 1]: the lite steps' layout
                  num_accepted=jnp.broadcast_to(on, outs.tokens.shape).astype(jnp.int32), accept_hist=None,
                  logprob=None if outs.logprob is None else outs.logprob[..., None],
                  top_logprobs=None if outs.top_logprobs is None else outs.top_logprobs[:, :, None],
                  top_ids=None if outs.top_ids is None else outs.top_ids[:, :, None])
    return widen_lite(one, spec.num_steps + 1), state
