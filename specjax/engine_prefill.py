"""The engine's prefill dispatch (specjax.engine, step 1): the pieces the scheduler planned
(specjax.scheduler.plan_prefill) as one bucketed program call, and the per-slot state of newly
admitted requests (penalties, n-gram history). Part of Engine (a mixin over its fields and its
_push / _push_page_table / _flags / grammar helpers)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from specjax import programs as prog
from specjax.decode import PrefillRows
from specjax.sampling import SamplingArrays
from specjax.scheduler import MIN_PREFILL_LEN, Piece, bucket


class PrefillSteps:
    """Engine's prefill dispatch and the per-slot state of admitted requests (module doc)."""

    def _prefill(self, pieces: list[Piece]):
        self._push_page_table()
        firsts = [pc for pc in pieces if pc.first]
        if firsts:  # per-slot state first: a DFA that no longer fits the tables moves to the host path here
            self._admit_slots(firsts)
            self._admit_dfa([(pc.slot, pc.req) for pc in firsts])
        samplers = [(b, pc.req) for b, pc in enumerate(pieces) if pc.final]  # rows whose sample is used
        # regrown rows draft a tree as at admission: their sampling and DFA flags count (specjax.spec_tiers)
        flags = self._flags([r for _, r in samplers] + [pc.req for pc in pieces if pc.regrow])
        tiered = self.draft is not None and self.draft.tiers is not None
        B, T = self._prefill_shape(pieces, (*flags.values(), any(r.grammar is not None for _, r in samplers),
                                            self.tier if tiered else None))
        tokens = np.zeros((B, T), np.int32)
        start, lens, next_ids = (np.zeros(B, np.int32) for _ in range(3))
        final, regrow = np.zeros(B, bool), np.zeros(B, bool)
        slots = np.full(B, self.num_slots, np.int32)  # padding rows: out of range
        samp = SamplingArrays(np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros(B, np.int32),
                              np.zeros(B, np.uint32))
        for b, pc in enumerate(pieces):
            n = pc.end - pc.start
            tokens[b, :n], start[b], lens[b], slots[b], final[b] = pc.ids[pc.start:pc.end], pc.start, n, pc.slot, pc.final
            next_ids[b] = 0 if pc.final else pc.ids[pc.end]
            regrow[b] = pc.regrow
            p = pc.req.params
            samp.temperature[b], samp.top_p[b], samp.top_k[b], samp.seed[b] = p.temperature, p.top_p, p.top_k, pc.req.seed
        mask, drafts = self._prefill_grammar(samplers, B)  # the first token's masks (and grammar drafts)
        rows = PrefillRows(tokens, start, lens, slots, final, next_ids, regrow if tiered else None)
        if tiered:  # the trees these rows now hold (specjax.spec_tiers)
            for pc in pieces:
                if pc.final or pc.regrow:
                    self._tree_tier[pc.slot] = self.tier
        t0 = time.perf_counter()
        what = lambda: f"prefill rows={B} length={T} {flags}"  # noqa: E731 - logged when it compiled
        if self.draft is None:
            out, trees, self.state, self.samp = self.compiles.call(
                what, self.steps.prefill, self.weights, self.state, self.samp, rows, samp, mask, **flags)
        else:
            out, trees, self.state, self.samp = self.compiles.call(
                what, self.spec_steps.prefill, self.weights, self.draft_weights, self.state, self.samp, rows, samp,
                mask, drafts, **flags)
        self.host.add("dispatch", t0)
        finals = [(b, pc.slot, pc.req) for b, pc in enumerate(pieces) if pc.final]
        if finals:  # a call of unfinished prefills only has nothing to read
            self._push("prefill", out, trees, finals, 0, 1)

    def _prefill_shape(self, pieces: list[Piece], key: tuple) -> tuple[int, int]:
        """(rows B, length T) of a prefill of these pieces: the buckets, or a larger shape already
        dispatched with the same flags, up to 4x their tokens and within the prefill token budget
        (specjax.shape_reuse). Refilled slots admit a few requests at a time, and prefix-cache hits
        make the rows of a repeated batch shorter than the first time (e.g. 128 -> 16 tokens, past
        the 4x): a prompt found whole in the cache counts with its uncached length for the 4x
        (Scheduler.uncached_len), so it may run on the shape its first prefill compiled instead of
        compiling its own (only a shape its uncached prefill could have taken); new text
        after a cached prefix (a shared system prompt) keeps its own short bucket."""
        B = bucket(len(pieces), 1, self.num_slots)
        T = self.sched.prefill_len(max(p.end - p.start for p in pieces))
        uncached = self.sched.prefill_len(max(self.sched.uncached_len(p) for p in pieces))
        return self.shapes.pick(("prefill", key), (B, T), limit=max(B * T, self.batch_opts.max_prefill_tokens),
                                need=B * uncached)

    def _admit_slots(self, firsts: list[Piece]):
        """The per-slot state of newly admitted slots that needs their whole sequence (a piece may
        hold part of it only): penalty state, n-gram history (programs.admit_slots)."""
        group = [(pc.slot, pc.req) for pc in firsts]
        B = bucket(len(group), 1, self.num_slots)
        pen = self._penalty_params(group, B)
        if self.state.penalties is None and getattr(self.state, "history", None) is None:
            return
        T = bucket(max(len(pc.ids) for pc in firsts), MIN_PREFILL_LEN, max(MIN_PREFILL_LEN, self.cache_opts.max_seq_len))
        tokens, lens = np.zeros((B, T), np.int32), np.zeros(B, np.int32)
        slots = np.full(B, self.num_slots, np.int32)
        for b, pc in enumerate(firsts):
            tokens[b, :len(pc.ids)], lens[b], slots[b] = pc.ids, len(pc.ids), pc.slot
        self.state = prog.admit_slots(self.state, tokens, lens, slots, pen)

    def _penalty_params(self, group, B):
        """Per-row penalty parameters for a prefill; the per-slot penalty state (token counts,
        prompt sets) is created on the device the first time a request asks for penalties. A
        preempted request prefills prompt + generated tokens: prompt_len makes the latter count as
        output again (its penalties continue exactly)."""
        from specjax import penalties
        if self.state.penalties is None:
            if not any(r.params.has_penalties for _, r in group):
                return None
            self.state = dataclasses.replace(self.state, penalties=self._commit(penalties.init_penalty_state(
                self.device_slots, self.cfg.vocab_size)))
        pad = [None] * (B - len(group))
        return penalties.penalty_params([r.params for _, r in group] + pad,
                                        [len(r.prompt_ids) for _, r in group] + [0] * len(pad))
