"""The lite step (spec_lite_step, a draft-synced plain step: what the engine runs instead of the fused
step for batches where verifying trees costs more than it gains; specjax.engine):
    target forward over the stored tree's root only (T = 1, the forward of plain decoding)
    -> accept the one-node tree: greedy the argmax; sampling the bonus drawn from p with the bonus
       key of root position L, as a fused step draws it when every child of the root is rejected
       (penalties applied as in accept)
    -> lengths L + 1, penalty counts
    -> draft extend over the emitted token (EAGLE: with the target's features at the root), i.e.
       draft_next with n = 1, so the draft's KV stays in sync
    -> no tree growth: the stored tree keeps nodes 1 .. N - 1, its root becomes the emitted token.
Those stale nodes were fixed before the lite step drew anything, so the next fused step verifies
them losslessly (they continue an older prefix and are rarely accepted; that step grows a fresh
tree): point masses (trees, n-gram; draft_probs None) by the point-mass rule, and a sampled chain
node t_i keeps its proposal draft_probs[i]: it was drawn from it with the draft's own random stream
(keyed by positions that no verification has revealed: the lite steps draw from the verification
stream), so given everything emitted since, t_i is still a draw from draft_probs[i] (given its
parent), which is all the min(1, p/q) rule needs. The n-gram drafter appends the token to the
history. Grammar batches never run lite steps. A lite step touches lite_lookahead(info) entries past L.

The fused step and the state: specjax.step."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafter import DraftInfo
from specjax.kernels import Kernels
from specjax.sampling import SamplingArrays
from specjax.step import (SpecOut, SpecState, TreeShape, accept, commit_target, extend_draft, live_rows, merge_models,
                          verify_forward)
from specjax.tree import SpecConfig


def lite_lookahead(info: DraftInfo, num_steps: int = 1) -> int:
    """Cache entries past L that num_steps lite steps may touch: the target writes L .. L + K - 1,
    the draft extend draft indices up to L + K - shift (no draft KV for the n-gram drafter)."""
    return num_steps + (1 - info.shift if info.has_model else 0)


ROOT_ONLY = TreeShape(num_nodes=1, num_steps=0, is_chain=True)  # the lite step's tree: the root alone


def root_view(state: SpecState) -> SpecState:
    """The state seen by a step over the stored trees' roots only (ROOT_ONLY): node 0 of each tree,
    no draft proposals."""
    return dataclasses.replace(state, tree=state.tree[:, :, :1], draft_probs=None)


def _widen(out: SpecOut, width: int) -> SpecOut:
    """A one-token SpecOut in the fused step's layout: tokens / logprobs [B, width] (-1 / 0 padded),
    accept_hist [width + 1]."""
    def pad(x, value):
        return None if x is None else jnp.pad(x, ((0, 0), (0, width - x.shape[1])) + ((0, 0),) * (x.ndim - 2),
                                                constant_values=value)
    return SpecOut(tokens=pad(out.tokens, -1), num_accepted=out.num_accepted,
                   accept_hist=jnp.pad(out.accept_hist, (0, width + 1 - out.accept_hist.shape[0])),
                   logprob=pad(out.logprob, 0.0), top_logprobs=pad(out.top_logprobs, 0.0), top_ids=pad(out.top_ids, 0))


def spec_lite_step(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState, slots, active,
                   samp: SamplingArrays, want_logprobs=False, stochastic=True, kernels: Kernels = Kernels(),
                   dfa: bool = False):
    """A draft-synced plain step (the "lite" step; see the module doc) for rows `slots` [B] with
    `active` [B] bool -> (SpecOut in spec_step's layout, num_accepted 1 for active rows; state):
    the target forward over each stored tree's root, the next token drawn as the fused step draws
    its bonus when the root's children are all rejected, lengths, penalty counts and the draft
    extend over that token (draft_next with n = 1), no new tree: the stored tree keeps its nodes
    1 .. N - 1 (and their draft_probs), its root becomes the emitted token.
    The caller must have pages for lite_lookahead(info) entries past L of every active slot."""
    out, new, root = spec_lite_target(info, spec, tgd, tp, dgd, dp, state, slots, active, samp, want_logprobs,
                                      stochastic, kernels, dfa)
    steps = jax.tree.map(lambda x: x[None], (out, root))  # K = 1
    new = lite_draft_sync(info, spec, tgd, tp, dgd, dp, new, slots, active, steps)
    return _widen(out, spec.num_steps + 1), new


def spec_lite_target(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState, slots, active,
                     samp: SamplingArrays, want_logprobs=False, stochastic=True, kernels: Kernels = Kernels(),
                     dfa: bool = False):
    """spec_lite_step without its draft extend -> (SpecOut, state, root): the SpecOut of the root alone
    (tokens [B, 1]; widen_lite or _widen give the fused layout), root = the target's outputs at the root
    that the extend consumes: (h, None) for an EAGLE head, (None, aux) for EAGLE-3 ([B, 1, E] each),
    (None, None) without features. K of these, then one lite_draft_sync over their K tokens, leave
    the state K lite steps leave (the draft is not read in between: a lite step verifies the root
    alone), with one draft forward instead of K. Only what the draft reads is returned: each output
    of a step in a dispatch's loop is one more kernel per step."""
    target, _ = merge_models(tgd, tp, dgd, dp)
    view = root_view(state)
    with jax.named_scope("verify"):
        ver = verify_forward(info, ROOT_ONLY, target, view, slots, active)
    with jax.named_scope("accept"):
        acc = accept(ROOT_ONLY, view, ver, slots, active, samp, want_logprobs, stochastic, kernels=kernels, dfa=dfa)
    new = commit_target(state, acc, slots, active)
    _, active = live_rows(state, slots, active)
    upd = jnp.where(active, slots, state.cache.seq_lens.shape[0])
    new = dataclasses.replace(new, tree=new.tree.at[upd, 0, 0].set(acc.bonus, mode="drop"))
    root = (ver.h if info.method == "eagle" else None, tuple(ver.aux) if info.method == "eagle3" else None)
    return acc.out, new, root  # one node: the root is the accepted node (no gather)


def widen_lite(outs: SpecOut, width: int) -> SpecOut:
    """K lite steps' SpecOut ([K, B, 1] tokens, num_accepted [K, B]; accept_hist None: rebuilt here,
    out of the dispatch's loop) -> the fused layout: tokens [K, B, width], accept_hist [K, width + 1]."""
    hist = jax.vmap(lambda n: jnp.zeros((width + 1,), jnp.int32).at[n].add((n > 0).astype(jnp.int32)))(
        outs.num_accepted)
    return jax.vmap(lambda o, h: _widen(dataclasses.replace(o, accept_hist=h), width))(outs, hist)


def lite_draft_sync(info: DraftInfo, spec: SpecConfig, tgd, tp, dgd, dp, state: SpecState, slots, active,
                    steps) -> SpecState:
    """The draft extend of K lite steps at once: steps = (SpecOut, root) of spec_lite_target stacked
    over K ([K, B, ...]); a row's emitted tokens are those of its first n steps (n = its summed
    num_accepted: a row that finished stays inactive), written from its draft length on."""
    if not info.has_model:  # the n-gram drafter: the history was appended by each step
        return state
    target, draft = merge_models(tgd, tp, dgd, dp)
    out, (h, aux) = steps

    def by_row(x):  # [K, B, 1, ...] (one node per step) -> [B, K, ...]
        return None if x is None else jnp.swapaxes(x[:, :, 0], 0, 1)
    with jax.named_scope("draft_extend"):
        new, _, _ = extend_draft(info, target, draft, state, slots, active, by_row(out.tokens), by_row(h),
                                  None if aux is None else tuple(by_row(a) for a in aux), out.num_accepted.sum(0))
    return new
