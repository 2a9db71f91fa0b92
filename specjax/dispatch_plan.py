"""What the engine's next decode dispatch runs: the program kind, its steps per dispatch (K) and the
KV pages those steps need beyond the scheduler's one-step reservation. Host only, no device work.

    rows (slot, request) of the step, grammar or not
    -> kind  "decode"  plain decoding (an engine without a draft)
             "spec"    fused speculative steps (specjax.step.spec_step)
             "lite"    lite steps (specjax.step.spec_lite_step: plain decoding that keeps the draft in
                       sync), for a speculative engine's batch of >= speculate_below rows
    -> K     decode / lite: steps_per_call, bucketed by the most tokens a row still needs (few
             programs: one per bucket); spec: spec_steps_per_call; a grammar batch: 1
    -> pages the scheduler reserved pages for one step of the engine's kind (`ahead` entries past
             each slot's length bound); K steps may need more: taken here for every row or for none
             (then K = 1: a tight page budget never preempts or fails a request for more steps)
    -> advance (cache positions a row may gain: the scheduler's `inflight`) and sure (steps: each
             gives an unfinished row >= 1 token)

Adaptive speculation: verifying a tree costs a forward over N tokens; where the batch is large the
target is compute-bound and the fused step costs several plain steps, more than the accepted tokens
(tau) repay. From `speculate_below` rows on, the engine runs lite steps: one token per row per step
at the cost of a plain step plus the draft's extend over that token, and its draft trees stay valid
(specjax.step, "The lite step"), so fused steps resume losslessly when the batch shrinks. Grammar
batches always run fused steps (their masks cover one tree). The threshold compares the rows of
the step (not their padded bucket); the programs of both kinds compile on first use per batch bucket.
Below that threshold the acceptance gate (specjax.adaptive, BatchOptions.min_accept) also picks lite
steps while the rows' measured acceptance does not repay a fused step.
"""
from __future__ import annotations

from typing import NamedTuple

from specjax.scheduler import Scheduler, bucket


class DispatchPlan(NamedTuple):
    kind: str  # "decode" | "spec" | "lite"
    num_steps: int  # K, steps in the dispatch
    advance: int  # cache positions a row may gain (scheduler.inflight)
    sure: int  # steps run: tokens a row gets at least, or it finishes (scheduler.sure)


def runs_lite(n_rows: int, speculate_below: int | None) -> bool:
    """Lite steps for a speculative batch of n_rows rows without grammars (None: always fused)."""
    return speculate_below is not None and n_rows >= speculate_below


def _work_steps(rows, steps_per_call: int) -> int:
    """steps_per_call, bucketed by the most tokens a row still needs."""
    return min(steps_per_call, bucket(max(r.max_len - len(r.token_ids) for _, r in rows), 1, steps_per_call))


def plan(rows, grammar: bool, batch_opts, sched: Scheduler, draft=None, lookahead: int = 0,
         gated: bool = False) -> DispatchPlan:
    """The next decode dispatch over rows [(slot, request)]; takes the pages of K > 1 steps from the
    scheduler (the caller pushes the page table when it changed). draft: the engine's Draft (None:
    plain decoding); lookahead: entries one fused step touches past a slot's length (step.lookahead,
    the scheduler's `ahead` for a speculative engine); gated: the acceptance gate chose lite steps
    (specjax.adaptive: the rows' drafts do not repay a fused step)."""
    slots = [s for s, _ in rows]
    if draft is None:
        K = 1 if grammar else _work_steps(rows, batch_opts.steps_per_call)
        return DispatchPlan("decode", K, K, K)
    if not grammar and (gated or runs_lite(len(rows), batch_opts.speculate_below)):
        from specjax.step import lite_lookahead
        K = _work_steps(rows, batch_opts.steps_per_call)
        extra = lite_lookahead(draft.info, K) - lookahead  # one lite step touches <= 2 <= lookahead entries
        if extra > 0 and not sched.ensure_extra(slots, extra):
            K = 1
        return DispatchPlan("lite", K, K, K)
    per_step = draft.spec.num_steps + 1
    K = 1 if grammar else batch_opts.spec_steps_per_call
    if K > 1 and not sched.ensure_extra(slots, (K - 1) * per_step):
        K = 1
    return DispatchPlan("spec", K, K * per_step, K)
