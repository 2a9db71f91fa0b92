"""Which compiled program a decode dispatch calls, and with what (part of specjax.engine, a mixin over
its fields): the static flags of its rows (logprobs, how they sample, device DFAs), the attention split
cap of fused steps over short rows (with the sibling variant compiled on the worker thread ahead of its
first use), the program family's key in ShapeReuse, the call's arguments (small ones kept as device
arrays by content: specjax.arg_cache) and the rows' stop conditions for multi-step dispatches."""
from __future__ import annotations

import logging

import numpy as np

from specjax import attention as attn_lib
from specjax import dispatch_plan
from specjax import programs as prog
from specjax import sampling
from specjax.scheduler import bucket

log = logging.getLogger("specjax")


class DecodeCalls:
    """Engine's program choice and call arguments for decode dispatches (module doc)."""

    @staticmethod
    def _flags(reqs) -> dict:
        """Static program flags: logprobs wanted; how rows sample: False greedy only, UNFILTERED no
        sampling row uses top-k / top-p (both programs skip the [B, V] sort), True otherwise."""
        samplers = [r.params for r in reqs if r.params.temperature > 0]
        filters = any(p.top_p < 1.0 or (p.top_k or 0) > 0 for p in samplers)
        return dict(want_logprobs=any(r.logprobs is not None for r in reqs),
                    stochastic=(True if filters else sampling.UNFILTERED) if samplers else False,
                    dfa=any(r.dfa is not None for r in reqs))

    def _split_variants(self, kind: str, flags: dict, rows: int) -> list[dict]:
        """The static flags of a dispatch kind's programs for a rows bucket: fused steps of few rows
        come with and without an attention split cap (attention.split_cap), those of more rows with
        none; other kinds have no such flag."""
        if kind != "spec" or not self.split_caps:
            return [flags]
        caps = (attn_lib.SHORT_SPLITS, None) if rows <= attn_lib.SHORT_ROWS else (None,)
        return [dict(flags, max_splits=cap) for cap in caps]

    def _split_flags(self, p, rows, flags: dict, rows_b: tuple, grammar: bool = False, also=()) -> dict:
        """A dispatch's flags with its attention split cap: fewer splits where every row stays short
        over the dispatch (dispatch_plan.context_bound). A variant's sibling is compiled on the worker
        thread ahead of its first use (the uncapped one once rows near SHORT_CONTEXT); a variant wanted
        before it is ready waits while the compiled one runs (outputs agree up to float rounding; it
        is only slower): crossing SHORT_CONTEXT never stalls the engine thread.
        Grammar batches (their masks' programs compile on first use, not in the background) keep the
        kernels' own count: a switch would compile on the engine thread. also: more (slot, request) the
        dispatch may run (row hand-over's successors), counted in the length bound."""
        variants = self._split_variants(p.kind, flags, rows_b[0])
        if len(variants) == 1 or grammar:
            return variants[-1]  # the uncapped one
        bound = dispatch_plan.context_bound(list(rows) + list(also), self.sched, p.advance)
        want = attn_lib.split_cap(bound, rows_b[0])
        chosen, other = sorted(variants, key=lambda f: f["max_splits"] != want)

        def have(f):
            return self.shapes.find(self._decode_key(p.kind, p.num_steps, f), rows_b) is not None

        if not have(chosen) and have(other):  # the wanted one runs once the worker has compiled it
            self._compile_later(p.kind, p.num_steps, rows, chosen)
            chosen = other
        elif not have(other) and (other["max_splits"] is not None or 2 * bound > attn_lib.SHORT_CONTEXT):
            # the sibling ahead of its first use: the capped one at once, the uncapped one once a row has
            # half of SHORT_CONTEXT keys (short requests alone never compile it)
            self._compile_later(p.kind, p.num_steps, rows, other)
        if chosen["max_splits"] != self._last_cap:
            log.info("attention split cap %s for rows of up to %d keys (wanted %s)", chosen["max_splits"], bound, want)
            self._last_cap = chosen["max_splits"]
        return chosen

    def _min_rows(self, kind: str) -> int:
        """The fewest rows a decode dispatch of this kind pads to (BatchOptions.fused_min_rows for fused
        speculative steps; 2 otherwise: an M = 1 matmul is slow on the GPU, see BatchOptions)."""
        return self.batch_opts.fused_min_rows if kind == "spec" else 2

    def _decode_key(self, kind: str, K: int, flags: dict) -> tuple:
        """The ShapeReuse key of a decode program family (its static arguments, its tier)."""
        return ("decode", kind, K, self.tier, *flags.values())

    def _decode_call(self, kind, K, rows, slots, active, mask, drafts, flags, succ=None):
        """(program, arguments, static arguments) of a decode dispatch of K steps (K lite steps for
        kind "lite", K plain steps for "lazy"): a row that finishes stops changing state (lazy: as in
        plain decoding, it runs to the dispatch's end and the host drops its tokens). succ: the rows'
        successors (row hand-over: every fused dispatch of such an engine passes them, padding if none)."""
        keep = self.arg_cache.tree if self.mesh is None else (lambda t: t)  # equal values, same buffers
        slots, active = keep((slots, active))
        if self.draft is not None:
            handover = self.handover and kind == "spec" and mask is None
            stop = self._stop_rows(rows, len(slots), also=succ or ())
            extra = (self._successor_arg(rows, succ, len(slots)),) if handover else ()
            return self.spec_steps.step, (self.weights, self.draft_weights, self.state, self.samp, slots, active, mask,
                                          keep(stop), drafts, *keep(extra)), \
                dict(num_steps=K, lite=kind in ("lite", "lazy"), lazy=kind == "lazy", **flags)
        return self.steps.decode_many, (self.weights, self.state, self.samp, slots, active, mask), \
            dict(num_steps=K, **flags)

    def _compile_later(self, kind, K, rows, flags) -> None:
        """Compile the program of K steps for these rows' bucket on the worker thread (once)."""
        n = self.sched.rows_bucket(len(rows), self._min_rows(kind))
        key = (self._decode_key(kind, K, flags), (n,))
        if key not in self.background.requested:
            slots, active = self.sched.row_slots(rows, num_rows=n)
            self.background.request(key, *self._decode_call(kind, K, rows, slots, active, None, None, flags))

    def _stop_rows(self, rows, B: int, also=()) -> prog.StopRows:
        """The rows' stop ids (EOS unless ignored, stop_token_ids; [B, E], E bucketed, wide enough for
        the requests `also` too) and the sequence length at which each is finished (prompt + max_len - 1).
        A row given as None (and rows past len(rows)) is padding: finished at once."""
        E = bucket(max([len(x[1].stop_ids) for x in (*rows, *also) if x is not None] + [1]), 4, 1 << 30)
        ids = np.full((B, E), -1, np.int32)
        limit = np.zeros(B, np.int32)
        for b, x in enumerate(rows):
            if x is not None:
                r = x[1]
                ids[b, :len(r.stop_ids)] = sorted(r.stop_ids)
                limit[b] = len(r.prompt_ids) + r.max_len - 1
        return prog.StopRows(ids, limit)
