"""Admission ahead (SchedulerOptions.admit_ahead; specjax.engine, before step 1): when every decoding
row is expected to finish with the dispatches already in flight and a request waits for a slot, the
rows' slots are given up before those dispatches are read, so that the next request's prefill and its
first decode dispatch queue on the device behind them. Without it the device idles at each request
boundary of a full batch while the host reads the last dispatch, delivers it, admits the next request
and launches its prefill and its first dispatch (batch 1 on an H200: ~5.5 ms per plain request, 11-14 ms
per speculative one, docs/benchmarks.md "What a request costs at batch 1").

Expected to finish: certainly (a plain row, or a speculative one whose dispatched steps give it at
least its remaining tokens: Scheduler.stepping leaves it out), or by the estimate that holds a
speculative engine back (Engine._expected_done: its measured tokens per fused step). The device runs
programs in order, so the released rows' dispatches finish before the next request's prefill writes
the slot or takes their freed pages; their outputs are read and delivered as usual (the request
objects travel with the dispatch). A row that the estimate got wrong (outputs read, request not
finished) is put back at the front of the queue and later re-admitted like a preempted request (its
prompt and tokens prefilled again, the prefix cache serving the prompt's pages): outputs unchanged
(tested), counted in `admit_ahead_misses` and as a preemption. The step that releases them also reads
those dispatches (they are older than its own), so between steps no request is outside both the
queue and the slots (cancel finds it there). Off for grammar rows (their steps need
the host), the synchronous loop and several processes. Part of Engine (a mixin over its fields).

Early (SchedulerOptions.admit_early): the same release is tried again right after a step's dispatch,
before the step reads the one before it. The rows' last dispatch is then the newest on the device and
the host launches the next request's prefill while the device still runs the previous dispatch and
that one: the prefill's host calls (page table, admit_slots, prefill: ~5 ms at batch 1 on an H200)
are covered by ~2 dispatches of device work instead of one, and the next step launches the new
request's first dispatch. The estimate is the one the next step would hold back by (_hold_back), one
read earlier. The released requests' newest dispatch is read by the next step, which then puts back a
request that did not finish (as above); until then such a request is in `_released_early` (cancel
finds it there)."""
from __future__ import annotations

from specjax.request import Request


class AdmitAhead:
    """Engine's admission ahead (module doc)."""

    def _release_ahead(self) -> list:
        """Free the slots of rows expected to finish with the dispatches in flight when the queue waits
        for a slot and no other row decodes. Returns their requests (for _requeue_missed)."""
        s = self.sched
        if (not self.opts.admit_ahead or not self.opts.async_loop or self.replica is not None or self.handover
                or self.compiles_from_leader or not s.queue
                or not self._pending or s.prefilling or any(r is None for r in s.slots)):
            return []
        rows = s.decoding()
        if not rows or any(r.grammar is not None or r.dfa is not None for _, r in rows):
            return []
        stepping = {slot for slot, _ in s.stepping()}
        if not all(slot not in stepping or self._expected_done(slot, r) for slot, r in rows):
            return []
        released = rows[: len(s.queue)]  # as many as the queue can use
        for slot, _ in released:
            s.release(slot)
        self.admitted_ahead += len(released)
        return [req for _, req in released]

    def _requeue_missed(self, released: list) -> None:
        """After the step's read (which covers the released rows' dispatches: they are older than the
        step's own, unless SchedulerOptions.unread leaves more unread: such requests wait for a later
        step's read in `_released_early`): a released request that did not finish goes back to the
        front of the queue, re-admitted like a preempted one (its epoch drops any output still on its way)."""
        if not released:  # (most steps)
            return
        unread = {id(r) for e in self._pending for _, _, r, _ in e.rows}
        self._released_early[:0] = [r for r in released if id(r) in unread]
        for req in reversed([r for r in released if id(r) not in unread]):
            if not req.finished:
                self.admit_ahead_misses += 1
                self.sched.requeue(req)

    def _admit_early(self) -> None:
        """Right after a step's dispatch: admission ahead at once (SchedulerOptions.admit_early), the
        freed slots' next requests prefilled behind the dispatch; the released requests are checked
        for misses by the next step's read (_step)."""
        if not self.opts.admit_early:
            return
        released = self._release_ahead()
        if not released:
            return
        self._released_early.extend(released)
        self.admitted_early += len(released)
        self._prefill_planned()

    def _hold_back(self, rows) -> bool:
        """Whether a speculative engine skips this step's dispatch because the fused steps in flight are
        expected to finish every row: a row's `sure` tokens (one per fused step in flight) times its
        measured tokens per fused step reach its max_tokens. A fused dispatch has a static number of
        steps and runs one ahead of the host, so the next one would otherwise run whole past the end
        (the eval measured 4.0 such steps per 256-token request, 4.4 % of its fused steps). If the
        estimate was wrong, the step after the read dispatches again: one host round trip lost.
        Plain decoding needs no estimate (its rows' tokens per step are known: Scheduler.stepping)."""
        return all(self._expected_done(s, r) for s, r in rows)

    def _expected_done(self, slot: int, req: Request) -> bool:
        """A speculative row's fused steps in flight are expected to reach its max_tokens (its `sure`
        steps times its measured tokens per fused step; _hold_back, specjax.engine_ahead)."""
        kinds = {e.kind for e in self._pending}
        if self.draft is None or "spec" not in kinds or kinds & {"lite", "lazy"}:  # those give one token each
            return False
        return req.accept_ema is not None and len(req.token_ids) + self.sched.sure[slot] * req.accept_ema >= req.max_len
