"""Continuous batching over slots: a one-step-behind ("zero-bubble") host loop, preemption and
grammar-constrained (speculative) decoding.

The device state is indexed by slot and is the source of truth: KV cache, sequence lengths, each
slot's last token or next draft tree, and each slot's sampling parameters (written at admission).
The host (specjax.scheduler) keeps the queue, the slots, the page allocator and a mirror of the
lengths, and reads each step's emitted tokens.

One engine step (`Engine.step`):
  0. admission ahead: a full batch whose rows are all expected to finish with the dispatches in
     flight gives their slots to queued requests before reading them (specjax.engine_ahead);
  1. prefill: the next chunk of each unfinished prefill and queued requests admitted into free slots
     (after the pages of their longest cached prefix, which they share), within the token budget
     `max_prefill_tokens`: one bucketed prefill dispatch (specjax.scheduler.plan_prefill);
  2. reserve KV pages for the next step of every running slot, for an upper bound of its length
     (the step still in flight may add up to `advance` positions), preempting the youngest request
     when pages run out;
  3. dispatch step t+1 for the running slots whose prefill is complete (rows bucketed to a power of
     two): a long prompt's chunks alternate with the decode steps of the others. A speculative
     engine runs fused steps, or lite steps (plain decoding that keeps the draft in sync) for
     batches of >= BatchOptions.speculate_below rows (an EAGLE head: lazy steps, plain decoding's
     program, its draft caught up before a dispatch reads it again: specjax.engine_catchup); the
     kind and the steps per dispatch: specjax.dispatch_plan;
  4. read step t's outputs (their device->host copy started when t was dispatched) and deliver the
     tokens. A request that finished or was cancelled leaves the batch here, one step late: what
     step t+1 computed for it is dropped, so the outputs are those of the synchronous loop
     (SchedulerOptions(async_loop=False): read every step right after dispatching it).

Row hand-over (SchedulerOptions.handover, specjax.engine_handover; by default on for one row): a speculative
engine with a spare slot per row prefills the next request ahead (after a step's dispatch); a fused dispatch's
row runs it once its request ends, so no steps run past a request's end and the host launches no request
boundary.

Several JAX processes (specjax.multihost): every process runs this engine; process 0's `replica`
sends the requests added / cancelled since the last step before each step, the others replay them,
so all make the same decisions and dispatch the same programs.

Batches with grammar-constrained rows: specjax.engine_grammar (one step per dispatch, the masks and
grammar drafts computed on the host while the target forward runs; a grammar that raises fails only
its request). Regex / choice / JSON-schema constraints run on the device instead where they compile
to a token DFA within the limits (specjax.engine_dfa, specjax.device_dfa): such rows need no host
work per token and their batches run the multi-step programs. Host time per phase: `Engine.stats()`
(specjax.host_timing). Choices made at start, prefill and results: engine_setup / _prefill / _results.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import attention as attn_lib
from specjax import dispatch_plan
from specjax.adaptive import AcceptanceGate
from specjax.arg_cache import ArgCache
from specjax.background_compile import BackgroundCompiles
from specjax.compile_watch import CompileWatch, freeze_heap
from specjax import programs as prog
from specjax.engine_ahead import AdmitAhead
from specjax.engine_calls import DecodeCalls
from specjax.engine_catchup import CatchUpSteps
from specjax.engine_dfa import DFASteps
from specjax.engine_options import BatchOptions, CacheOptions, Draft, StepUpdate, check_speculate_below
from specjax.engine_grammar import GrammarSteps
from specjax.engine_handover import HandOver, device_slots
from specjax.engine_prefill import PrefillSteps
from specjax.engine_results import ResultSteps, _Dispatched
from specjax.engine_setup import SetupChoices
from specjax.grammar_masks import MaskBuilder
from specjax.host_timing import HostTimes
from specjax.kv_cache import init_cache
from specjax.request import Request
from specjax.sampling import SamplingArrays
from specjax.scheduler import Scheduler, SchedulerOptions, slot_pages
from specjax.shape_reuse import ShapeReuse

__all__ = ["BatchOptions", "CacheOptions", "Draft", "Engine", "SchedulerOptions", "StepUpdate"]

log = logging.getLogger("specjax")


class Engine(SetupChoices, PrefillSteps, ResultSteps, GrammarSteps, DFASteps, AdmitAhead, CatchUpSteps, HandOver,
             DecodeCalls):
    def __init__(self, model: nnx.Module, cfg, cache_opts: CacheOptions, batch_opts: BatchOptions, dtype,
                 draft: Draft | None = None, mesh=None, sched: SchedulerOptions | None = None, grammar=None,
                 kv_compact_impl: str = "auto", attention: str | attn_lib.AttnImpl = "auto",
                 draft_topk: str = "auto"):
        """mesh: a specjax.sharding mesh for tensor parallelism (None: one device). Weights are placed
        in their shardings and the device state is created sharded; the steps run unchanged (GSPMD).
        sched: SchedulerOptions (async loop, grammar overlap). grammar: a specjax.grammar.GrammarCompiler
        for constrained requests, or a callable building one on first use (None: they fail).
        kv_compact_impl: compaction of accepted tree paths, "auto" or one to force (specjax.kernels;
        a forced one that does not compile raises KernelError). draft_topk: the draft tree's per-level
        top-k, "auto" (the one-reduction top-k on GPU, lax.top_k elsewhere), "xla" or "reduce" (the same
        results; specjax.kernels.choose_draft_topk). The choices are `self.kernels`, reported in
        `self.info` (logged at INFO on the "specjax" logger).
        attention: the paged-attention implementation ("auto", or a name of specjax.attention; an
        AttnImpl to force one with its settings, e.g. AttnImpl("pallas", interpret=True) on CPU),
        chosen here once for the target and the draft; `self.attention_choice` says what runs and why.
        JAX's persistent compilation cache is turned on here (specjax.compile_cache)."""
        freeze_heap(reclaim=True)  # dropped engines (frozen cycles) freed before this one allocates
        from specjax import compile_cache
        compile_cache.enable()
        self.cfg = cfg
        self.cache_opts, self.batch_opts = cache_opts, batch_opts
        self.draft = draft
        self.mesh = mesh
        self.opts = sched or SchedulerOptions()  # hand-over and unread decided from the fields above (HandOver.opts)
        self._grammar = grammar
        rules = None
        if mesh is not None:
            from specjax import sharding
            tp = mesh.shape[sharding.AXIS]
            rules = sharding.resolve_rules(cfg, tp)
            sharding.shard_model(model, mesh, rules)
            if draft is not None and draft.model is not None and draft.model is not model:
                sharding.shard_model(draft.model, mesh, sharding.model_rules(draft.model, draft.kv_cfg, tp))
        model, draft = self._choose_attention(attention, model, cfg, draft, cache_opts.page_size, dtype, mesh)
        self.draft = draft
        self.split_caps = draft is not None and self.attention_name in attn_lib.SPLIT_KERNELS  # _split_flags
        if draft is None:
            ahead = advance = batch_opts.steps_per_call
            tail = self.lookahead = 0
        else:
            from specjax import step
            specs = draft.spec, *(() if draft.tiers is None else draft.tiers.specs)
            self.lookahead = max(step.lookahead(s, draft.info) for s in specs)
            # one fused step; a dispatch runs up to K of them when the pages for K steps are free
            # (specjax.dispatch_plan), so pages are reserved (and requests admitted) for one step
            ahead, advance = self.lookahead, max(s.num_steps for s in specs) + 1
            # a speculative step writes up to `lookahead` entries past a slot's length, also at the end
            # of the context: slots address max_seq_len + lookahead entries (specjax.scheduler, "Capacity")
            tail = self.lookahead
        # slots: one per row, and with row hand-over a spare one per row for the next request (engine_handover)
        self.num_slots = S = self._handover_slots(batch_opts.max_batch, draft)
        self.device_slots = D = device_slots(S, draft is not None)  # of the device state (engine_handover)
        pages_per_slot = slot_pages(cache_opts.max_seq_len + tail, cache_opts.page_size)
        num_pages = cache_opts.num_pages or S * pages_per_slot + 1
        self.sched = Scheduler(num_pages=num_pages, page_size=cache_opts.page_size, max_seq_len=cache_opts.max_seq_len,
                               max_batch=S, max_rows=batch_opts.max_batch, max_prefill_tokens=batch_opts.max_prefill_tokens,
                               prefill_chunk=batch_opts.prefill_chunk, ahead=ahead, advance=advance, tail=tail,
                               prefix_caching=cache_opts.prefix_cache,
                               key_shift=draft.info.shift if draft is not None and draft.info.has_model else 0)
        self.kernels, kernel_note = self._choose_kernels(kv_compact_impl, draft_topk, num_pages, dtype)
        if draft is None:
            self.steps, self.weights = prog.plain_programs(*nnx.split(model))
        else:
            dsplit = (None, None) if draft.model is None else nnx.split(draft.model)  # None: n-gram, no model
            tiers = (draft.spec,) if draft.tiers is None else draft.tiers.specs
            N = draft.spec.num_nodes if draft.tiers is None else draft.tiers.num_nodes
            built = [prog.spec_programs(draft.info, s, *nnx.split(model), *dsplit, kernels=self.kernels, num_nodes=N)
                     for s in tiers]  # one program set per tree shape (specjax.spec_tiers)
            self._tier_steps = [b[0] for b in built]
            self.weights, self.draft_weights = built[0][1:]
        slot_len = self.sched.capacity  # cache entries one slot addresses

        def make_state():
            cache = init_cache(cfg, num_pages=num_pages, page_size=cache_opts.page_size,
                               max_slots=D, max_seq_len=slot_len, dtype=dtype)
            if draft is None:
                from specjax.decode import DecodeState
                return DecodeState(cache, jnp.zeros((D,), jnp.int32))
            from specjax.step import init_spec_state
            dkv = [] if draft.kv_cfg is None else init_cache(
                draft.kv_cfg, num_pages=num_pages, page_size=cache_opts.page_size, max_slots=D,
                max_seq_len=slot_len, dtype=dtype).kv
            return init_spec_state(cache, dkv, draft.spec, cfg.vocab_size,
                                   tiers=() if draft.tiers is None else draft.tiers.specs)

        self.samp: SamplingArrays = prog.init_samp(D)  # per slot, on the device
        if mesh is None:  # committed, as the programs' outputs are: later calls hit the same executables
            self.state, self.samp = self._commit((make_state(), self.samp))
        else:
            self.state = sharding.create_sharded(make_state, mesh, rules)
            self.samp = jax.device_put(self.samp, sharding.replicated(mesh))
        self._pending: deque[_Dispatched] = deque()
        self.arg_cache = ArgCache()  # small dispatch arguments as device arrays kept by content
        self._updates: dict[int, StepUpdate] = {}
        self.replica = None  # multi-host, process 0: a specjax.multihost.Leader sending the commands below
        self.masks = MaskBuilder(self._width(), self.opts.mask_threads)  # grammar masks, built on the host
        self.host = HostTimes()
        self.shapes = ShapeReuse(slack=4)  # padded shapes: reuse a compiled program up to 4x the size
        self.dispatches = dict.fromkeys(("decode", "spec", "lite", "lazy"), 0)  # decode dispatches by kind
        self.steps_cap = dispatch_plan.StepsCap(batch_opts.adaptive_steps)  # steps per dispatch at most
        self.background = BackgroundCompiles()  # the adapted steps' programs, compiled off the engine thread
        self.compiles_from_leader = False  # multi-host follower: process 0 says when they are ready
        self.compiles = CompileWatch(self.num_compiled)  # compilations on the engine thread, logged
        self._loop_end = None  # when the last step() that dispatched ended (the loop's period)
        self.gate = AcceptanceGate()  # lite or fused steps by measured acceptance (BatchOptions.min_accept)
        self._last_kind = None  # the kind of the last decode dispatch
        self._last_cap = "none yet"  # the attention split cap of the last fused dispatch (_split_flags)
        self._lag = {}  # slot -> (request, epoch, draft length) of drafts left behind (specjax.engine_catchup)
        self.tier = 0  # the tree shape the dispatches run (draft.tiers; specjax.spec_tiers)
        self._tree_tier = np.zeros(S, np.int32)  # per slot: the tier its tree was grown by
        self.tier_switches = self.regrown = 0  # tier changes; rows given a new tree by one
        self.catch_ups = self.catch_up_tokens = 0  # their catch-up prefill calls and tokens
        self.held_back = 0  # steps that read the dispatches in flight instead of dispatching (_hold_back)
        self.admitted_ahead = self.admit_ahead_misses = self.admitted_early = 0
        self.handed_over = 0  # rows that ran their successor inside a fused dispatch (engine_handover)
        self.handover_no_pages = 0  # dispatches that ran without their successors: no pages for their steps
        self._released_early: list[Request] = []  # released after a dispatch, not yet read (engine_ahead)
        self.dispatched_steps = dict.fromkeys(("decode", "spec", "lite", "lazy"), 0)  # the steps they ran
        self.info = self._describe(dtype, num_pages, kernel_note)
        log.info("engine: %s", self.info)
        freeze_heap()  # the model's objects, alive for the engine's life: out of later collections' way

    def _commit(self, tree):
        """Device state created on the host side of the programs, committed to the device like the
        programs' outputs (an uncommitted input is another jit cache key: a second compilation)."""
        if self.mesh is None:
            return jax.device_put(tree, jax.devices()[0])
        return tree  # sharded state is created committed (sharding.create_sharded)

    # -- views ------------------------------------------------------------------------------
    @property
    def spec(self):
        """The tree shape of the current tier (a speculative engine)."""
        return self.draft.spec if self.draft.tiers is None else self.draft.tiers.specs[self.tier]

    @property
    def spec_steps(self) -> prog.SpecPrograms:
        """The speculative programs of the current tier."""
        return self._tier_steps[self.tier]

    @spec_steps.setter
    def spec_steps(self, programs: prog.SpecPrograms) -> None:  # tests wrap the programs they watch
        self._tier_steps[self.tier] = programs

    @property
    def slots(self) -> list[Request | None]:
        return self.sched.slots

    @property
    def alloc(self):
        return self.sched.alloc

    @property
    def lens(self) -> np.ndarray:
        return self.sched.lens

    @property
    def num_preempted(self) -> int:
        return self.sched.num_preempted

    def stats(self) -> dict:
        """Counters for metrics: queue and slots, KV pages, prefix cache (hit rate = reused tokens /
        looked-up tokens), prefilled tokens, preemptions; host time of the loop by phase (host_*_s:
        read, accept, masks, drafts, dispatch; host_step_s: all of step(), over host_steps steps); decode
        dispatches and the steps they ran by kind (decode / spec / lite / lazy: specjax.dispatch_plan)."""
        a, st = self.alloc, self.sched.prefix
        return {
            "queue_length": len(self.sched.queue),
            "running": sum(r is not None for r in self.sched.slots),
            "prefilling": len(self.sched.prefilling),
            "pages_total": a.num_pages - 1,
            "pages_in_use": a.num_in_use,
            "pages_cached": len(a.cached),  # unused but kept for reuse (evicted when needed)
            "pages_free": a.num_free,  # cached pages included
            "prefix_cache": self.sched.prefix_caching,
            "prefix_cache_queries": st.queries,
            "prefix_cache_hits": st.hits,
            "prefix_cache_queried_tokens": st.queried_tokens,
            "prefix_cache_hit_tokens": st.hit_tokens,
            "prefix_cache_hit_rate": st.hit_tokens / st.queried_tokens if st.queried_tokens else 0.0,
            "prefix_cache_evictions": a.num_evicted,
            "prefill_tokens": st.prefill_tokens,
            "num_preempted": self.sched.num_preempted,
            **self.host.stats(),  # host seconds by phase (specjax.host_timing)
            **{f"{k}_dispatches": v for k, v in self.dispatches.items()},
            **{f"{k}_dispatch_steps": v for k, v in self.dispatched_steps.items()},
            "catch_ups": self.catch_ups,  # prefill calls that brought lagging drafts up to date (engine_catchup)
            "catch_up_tokens": self.catch_up_tokens,
            "spec_tier": self.tier,  # the tree shape running now, by the batch (specjax.spec_tiers)
            "tier_switches": self.tier_switches,
            "regrown_trees": self.regrown,  # rows given a new tree by a tier switch
            "held_back_steps": self.held_back,  # no dispatch: those in flight were expected to finish every row
            "admitted_ahead": self.admitted_ahead,  # slots given to queued requests before their rows' last read
            "admit_ahead_misses": self.admit_ahead_misses,  # of those, rows that had not finished (re-admitted)
            "admitted_early": self.admitted_early,  # of those, released right after their last dispatch
            "handed_over": self.handed_over,  # rows that ran the next request inside a dispatch (row hand-over)
            "handover_no_pages": self.handover_no_pages,  # dispatches without their successors for lack of pages
            "steps_per_call_cap": self.steps_cap.caps(self.batch_opts)[0 if self.draft is None else 1],
            **self.gate.stats(),  # lite dispatches chosen by the acceptance gate, its probes (specjax.adaptive)
            **self._dfa_counts(),  # constrained requests by path: device DFA / host grammar, DFA fallbacks
            **self.compiles.stats(),  # executables held, XLA compilations on the stepping thread (s)
            "background_compiles": self.background.count, "background_compile_s": self.background.seconds,
        }

    def num_compiled(self) -> int:
        """Compiled executables of the engine's programs (constant in steady state)."""
        return prog.num_compiled(self.steps if self.draft is None else self.spec_steps)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request. One that cannot be served (prompt too long for the context or the cache,
        invalid constraint) fails on its own (finish_reason "error"), reported by the next step."""
        if self.replica is not None:
            self.replica.add(req)
        if not req.finished:
            why = self.sched.never_fits(req)
            if why is None and req.params.constraint is not None and req.constraint_path is None:
                why = self._attach_constraint(req)  # device DFA or host grammar (specjax.engine_dfa)
            if why is None:
                self.sched.add(req)
                return
            req.fail(why)
        self._report(req)

    def cancel(self, request_id: int) -> bool:
        """Cancel a queued or running request (finish_reason "cancelled"); its slot and pages are
        freed at once. False if no unfinished request has that id."""
        if self.replica is not None:
            self.replica.cancel(request_id)
        for req in list(self.sched.queue):
            if req.id == request_id:
                self.sched.remove_queued(req)
                req.cancel()
                self._report(req)
                return True
        for slot, req in self.sched.running():
            if req.id == request_id:
                req.cancel()
                self.sched.release(slot)
                self._report(req)
                return True
        for req in self._released_early:  # slot given up, last dispatch not read yet (engine_ahead)
            if req.id == request_id and not req.finished:
                req.cancel()
                self._report(req)
                return True
        return False

    def has_unfinished(self) -> bool:
        return self.sched.has_work() or bool(self._pending) or bool(self._updates)

    def run(self, requests: list[Request]) -> None:
        """Run requests to completion (continuous batching: freed slots admit queued requests)."""
        for r in requests:
            self.add_request(r)
        while self.has_unfinished():
            self.step()

    def step(self) -> list[StepUpdate]:
        """Admit, dispatch the next step, read the previous one. Returns the requests that got
        tokens or finished since the last call."""
        t0 = time.perf_counter()
        read0, before = self.host.seconds["read"], sum(self.dispatches.values())
        self.compiles.step_begin()
        try:
            return self._step()
        finally:
            self.compiles.step_end()
            end = time.perf_counter()
            self.host.steps += 1
            self.host.step_s += end - t0
            self._adapt_steps(self.host.seconds["read"] - read0, end, sum(self.dispatches.values()) > before)

    def _adapt_steps(self, wait_s: float, end: float, dispatched: bool) -> None:
        """Feed the steps-per-dispatch cap the share of the loop (step() to step(), the caller's work
        included) spent waiting for device results; process 0 of several tells the others its changes."""
        if dispatched and self._loop_end is not None and self.steps_cap.observe(wait_s, end - self._loop_end):
            if self.replica is not None:
                self.replica.steps_level(self.steps_cap.level)
        self._loop_end = end if dispatched else None

    def _take_compiled(self) -> None:
        """Programs compiled in the background since the last step become dispatchable here, at the
        start of a step (a follower of several processes: when process 0 says so, at the same step)."""
        for key, ok in self.background.finished():
            if ok and not self.compiles_from_leader:
                self.mark_compiled(key)

    def mark_compiled(self, key) -> None:
        """key: (program family, dims) of ShapeReuse, compiled: later dispatches may take it."""
        self.shapes.add(tuple(key[0]), tuple(key[1]))
        if self.replica is not None:
            self.replica.compiled(key)

    def _step(self) -> list[StepUpdate]:
        self._take_compiled()
        if self.replica is not None:  # multi-host: the other processes take the same step
            self.replica.send("step")
        early, self._released_early = self._released_early, []  # the last step's early releases: read below
        released = self._release_ahead()  # rows expected to finish in flight: their slots to the queue now
        defer = self._defer_admission()  # row hand-over: queued requests admitted after the dispatch
        if not defer and not self._prefill_planned(rows_only=self.handover) and self.sched.queue \
                and not self.sched.running():
            req = self.sched.queue.popleft()  # no room in an empty cache
            req.fail(self.sched.never_fits(req) or "the request does not fit the KV cache")
            self._report(req)
        if not self.opts.async_loop:
            self._collect()
        for req in self.sched.reserve():
            req.fail(f"out of KV pages: the request needs more than the {self.alloc.num_free} free pages of "
                     f"{self.alloc.page_size} tokens even alone (raise num_pages)")
            self._report(req)
        newest = None
        rows = self.sched.stepping()
        tiered = self.draft is not None and self.draft.tiers is not None
        if rows and (tiered or self._lagging()) and not self._runs_lazy(rows):  # the draft is read next:
            # bring it up to date, with new trees where the tier changed (reads every dispatch in flight)
            regrow = self._pick_tier(len(rows), rows)
            if regrow or self._lagging():
                self._catch_up(regrow)
                rows = self.sched.stepping()
        succ = None
        if self.handover:  # rows certainly finished give way to parked requests, which follow the others
            rows, succ = self._handover_rows(rows)
        if rows and not any(succ or ()) and self._hold_back(rows):
            rows = []  # read the dispatches in flight first: they are expected to finish every row
            self.held_back += 1
        if rows:
            self._push_page_table()
            if any(r.grammar is not None for _, r in rows):
                newest = self._constrained_step(rows)
            else:
                newest = self._dispatch(rows, succ=succ)
                self._admit_early()  # rows this dispatch finishes: the next request's prefill behind it
        if defer:
            self._prefill_planned()
        self._collect(keep=self._unread(newest))
        self._requeue_missed(early + released)
        out = list(self._updates.values())
        self._updates.clear()
        return out

    def _prefill_planned(self, rows_only: bool = False) -> bool:
        """Dispatch the prefill the scheduler plans now (unfinished chunks, queued requests admitted
        into free slots; rows_only: no more than the rows a step runs, the spare slots of row hand-over
        are filled after the dispatch, in their own prefill); False if it plans none."""
        pieces = self.sched.plan_prefill(self.batch_opts.max_batch if rows_only else None)
        if pieces:
            self._pick_tier(sum(r is not None for r in self.sched.slots))  # admitted with the shape they will run
            self._prefill(pieces)
        return bool(pieces)

    # -- host helpers -----------------------------------------------------------------------
    def _push_page_table(self):
        if self.alloc.dirty:  # a copy (the device may alias host memory), placed like the table it replaces
            table = jax.device_put(self.alloc.table.copy(), self.state.cache.page_table.sharding)
            cache = dataclasses.replace(self.state.cache, page_table=table)
            self.state = dataclasses.replace(self.state, cache=cache)
            self.alloc.dirty = False

    # -- dispatch ---------------------------------------------------------------------------
    def _dispatch(self, rows, grammar: bool = False, succ: list | None = None) -> _Dispatched:
        """One decode dispatch over rows (plain, fused speculative or lite steps: specjax.dispatch_plan);
        grammar: with the masks (and grammar drafts) of its constrained rows, computed first (the
        reference order, overlap off); succ: each row's successor (slot, request) or None (row hand-over,
        specjax.engine_handover; fused steps only)."""
        followers = [x for x in succ or () if x is not None]
        flags = self._flags([r for _, r in rows] + [r for _, r in followers])
        b = self.batch_opts
        gated = (self.draft is not None and not grammar and not dispatch_plan.runs_lite(len(rows), b.speculate_below)
                 and self.gate.lite([r for _, r in rows], b.min_accept, b.probe_every))

        def rows_b(kind):  # the rows' bucket for a program of this kind
            return (self.sched.rows_bucket(len(rows), self._min_rows(kind)),)

        def ready(kind, K):  # a program of K steps compiled for these rows (adapted caps wait for it)
            return any(self.shapes.find(self._decode_key(kind, K, f), rows_b(kind)) is not None
                       for f in self._split_variants(kind, flags, rows_b(kind)[0]))

        p = dispatch_plan.plan(rows, grammar, b, self.sched, self.draft, self.lookahead, gated,
                               caps=self.steps_cap.chain(b), ready=ready,
                               spec=None if self.draft is None else self.spec)
        no_pages = bool(p.kind == "spec" and not grammar and followers and p.num_steps > 1
                        and not self.sched.ensure_extra([x for x, _ in followers],
                                                        (p.num_steps - 1) * (self.spec.num_steps + 1)))
        if p.kind != "spec" or grammar or no_pages:
            if followers:  # the program's flags are the rows' own: no successor runs in it
                flags = self._flags([r for _, r in rows])
                self.handover_no_pages += no_pages
            succ, followers = None, []  # no hand-over in this dispatch (pages for the successors' K steps)
        flags = self._split_flags(p, rows, flags, rows_b(p.kind), grammar, also=followers)
        if p.wanted is not None:  # the adapted K's program is compiled off the engine thread meanwhile
            self._compile_later(p.kind, p.wanted, rows, flags)
        if grammar:
            slots, active = self.sched.row_slots(rows, min_rows=self._min_rows(p.kind))
        else:  # the bucket, or a larger batch already dispatched by the same program family
            n, = self.shapes.pick(self._decode_key(p.kind, p.num_steps, flags), rows_b(p.kind))
            slots, active = self.sched.row_slots(rows, num_rows=n)
        mask, drafts = self._step_grammar(rows, len(slots)) if grammar else (None, None)
        self._push_page_table()  # pages the plan took for K steps
        t0 = time.perf_counter()
        fn, args, kw = self._decode_call(p.kind, p.num_steps, rows, slots, active, mask, drafts, flags, succ)
        out, trees, self.state = self.compiles.call(lambda: f"{p.kind} K={p.num_steps} rows={len(slots)} {flags}",
                                                    fn, *args, **kw)
        self.host.add("dispatch", t0)
        entry = self._push(p.kind, out, trees, [(b, s, r) for b, (s, r) in enumerate(rows)], p.advance, p.sure,
                           [(b, *x) for b, x in enumerate(succ or ()) if x is not None])
        entry.after_lite = p.kind == "spec" and self._last_kind in ("lite", "lazy")
        self._last_kind = p.kind
        return entry
