"""Row hand-over (SchedulerOptions.handover; specjax.engine): a speculative engine with a spare slot per
row, where the next queued request is prefilled ahead ("parked": Scheduler.parked). Each fused dispatch
names, for every row, the parked request that follows it (programs.Successors); inside the dispatch a
row whose request has no live step left (it finished in this dispatch, or in one the host has not read
yet: SpecState.done, its length limit) runs the successor for the remaining steps. So

  - the steps after a request's end are not lost: a fused dispatch has a static number of steps (K), and
    without hand-over the steps after the row's last token run with no active row (~3 % of the fused
    steps at batch 1, 256 tokens per request);
  - the host launches no request boundary: the next request's prefill was queued long before (right
    after a dispatch, while the device has one or two dispatches of work queued), and no step waits for
    the finishing row's last read; no admission ahead is needed (no estimate, no misses: a row's slot is
    given up only once the host has read that it finished).

The host learns which request each step ran from the dispatch's `out.slot` [K, B] and delivers the
tokens by slot (specjax.engine_results). A successor's slot gets the dispatch's cache positions in
`inflight` (it may run every step) and no `sure` tokens (it may run none). A parked request becomes a
row when its predecessor's slot is freed, or at once in place of a row that the dispatches in flight
certainly finish (Scheduler.stepping). Rows with a grammar or a device DFA neither hand over nor follow:
their dispatches take one step (grammar) or their own flags. Lite and lazy dispatches (large batches) run
without hand-over. Not with spec tiers. Part of Engine (a mixin over its fields)."""
from __future__ import annotations

import numpy as np

from specjax import programs as prog


def device_slots(num_slots: int, speculative: bool) -> int:
    """Slots of a speculative engine's device state: at least two. With one slot (max_batch 1 without
    hand-over), XLA on the GPU (jax 0.11.2; an H100 and an H200, sessions 44-45, docs/benchmarks.md "One
    slot without hand-over") compiled the fused loop of K > 1 steps wrong: its first step already gave
    other tokens than plain greedy decoding, while the same state replayed through one step (K = 1), or
    padded to two slots, gave plain's. The spare slot is never a row's (padding rows read it, their
    writes are dropped); it costs a row of the slot arrays, no KV pages."""
    return max(num_slots, 2) if speculative else num_slots


class HandOver:
    """Engine's row hand-over (module doc)."""

    @property
    def opts(self):
        """The engine's SchedulerOptions, hand-over and unread decided (SchedulerOptions.resolve_boundary)."""
        return self._opts

    @opts.setter
    def opts(self, sched) -> None:  # (tests swap the options of an engine they reuse)
        d = self.draft
        tiers = d is not None and d.tiers is not None
        self._opts = sched.resolve_boundary(d is not None, self.batch_opts.max_batch, tiers, self.mesh is not None)

    def _handover_slots(self, max_batch: int, draft) -> int:
        """Slots of the engine: max_batch, twice that with hand-over (a speculative engine only)."""
        if not self.opts.handover or draft is None:
            return max_batch
        if draft.tiers is not None:
            raise ValueError("SchedulerOptions(handover=True) does not combine with tree tiers (spec_tiers): "
                             "turn one of them off")
        return 2 * max_batch

    @property
    def handover(self) -> bool:
        """Whether this engine hands rows over (it has spare slots)."""
        return self.num_slots > self.batch_opts.max_batch

    def _defer_admission(self) -> bool:
        """Admit queued requests after this step's dispatch (not before it): some row decodes, so the
        prefill's host calls overlap the device's queued work; unfinished chunked prefills go first."""
        return self.handover and not self.sched.prefilling and bool(self.sched.decoding())

    def _handover_rows(self, rows: list) -> tuple[list, list]:
        """(rows, successors) of the next dispatch from the stepping rows: a decoding row that the
        dispatches in flight certainly finish gives its place to the oldest parked request; every row
        then gets the next parked request as successor (None where none is left). Grammar and DFA
        requests are not taken from the parked ones (they run as rows once a row is free)."""
        s = self.sched
        parked = [(slot, r) for slot, r in s.parked() if r.grammar is None and r.dfa is None
                  and len(r.token_ids) + s.sure[slot] < r.max_len]
        stepping = {slot for slot, _ in rows}
        out = []
        for slot, req in s.decoding():
            if slot in stepping:
                out.append((slot, req))
            elif parked:
                out.append(parked.pop(0))
        return out, [parked.pop(0) if parked else None for _ in out]

    def _successor_arg(self, rows: list, succ: list | None, B: int) -> prog.Successors:
        """The programs' Successors for B rows (padding: slot num_slots, never live); their stop rows as
        wide as the rows' (Engine._stop_rows)."""
        succ = list(succ or ())
        slots = np.full(B, self.num_slots, np.int32)
        slots[: len(succ)] = [self.num_slots if x is None else x[0] for x in succ]
        return prog.Successors(slots, self._stop_rows(succ, B, also=rows))
