"""The engine's catch-up of drafts left behind by lazy steps (specjax.lazy_draft; dispatch kind
"lazy": a speculative engine's batches of >= speculate_below rows with an EAGLE head).

    results: the first lazy dispatch read for a request records its slot's draft length Ld (the
      slot's length before that dispatch: the draft was in sync up to there) in `_lag`;
    before a dispatch that reads the draft (fused, the gate's lite steps, grammar steps), i.e. any
      decode dispatch that is not lazy, while a lazy dispatch was read or is in flight: every dispatch in
      flight is read (the host then knows x_0 .. x_L of each row), and the rows are prefilled as
      pieces that do not end their prompt (x_Ld .. x_{L-1} from Ld, next token x_L), a row's lag
      split into chunks of at most prefill_chunk tokens, the pieces grouped into calls within
      max_prefill_tokens like admissions (engine_prefill._prefill);
    a request that finished, was cancelled or preempted (re-admission prefills the draft anew) is
      dropped from `_lag` without work (`_lagging`);
    tree shapes by batch (specjax.spec_tiers): `_pick_tier` chooses the tier of the rows; rows whose
      tree another tier grew get a catch-up piece too (from min(Ld, L - 1)), the last one `regrow`:
      it grows the new tier's tree from x_L.

Part of Engine (a mixin over its fields: sched, batch_opts, draft, _collect, _prefill)."""
from __future__ import annotations

from specjax import dispatch_plan
from specjax.scheduler import Piece


class CatchUpSteps:
    """Engine's bookkeeping and catch-up of lagging drafts (module doc)."""

    def _note_lag(self, slot: int, req, epoch: int, draft_len: int) -> None:
        """A lazy dispatch of req (admission `epoch`) in `slot` was read; draft_len: the slot's length
        before it. The first one since the draft was last in sync sets Ld."""
        cur = self._lag.get(slot)
        if cur is None or cur[0] is not req or cur[1] != epoch:
            self._lag[slot] = (req, epoch, draft_len)

    def _lagging(self) -> bool:
        """Whether a draft may lag: a lazy dispatch still in flight, or one read for a request still in
        its slot (entries of requests that finished, were cancelled or preempted are dropped here, so
        they never cost a catch-up's read of the dispatches in flight)."""
        if self._lag:
            self._lag = {s: v for s, v in self._lag.items()
                         if self.sched.slots[s] is v[0] and v[0].epoch == v[1] and not v[0].finished}
        return bool(self._lag) or any(e.kind == "lazy" for e in self._pending)

    def _runs_lazy(self, rows) -> bool:
        """Whether the next decode dispatch over rows [(slot, request)] is lazy (it reads no draft)."""
        return dispatch_plan.runs_lazy(len(rows), any(r.grammar is not None for _, r in rows), self.draft,
                                       self.batch_opts)

    def _pick_tier(self, n_rows: int, rows=None) -> bool:
        """Set the tier for a dispatch of n_rows rows, by their fused program's rows bucket (kept while
        a host grammar is in a slot: its masks cover the trees the host read) -> whether one of `rows`
        [(slot, request)] holds another tier's tree (it needs a new one: _catch_up(regrow=True))."""
        tiers = None if self.draft is None else self.draft.tiers
        if tiers is None:
            return False
        if not any(r is not None and r.grammar is not None for r in self.sched.slots):
            padded = self.sched.rows_bucket(max(n_rows, 1), self._min_rows("spec"))
            tier = tiers.pick(n_rows, self.tier, padded)
            self.tier_switches += tier != self.tier
            self.tier = tier
        return any(self._tree_tier[s] != self.tier for s, _ in rows or ())

    def _catch_up(self, regrow: bool = False) -> None:
        """Read every dispatch in flight, then extend the lagging drafts of running requests to their
        slots' lengths; regrow: grow new trees where another tier grew them (module doc)."""
        self._collect()
        self._lagging()  # drops the entries of requests gone meanwhile
        todo = {}  # slot -> (request, the sequence x_0 .. x_L, Ld)
        for slot, (req, _, ld) in self._lag.items():
            seq = req.prompt_ids + req.token_ids
            L = int(self.sched.lens[slot])
            assert len(seq) == L + 1 and 0 <= ld <= L, (slot, len(seq), L, ld)  # every dispatch was read
            if ld < L:
                todo[slot] = (req, seq, ld)
        self._lag.clear()
        new_trees = set()
        for slot, req in (self.sched.stepping() if regrow else ()):
            if self._tree_tier[slot] != self.tier:
                assert req.grammar is None, "a host grammar keeps its tier (_pick_tier)"
                seq = req.prompt_ids + req.token_ids
                L = int(self.sched.lens[slot])
                assert len(seq) == L + 1 and L >= 1, (slot, len(seq), L)
                todo[slot] = (req, seq, min(todo.get(slot, (0, 0, L))[2], L - 1))
                new_trees.add(slot)
        self.regrown += len(new_trees)
        budget, chunk = self.batch_opts.max_prefill_tokens, self.sched.chunk
        while todo:
            pieces, longest = [], 0
            for slot, (req, seq, ld) in sorted(todo.items()):
                n = min(len(seq) - 1 - ld, chunk)
                if pieces and (len(pieces) + 1) * self.sched.prefill_len(max(longest, n)) > budget:
                    break
                pieces.append(Piece(slot, req, seq, ld, ld + n, first=False,  # not final: ends before x_L
                                    regrow=slot in new_trees and ld + n == len(seq) - 1))
                longest = max(longest, n)
            self._prefill(pieces)
            self.catch_ups += 1
            self.catch_up_tokens += sum(p.end - p.start for p in pieces)
            for p in pieces:
                if p.end == len(p.ids) - 1:
                    del todo[p.slot]
                else:
                    todo[p.slot] = (p.req, p.ids, p.end)
