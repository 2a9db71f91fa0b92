"""What the engine's next decode dispatch runs: the program kind, its steps per dispatch (K) and the
KV pages those steps need beyond the scheduler's one-step reservation. Host only, no device work.

    rows (slot, request) of the step, grammar or not
    -> kind  "decode"  plain decoding (an engine without a draft)
             "spec"    fused speculative steps (specjax.step.spec_step)
             "lite"    lite steps (specjax.step_lite.spec_lite_step: plain decoding that keeps the draft in
                       sync), for a speculative engine's batch of >= speculate_below rows
             "lazy"    instead of "lite" for an EAGLE head (BatchOptions.lazy_draft): plain decoding's
                       program, the draft left behind and caught up when it is read again
                       (specjax.lazy_draft); the acceptance gate's lite steps stay "lite"
    -> K     decode / lite / lazy: steps_per_call, bucketed by the most tokens a row still needs (few
             programs: one per bucket); spec: spec_steps_per_call; a grammar batch: 1; adaptive
             steps (StepsCap) lower the cap, with a program compiled for the rows (else the nearest
             level's, the wanted one compiled in the background)
    -> pages the scheduler reserved pages for one step of the engine's kind (`ahead` entries past
             each slot's length bound); K steps may need more: taken here for every row or for none
             (then K = 1: a tight page budget never preempts or fails a request for more steps)
    -> advance (cache positions a row may gain: the scheduler's `inflight`) and sure (steps: each
             gives an unfinished row >= 1 token)

Adaptive speculation: verifying a tree costs a forward over N tokens; where the batch is large the
target is compute-bound and the fused step costs several plain steps, more than the accepted tokens
(tau) repay. From `speculate_below` rows on, the engine runs lite steps: one token per row per step
at the cost of a plain step plus the draft's extend over that token, and its draft trees stay valid
(specjax.step, "The lite step"), so fused steps resume losslessly when the batch shrinks; with an EAGLE
head they are "lazy" instead (plain decoding's program exactly, the draft brought up to date by one
prefill-like catch-up per lagging row when a dispatch reads it again: specjax.lazy_draft). Grammar
batches always run fused steps (their masks cover one tree). The threshold compares the rows of
the step (not their padded bucket); the programs of both kinds compile on first use per batch bucket.
Below that threshold the acceptance gate (specjax.adaptive, BatchOptions.min_accept) also picks lite
steps while the rows' measured acceptance does not repay a fused step.
"""
from __future__ import annotations

from typing import NamedTuple

from specjax.scheduler import Scheduler, bucket


class DispatchPlan(NamedTuple):
    kind: str  # "decode" | "spec" | "lite" | "lazy"
    num_steps: int  # K, steps in the dispatch
    advance: int  # cache positions a row may gain (scheduler.inflight)
    sure: int  # steps run: tokens a row gets at least, or it finishes (scheduler.sure)
    wanted: int | None = None  # the adapted K, when its program was not ready and num_steps ran instead


class StepsCap:
    """Adaptive steps per dispatch (BatchOptions.adaptive_steps): a new request's prefill queues on the
    device behind the dispatches in flight (up to two: the engine reads one step behind), so K steps
    per dispatch cost a new request up to ~2K steps of waiting. Where the host waits for the device
    (light load: its work per dispatch is short) that wait is pure latency and K halves, down to a
    quarter of the configured steps per call (MAX_LEVEL halvings); where the host is the bottleneck
    (it barely waits: many rows and streams, each dispatch's outputs delivered and streamed), fewer
    steps per dispatch would cost throughput and K doubles back. The signal: the share of the engine
    loop's wall time spent waiting for device results, averaged over recent steps (`observe`). K
    changes only how steps are grouped into dispatches: outputs are those of any fixed K (tests).
    A level change never compiles on the engine thread: each level runs other programs (K is
    static), and a level's program for the batch's rows bucket (and flags) that is not compiled yet
    is compiled on a worker thread (specjax.background_compile) while the dispatches run the nearest
    level whose program is (`chain`, `plan`'s ready); the engine switches at the first step after it
    is ready. Rows for which no level's program is compiled (a new bucket) run the configured steps
    per call, compiled on first use as with a fixed K (Engine logs each new program; /metrics counts
    compilations on the engine thread and in the background). Several processes: process 0 decides
    the level and when a compiled program is taken (specjax.multihost). Not adaptive: the configured
    steps per call, nothing compiled in the background."""
    SHRINK_ABOVE, GROW_BELOW = 0.5, 0.2  # waiting share of the loop; between them K stays
    ALPHA = 0.25  # weight of the newest step in the average
    MAX_LEVEL = 2  # K >= steps_per_call / 4

    def __init__(self, adaptive: bool):
        self.adaptive = adaptive  # observe() adapts the level (off on a multi-host follower: process 0's)
        self.span = self.MAX_LEVEL if adaptive else 0  # levels the engine may run
        self.level = 0  # halvings of the configured steps per call
        self.wait = None  # the average waiting share since the last change

    def caps(self, batch_opts, level: int | None = None) -> tuple[int, int]:
        """(plain / lite, fused speculative) steps per dispatch at most (at this level, or the current)."""
        lv = self.level if level is None else level
        return (max(1, batch_opts.steps_per_call >> lv), max(1, batch_opts.spec_steps_per_call >> lv))

    def chain(self, batch_opts) -> list[tuple[int, int]]:
        """The caps of this level, then of the other levels, nearest first (plan's `caps`: a level
        whose program is not compiled for the rows gives way to the nearest one that is)."""
        levels = sorted(set(range(self.span + 1)) | {self.level}, key=lambda lv: (abs(lv - self.level), lv))
        return [self.caps(batch_opts, lv) for lv in levels]

    def observe(self, wait_s: float, loop_s: float) -> bool:
        """One engine step that read device results: wait_s of its loop_s spent waiting. Returns
        whether the level changed."""
        if not self.adaptive or loop_s <= 0:
            return False
        share = min(1.0, max(0.0, wait_s / loop_s))
        self.wait = share if self.wait is None else (1 - self.ALPHA) * self.wait + self.ALPHA * share
        if self.wait > self.SHRINK_ABOVE and self.level < self.MAX_LEVEL:
            return self.set(self.level + 1)
        if self.wait < self.GROW_BELOW and self.level > 0:
            return self.set(self.level - 1)
        return False

    def set(self, level: int) -> bool:
        """Set the level (a multi-host follower applies process 0's); the average starts again."""
        changed, self.level, self.wait = level != self.level, level, None
        return changed


def runs_lite(n_rows: int, speculate_below: int | None) -> bool:
    """Lite steps for a speculative batch of n_rows rows without grammars (None: always fused)."""
    return speculate_below is not None and n_rows >= speculate_below


def lazy_ok(draft, batch_opts) -> bool:
    """Whether this engine's lite steps for large batches leave the draft behind (specjax.lazy_draft)."""
    from specjax.lazy_draft import supports_lazy
    if not batch_opts.lazy_draft or draft is None:
        return False
    specs = (draft.spec,) if draft.tiers is None else draft.tiers.specs  # a branch in any tier keeps a history
    return all(supports_lazy(draft.info, s) for s in specs)


def runs_lazy(n_rows: int, grammar: bool, draft, batch_opts) -> bool:
    """Whether a decode dispatch over n_rows rows is "lazy" (it reads no draft): the one rule for
    plan() and the engine's catch-up (specjax.engine_catchup)."""
    return not grammar and runs_lite(n_rows, batch_opts.speculate_below) and lazy_ok(draft, batch_opts)


def _work_steps(rows, steps_per_call: int) -> int:
    """steps_per_call, bucketed by the most tokens a row still needs."""
    return min(steps_per_call, bucket(max(r.max_len - len(r.token_ids) for _, r in rows), 1, steps_per_call))


def _steps(kind: str, rows, grammar: bool, caps: tuple[int, int]) -> int:
    """K of a dispatch of this kind under caps (plain / lite, fused), before the page check."""
    if grammar:
        return 1
    return caps[1] if kind == "spec" else _work_steps(rows, caps[0])


def plan(rows, grammar: bool, batch_opts, sched: Scheduler, draft=None, lookahead: int = 0,
         gated: bool = False, caps: list[tuple[int, int]] | None = None, ready=None, spec=None) -> DispatchPlan:
    """The next decode dispatch over rows [(slot, request)]; takes the pages of K > 1 steps from the
    scheduler (the caller pushes the page table when it changed). draft: the engine's Draft (None:
    plain decoding); lookahead: entries one fused step touches past a slot's length (step.lookahead,
    the scheduler's `ahead` for a speculative engine); gated: the acceptance gate chose lite steps
    (specjax.adaptive: the rows' drafts do not repay a fused step); caps: (plain / lite, fused) steps
    per dispatch at most, in order of preference (StepsCap.chain; None: batch_opts' steps_per_call,
    spec_steps_per_call); ready(kind, K): whether the program of K steps is compiled for these rows
    (None: all are). The first cap whose K is ready is taken; none: the configured steps (compiled
    on first use, as with a fixed K); `wanted` is the first cap's K when it was not taken (the caller
    compiles it elsewhere); spec: the tree shape the dispatch runs (None: the draft's)."""
    slots = [s for s, _ in rows]
    last = (batch_opts.steps_per_call, batch_opts.spec_steps_per_call)
    if draft is None:
        kind = "decode"
    elif runs_lazy(len(rows), grammar, draft, batch_opts):
        kind = "lazy"
    elif not grammar and (gated or runs_lite(len(rows), batch_opts.speculate_below)):
        kind = "lite"
    else:
        kind = "spec"
    Ks = [_steps(kind, rows, grammar, c) for c in (caps or [last])]
    K = next((k for k in Ks if ready is None or ready(kind, k)), _steps(kind, rows, grammar, last))
    wanted = None if K == Ks[0] else Ks[0]
    if kind == "decode":
        return DispatchPlan("decode", K, K, K, wanted)
    if kind in ("lite", "lazy"):  # a lazy step touches L .. L + K - 1, fewer than lite_lookahead
        from specjax.step_lite import lite_lookahead
        extra = lite_lookahead(draft.info, K) - lookahead  # one lite step touches <= 2 <= lookahead entries
        if extra > 0 and not sched.ensure_extra(slots, extra):
            K = 1
        return DispatchPlan(kind, K, K, K, wanted)
    per_step = (spec or draft.spec).num_steps + 1
    if K > 1 and not sched.ensure_extra(slots, (K - 1) * per_step):
        K = 1
    return DispatchPlan("spec", K, K * per_step, K, wanted)


def context_bound(rows, sched: Scheduler, advance: int) -> int:
    """The most keys a row of the dispatch may hold by its end: its length, what the unread steps and
    this dispatch (`advance`) may add, the step's lookahead entries; at most a slot's capacity."""
    return max(min(int(sched.lens[s] + sched.inflight[s]) + advance + sched.ahead, sched.capacity)
               for s, _ in rows)
