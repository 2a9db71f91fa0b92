"""Continuous batching over slots: a one-step-behind ("zero-bubble") host loop, preemption and
grammar-constrained (speculative) decoding.

The device state is indexed by slot and is the source of truth: KV cache, sequence lengths, each
slot's last token or next draft tree, and each slot's sampling parameters (written at admission).
The host (specjax.scheduler) keeps the queue, the slots, the page allocator and a mirror of the
lengths, and reads each step's emitted tokens.

One engine step (`Engine.step`):
  1. prefill: the next chunk of each unfinished prefill and queued requests admitted into free slots
     (after the pages of their longest cached prefix, which they share), within the token budget
     `max_prefill_tokens`: one bucketed prefill dispatch (specjax.scheduler.plan_prefill);
  2. reserve KV pages for the next step of every running slot, for an upper bound of its length
     (the step still in flight may add up to `advance` positions), preempting the youngest request
     when pages run out;
  3. dispatch step t+1 for the running slots whose prefill is complete (rows bucketed to a power of
     two): a long prompt's chunks alternate with the decode steps of the others. A speculative
     engine runs fused steps, or lite steps (plain decoding that keeps the draft in sync) for
     batches of >= BatchOptions.speculate_below rows; the kind and the steps per dispatch:
     specjax.dispatch_plan;
  4. read step t's outputs (their device->host copy started when t was dispatched) and deliver the
     tokens. A request that finished or was cancelled leaves the batch here, one step late: what
     step t+1 computed for it is dropped, so the outputs are those of the synchronous loop
     (SchedulerOptions(async_loop=False): read every step right after dispatching it).

Several JAX processes (specjax.multihost): every process runs this engine; process 0's `replica`
sends the requests added / cancelled since the last step before each step, the others replay them,
so all make the same decisions and dispatch the same programs.

Batches with grammar-constrained rows: specjax.engine_grammar (one step per dispatch, the masks and
grammar drafts computed on the host while the target forward runs; a grammar that raises fails only
its request). Regex / choice / JSON-schema constraints run on the device instead where they compile
to a token DFA within the limits (specjax.engine_dfa, specjax.device_dfa): such rows need no host
work per token and their batches run the multi-step programs. Host time per phase: `Engine.stats()`
(specjax.host_timing).
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
from specjax.background_compile import BackgroundCompiles
from specjax.compile_watch import CompileWatch, freeze_heap
from specjax import programs as prog
from specjax.decode import PrefillRows
from specjax.engine_dfa import DFASteps
from specjax.engine_options import BatchOptions, CacheOptions, Draft, StepUpdate, check_speculate_below
from specjax.engine_grammar import GrammarSteps
from specjax.grammar_masks import MaskBuilder
from specjax.host_timing import HostTimes
from specjax import kernels as kernels_lib
from specjax.kernels import KV_COMPACT_CHOICES, Kernels, choose_kv_compact, compact_shapes
from specjax.kv_cache import init_cache
from specjax.request import Request
from specjax import sampling
from specjax.sampling import SamplingArrays
from specjax.scheduler import MIN_PREFILL_LEN, Piece, Scheduler, SchedulerOptions, bucket, slot_pages
from specjax.shape_reuse import ShapeReuse

__all__ = ["BatchOptions", "CacheOptions", "Draft", "Engine", "SchedulerOptions", "StepUpdate"]

log = logging.getLogger("specjax")


@dataclasses.dataclass
class _Dispatched:
    """A dispatched program whose outputs are on their way to the host."""
    kind: str  # "prefill" | "decode" | "spec" | "lite"
    out: object
    trees: tuple | None  # speculative: the rows' next trees (tokens, parents [B, N])
    rows: list[tuple[int, int, Request, int]]  # (row, slot, request, its epoch at dispatch)
    advance: int  # positions per row counted in the scheduler's `inflight`
    sure: int = 0  # tokens per row counted in the scheduler's `sure` (each step gives >= 1 or finishes)
    after_lite: bool = False  # a fused dispatch right after lite ones (its first step verifies a stale tree)


def _indexed(rows):
    """(slot, request) rows -> (batch row, slot, request)."""
    return [(b, s, r) for b, (s, r) in enumerate(rows)]


def _as_rows(kind: str, x) -> np.ndarray:
    """A step output on the host as [B, K, ...] (prefill: one token per row; decode and spec: [K, B, ...])."""
    x = np.asarray(x)
    return x[:, None] if kind == "prefill" else np.swapaxes(x, 0, 1)


class Engine(GrammarSteps, DFASteps):
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
        self.opts = sched or SchedulerOptions()
        self.draft = draft
        self.mesh = mesh
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
        if draft is None:
            ahead = advance = batch_opts.steps_per_call
            tail = self.lookahead = 0
        else:
            from specjax import step
            self.lookahead = step.lookahead(draft.spec, draft.info)
            # one fused step; a dispatch runs up to K of them when the pages for K steps are free
            # (specjax.dispatch_plan), so pages are reserved (and requests admitted) for one step
            ahead, advance = self.lookahead, draft.spec.num_steps + 1
            # a speculative step writes up to `lookahead` entries past a slot's length, also at the end
            # of the context: slots address max_seq_len + lookahead entries (specjax.scheduler, "Capacity")
            tail = self.lookahead
        pages_per_slot = slot_pages(cache_opts.max_seq_len + tail, cache_opts.page_size)
        num_pages = cache_opts.num_pages or batch_opts.max_batch * pages_per_slot + 1
        self.sched = Scheduler(num_pages=num_pages, page_size=cache_opts.page_size, max_seq_len=cache_opts.max_seq_len,
                               max_batch=batch_opts.max_batch, max_prefill_tokens=batch_opts.max_prefill_tokens,
                               prefill_chunk=batch_opts.prefill_chunk, ahead=ahead, advance=advance, tail=tail,
                               prefix_caching=cache_opts.prefix_cache,
                               key_shift=draft.info.shift if draft is not None and draft.info.has_model else 0)
        self.kernels, kernel_note = self._choose_kernels(kv_compact_impl, draft_topk, num_pages, dtype)
        if draft is None:
            self.steps, self.weights = prog.plain_programs(*nnx.split(model))
        else:
            dsplit = (None, None) if draft.model is None else nnx.split(draft.model)  # None: n-gram, no model
            self.spec_steps, self.weights, self.draft_weights = prog.spec_programs(
                draft.info, draft.spec, *nnx.split(model), *dsplit, kernels=self.kernels)
        slot_len = self.sched.capacity  # cache entries one slot addresses

        def make_state():
            cache = init_cache(cfg, num_pages=num_pages, page_size=cache_opts.page_size,
                               max_slots=batch_opts.max_batch, max_seq_len=slot_len, dtype=dtype)
            if draft is None:
                from specjax.decode import DecodeState
                return DecodeState(cache, jnp.zeros((batch_opts.max_batch,), jnp.int32))
            from specjax.step import init_spec_state
            dkv = [] if draft.kv_cfg is None else init_cache(
                draft.kv_cfg, num_pages=num_pages, page_size=cache_opts.page_size, max_slots=batch_opts.max_batch,
                max_seq_len=slot_len, dtype=dtype).kv
            return init_spec_state(cache, dkv, draft.spec, cfg.vocab_size)

        self.samp: SamplingArrays = prog.init_samp(batch_opts.max_batch)  # per slot, on the device
        if mesh is None:  # committed, as the programs' outputs are: later calls hit the same executables
            self.state, self.samp = self._commit((make_state(), self.samp))
        else:
            self.state = sharding.create_sharded(make_state, mesh, rules)
            self.samp = jax.device_put(self.samp, sharding.replicated(mesh))
        self._pending: deque[_Dispatched] = deque()
        self._updates: dict[int, StepUpdate] = {}
        self.replica = None  # multi-host, process 0: a specjax.multihost.Leader sending the commands below
        self.masks = MaskBuilder(self._width(), self.opts.mask_threads)  # grammar masks, built on the host
        self.host = HostTimes()
        self.shapes = ShapeReuse(slack=4)  # padded shapes: reuse a compiled program up to 4x the size
        self.dispatches = dict.fromkeys(("decode", "spec", "lite"), 0)  # decode dispatches by kind
        self.steps_cap = dispatch_plan.StepsCap(batch_opts.adaptive_steps)  # steps per dispatch at most
        self.background = BackgroundCompiles()  # the adapted steps' programs, compiled off the engine thread
        self.compiles_from_leader = False  # multi-host follower: process 0 says when they are ready
        self.compiles = CompileWatch(self.num_compiled)  # compilations on the engine thread, logged
        self._loop_end = None  # when the last step() that dispatched ended (the loop's period)
        self.gate = AcceptanceGate()  # lite or fused steps by measured acceptance (BatchOptions.min_accept)
        self._last_kind = None  # the kind of the last decode dispatch
        self.held_back = 0  # steps that read the dispatches in flight instead of dispatching (_hold_back)
        self.dispatched_steps = dict.fromkeys(("decode", "spec", "lite"), 0)  # the steps they ran
        self.info = self._describe(dtype, num_pages, kernel_note)
        log.info("engine: %s", self.info)
        freeze_heap()  # the model's objects, alive for the engine's life: out of later collections' way

    def _choose_kernels(self, kv_compact_impl: str, draft_topk: str, num_pages: int, dtype) -> tuple[Kernels, str]:
        """The kernel implementations of this engine's programs, chosen once, here (specjax.kernels)."""
        if kv_compact_impl not in KV_COMPACT_CHOICES:
            raise ValueError(f"kv_compact_impl must be one of {KV_COMPACT_CHOICES}, got {kv_compact_impl!r}")
        spec = None if self.draft is None else self.draft.spec
        topk = kernels_lib.choose_draft_topk(draft_topk)
        topk_note = "" if spec is None else f"; draft top-k: {topk}"
        if spec is None or spec.is_chain:  # a chain's accepted path is already in place
            unused = "" if kv_compact_impl == "auto" else f"; {kv_compact_impl!r} was asked for"
            return Kernels(draft_topk=topk), \
                f"not used ({'plain decoding' if spec is None else 'chain'}{unused}){topk_note}"
        rows = bucket(max(self.batch_opts.max_batch, 2), 2, max(2, self.batch_opts.max_batch))  # largest step batch
        page_shape = (num_pages, self.cache_opts.page_size, 2, self.cfg.num_kv_heads, self.cfg.head_dim)
        args = compact_shapes(self.cfg.num_layers, page_shape, dtype, rows, self.sched.pages_per_slot,
                              spec.num_steps + 1)
        impl, note = choose_kv_compact(kv_compact_impl, args)
        return Kernels(kv_compact=impl, draft_topk=topk), f"{impl} ({note}){topk_note}"

    def _describe(self, dtype, num_pages: int, kernel_note: str) -> str:
        """The engine's info line: decoding mode, cache layout, kernels."""
        c, b = self.cache_opts, self.batch_opts
        if self.draft is None:
            mode = f"plain decoding ({b.steps_per_call} steps per dispatch)"
        else:
            s = self.draft.spec
            lite = ("always fused steps" if b.speculate_below is None else
                    f"lite steps (plain, the draft kept in sync) for batches of >= {b.speculate_below} rows")
            mode = (f"speculative ({self.draft.info.method}: num_steps={s.num_steps} topk={s.topk} "
                    f"num_draft_tokens={s.num_draft_tokens}"
                    + (f" ngram_branch={s.ngram_branch}" if s.ngram_branch else "")
                    + f", lookahead {self.lookahead}; up to "
                    f"{b.spec_steps_per_call} steps per dispatch; {lite})")
        return (f"{mode}; {b.max_batch} slots of {self.sched.capacity} cache entries (max_seq_len {c.max_seq_len}), "
                f"{num_pages} pages of {c.page_size}, {jnp.dtype(dtype).name}, prefix cache "
                f"{'on' if c.prefix_cache else 'off'}, prefill chunks of {self.sched.chunk} tokens; "
                f"kernels: kv_compact={kernel_note}; " + "; ".join(self.attention_choice.values()))

    def _choose_attention(self, attention, model, cfg, draft, page_size, dtype, mesh):
        """Resolve the attention implementation once (outside traced code) for the target and the
        draft, and return copies of the models that use it (static: part of the programs' jit key)."""
        req, knobs = attention, {}
        if isinstance(attention, attn_lib.AttnImpl):
            req = attention.name
            knobs = dict(interpret=attention.interpret, block_q=attention.block_q, block_kv=attention.block_kv,
                         num_splits=attention.num_splits)

        def pick(c):
            return attn_lib.resolve(req, dtype=dtype, page_size=page_size, head_dim=c.head_dim, mesh=mesh,
                                    plain_batch=self.batch_opts.max_batch if draft is None else None, **knobs)

        impl, choice = pick(cfg)
        self.attention_choice = {"attention": str(choice)}
        self.attention_name = impl.name  # the target's implementation (specjax.attention)
        target = attn_lib.configure(model, impl)
        if draft is None or draft.model is None:  # plain decoding, or the n-gram drafter (no model, no KV)
            return target, draft
        if draft.model is model:
            return target, dataclasses.replace(draft, model=target)
        d_impl, d_choice = pick(draft.kv_cfg)
        self.attention_choice["draft attention"] = str(d_choice)
        return target, dataclasses.replace(draft, model=attn_lib.configure(draft.model, d_impl))

    def _commit(self, tree):
        """Device state created on the host side of the programs, committed to the device like the
        programs' outputs (an uncommitted input is another jit cache key: a second compilation)."""
        if self.mesh is None:
            return jax.device_put(tree, jax.devices()[0])
        return tree  # sharded state is created committed (sharding.create_sharded)

    # -- views ------------------------------------------------------------------------------
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
        dispatches and the steps they ran by kind (decode / spec / lite: specjax.dispatch_plan)."""
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
            "held_back_steps": self.held_back,  # no dispatch: those in flight were expected to finish every row
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
        pieces = self.sched.plan_prefill()
        if pieces:
            self._prefill(pieces)
        elif self.sched.queue and not self.sched.running():  # an empty cache and still no room
            req = self.sched.queue.popleft()
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
        if rows and self._hold_back(rows):
            rows = []  # read the dispatches in flight first: they are expected to finish every row
            self.held_back += 1
        if rows:
            self._push_page_table()
            if any(r.grammar is not None for _, r in rows):
                newest = self._constrained_step(rows)
            else:
                newest = self._dispatch(rows)
        self._collect(keep=newest if self.opts.async_loop else None)
        out = list(self._updates.values())
        self._updates.clear()
        return out

    # -- host helpers -----------------------------------------------------------------------
    def _report(self, req: Request, tokens=()) -> None:
        upd = self._updates.get(id(req))
        if upd is None:
            self._updates[id(req)] = StepUpdate(req, list(tokens))
        else:
            upd.token_ids.extend(tokens)

    def _push_page_table(self):
        if self.alloc.dirty:  # a copy (the device may alias host memory), placed like the table it replaces
            table = jax.device_put(self.alloc.table.copy(), self.state.cache.page_table.sharding)
            cache = dataclasses.replace(self.state.cache, page_table=table)
            self.state = dataclasses.replace(self.state, cache=cache)
            self.alloc.dirty = False

    @staticmethod
    def _flags(reqs) -> dict:
        """Static program flags: logprobs wanted; how rows sample: False greedy only, UNFILTERED no
        sampling row uses top-k / top-p (both programs skip the [B, V] sort), True otherwise."""
        samplers = [r.params for r in reqs if r.params.temperature > 0]
        filters = any(p.top_p < 1.0 or (p.top_k or 0) > 0 for p in samplers)
        return dict(want_logprobs=any(r.logprobs is not None for r in reqs),
                    stochastic=(True if filters else sampling.UNFILTERED) if samplers else False,
                    dfa=any(r.dfa is not None for r in reqs))

    def _push(self, kind, out, trees, rows, advance, steps) -> _Dispatched:
        """rows: (batch row, slot, request) of the rows whose outputs the host reads; advance: cache
        entries a row may gain; steps: steps run (each gives an unfinished row >= 1 token)."""
        for x in jax.tree.leaves((out, trees)):
            x.copy_to_host_async()
        entry = _Dispatched(kind, out, trees, [(b, s, r, r.epoch) for b, s, r in rows], advance, steps)
        if kind != "prefill":
            self.dispatches[kind] += 1
            self.dispatched_steps[kind] += steps
        for _, s, _ in rows:
            self.sched.inflight[s] += advance
            self.sched.sure[s] += steps
        self._pending.append(entry)
        return entry

    # -- dispatch ---------------------------------------------------------------------------
    def _prefill(self, pieces: list[Piece]):
        self._push_page_table()
        firsts = [pc for pc in pieces if pc.first]
        if firsts:  # per-slot state first: a DFA that no longer fits the tables moves to the host path here
            self._admit_slots(firsts)
            self._admit_dfa([(pc.slot, pc.req) for pc in firsts])
        samplers = [(b, pc.req) for b, pc in enumerate(pieces) if pc.final]  # rows whose sample is used
        flags = self._flags([r for _, r in samplers])
        B, T = self._prefill_shape(pieces, (*flags.values(), any(r.grammar is not None for _, r in samplers)))
        tokens = np.zeros((B, T), np.int32)
        start, lens, next_ids = (np.zeros(B, np.int32) for _ in range(3))
        final = np.zeros(B, bool)
        slots = np.full(B, self.batch_opts.max_batch, np.int32)  # padding rows: out of range
        samp = SamplingArrays(np.zeros(B, np.float32), np.ones(B, np.float32), np.zeros(B, np.int32),
                              np.zeros(B, np.uint32))
        for b, pc in enumerate(pieces):
            n = pc.end - pc.start
            tokens[b, :n], start[b], lens[b], slots[b], final[b] = pc.ids[pc.start:pc.end], pc.start, n, pc.slot, pc.final
            next_ids[b] = 0 if pc.final else pc.ids[pc.end]
            p = pc.req.params
            samp.temperature[b], samp.top_p[b], samp.top_k[b], samp.seed[b] = p.temperature, p.top_p, p.top_k, pc.req.seed
        mask, drafts = self._prefill_grammar(samplers, B)  # the first token's masks (and grammar drafts)
        rows = PrefillRows(tokens, start, lens, slots, final, next_ids)
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
        B = bucket(len(pieces), 1, self.batch_opts.max_batch)
        T = self.sched.prefill_len(max(p.end - p.start for p in pieces))
        uncached = self.sched.prefill_len(max(self.sched.uncached_len(p) for p in pieces))
        return self.shapes.pick(("prefill", key), (B, T), limit=max(B * T, self.batch_opts.max_prefill_tokens),
                                need=B * uncached)

    def _admit_slots(self, firsts: list[Piece]):
        """The per-slot state of newly admitted slots that needs their whole sequence (a piece may
        hold part of it only): penalty state, n-gram history (programs.admit_slots)."""
        group = [(pc.slot, pc.req) for pc in firsts]
        B = bucket(len(group), 1, self.batch_opts.max_batch)
        pen = self._penalty_params(group, B)
        if self.state.penalties is None and getattr(self.state, "history", None) is None:
            return
        T = bucket(max(len(pc.ids) for pc in firsts), MIN_PREFILL_LEN, max(MIN_PREFILL_LEN, self.cache_opts.max_seq_len))
        tokens, lens = np.zeros((B, T), np.int32), np.zeros(B, np.int32)
        slots = np.full(B, self.batch_opts.max_batch, np.int32)
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
                self.batch_opts.max_batch, self.cfg.vocab_size)))
        pad = [None] * (B - len(group))
        return penalties.penalty_params([r.params for _, r in group] + pad,
                                        [len(r.prompt_ids) for _, r in group] + [0] * len(pad))

    def _dispatch(self, rows, grammar: bool = False) -> _Dispatched:
        """One decode dispatch over rows (plain, fused speculative or lite steps: specjax.dispatch_plan);
        grammar: with the masks (and grammar drafts) of its constrained rows, computed first (the
        reference order, overlap off)."""
        flags = self._flags([r for _, r in rows])
        b = self.batch_opts
        gated = (self.draft is not None and not grammar and not dispatch_plan.runs_lite(len(rows), b.speculate_below)
                 and self.gate.lite([r for _, r in rows], b.min_accept, b.probe_every))

        def rows_b(kind):  # the rows' bucket for a program of this kind
            return (self.sched.rows_bucket(len(rows), self._min_rows(kind)),)

        def ready(kind, K):  # a program of K steps compiled for these rows (adapted caps wait for it)
            return self.shapes.find(self._decode_key(kind, K, flags), rows_b(kind)) is not None

        p = dispatch_plan.plan(rows, grammar, b, self.sched, self.draft, self.lookahead, gated,
                               caps=self.steps_cap.chain(b), ready=ready)
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
        fn, args, kw = self._decode_call(p.kind, p.num_steps, rows, slots, active, mask, drafts, flags)
        out, trees, self.state = self.compiles.call(lambda: f"{p.kind} K={p.num_steps} rows={len(slots)} {flags}",
                                                    fn, *args, **kw)
        self.host.add("dispatch", t0)
        entry = self._push(p.kind, out, trees, _indexed(rows), p.advance, p.sure)
        entry.after_lite = p.kind == "spec" and self._last_kind == "lite"
        self._last_kind = p.kind
        return entry

    def _hold_back(self, rows) -> bool:
        """Whether a speculative engine skips this step's dispatch because the fused steps in flight are
        expected to finish every row: a row's `sure` tokens (one per fused step in flight) times its
        measured tokens per fused step reach its max_tokens. A fused dispatch has a static number of
        steps and runs one ahead of the host, so the next one would otherwise run whole past the end
        (the eval measured 4.0 such steps per 256-token request, 4.4 % of its fused steps). If the
        estimate was wrong, the step after the read dispatches again: one host round trip lost.
        Plain decoding needs no estimate (its rows' tokens per step are known: Scheduler.stepping)."""
        kinds = {e.kind for e in self._pending}
        if self.draft is None or "spec" not in kinds or "lite" in kinds:  # lite steps give one token each
            return False
        sure = self.sched.sure
        return all(r.accept_ema is not None and len(r.token_ids) + sure[s] * r.accept_ema >= r.max_len
                   for s, r in rows)

    def _min_rows(self, kind: str) -> int:
        """The fewest rows a decode dispatch of this kind pads to (BatchOptions.fused_min_rows for fused
        speculative steps; 2 otherwise: an M = 1 matmul is slow on the GPU, see BatchOptions)."""
        return self.batch_opts.fused_min_rows if kind == "spec" else 2

    @staticmethod
    def _decode_key(kind: str, K: int, flags: dict) -> tuple:
        """The ShapeReuse key of a decode program family (its static arguments)."""
        return ("decode", kind, K, *flags.values())

    def _decode_call(self, kind, K, rows, slots, active, mask, drafts, flags):
        """(program, arguments, static arguments) of a decode dispatch of K steps (K lite steps for
        kind "lite"): a row that finishes stops changing state."""
        if self.draft is not None:
            return self.spec_steps.step, (self.weights, self.draft_weights, self.state, self.samp, slots, active, mask,
                                          self._stop_rows(rows, len(slots)), drafts), \
                dict(num_steps=K, lite=kind == "lite", **flags)
        return self.steps.decode_many, (self.weights, self.state, self.samp, slots, active, mask), \
            dict(num_steps=K, **flags)

    def _compile_later(self, kind, K, rows, flags) -> None:
        """Compile the program of K steps for these rows' bucket on the worker thread (once)."""
        n = self.sched.rows_bucket(len(rows), self._min_rows(kind))
        key = (self._decode_key(kind, K, flags), (n,))
        if key not in self.background.requested:
            slots, active = self.sched.row_slots(rows, num_rows=n)
            self.background.request(key, *self._decode_call(kind, K, rows, slots, active, None, None, flags))

    def _stop_rows(self, rows, B: int) -> prog.StopRows:
        """The rows' stop ids (EOS unless ignored, stop_token_ids; [B, E], E bucketed) and the
        sequence length at which each is finished (prompt + max_len - 1)."""
        E = bucket(max([len(r.stop_ids) for _, r in rows] + [1]), 4, 1 << 30)
        ids = np.full((B, E), -1, np.int32)
        limit = np.zeros(B, np.int32)  # padding rows: finished at once
        for b, (_, r) in enumerate(rows):
            ids[b, :len(r.stop_ids)] = sorted(r.stop_ids)
            limit[b] = len(r.prompt_ids) + r.max_len - 1
        return prog.StopRows(ids, limit)

    # -- results ----------------------------------------------------------------------------
    def _collect(self, keep: _Dispatched | None = None) -> None:
        """Deliver every dispatched output older than `keep` (all of them when None)."""
        while self._pending and self._pending[0] is not keep:
            e = self._pending.popleft()
            self._accept_all([(e, e.rows, self._read(e))])

    def _read(self, e: _Dispatched) -> tuple:
        """e's outputs on the host: (tokens, logprob, top logprobs, top ids, accepted counts, trees)."""
        t0 = time.perf_counter()
        toks, lp, top_lp, top_ids = (None if x is None else _as_rows(e.kind, x).tolist()  # nested lists, once
                                     for x in (e.out.tokens, e.out.logprob, e.out.top_logprobs, e.out.top_ids))
        counts = _as_rows(e.kind, e.out.num_accepted).tolist() if e.kind in ("spec", "lite") else None  # [B, K]
        trees = None if e.trees is None else tuple(np.asarray(t) for t in e.trees)
        self.host.add("read", t0)
        return toks, lp, top_lp, top_ids, counts, trees

    def _accept_all(self, items) -> None:
        """Deliver [(dispatched, its rows, its outputs read)] (host phase "accept")."""
        t0 = time.perf_counter()
        try:
            for e, rows, read in items:
                self._accept(e, rows, *read)
        finally:
            self.host.add("accept", t0)

    def _accept(self, e: _Dispatched, rows, toks, lp, top_lp, top_ids, counts, trees) -> None:
        """Deliver rows [(batch row, slot, request, epoch)] of e's outputs."""
        for b, slot, req, epoch in rows:
            if counts is None:
                ns = [len(toks[b])]
            else:  # K fused steps: row b emitted toks[b][k][:n_k]; n_k = 0 once it finished on the device
                ns = [n for n in counts[b] if n > 0]
            n = sum(ns)
            if self.sched.slots[slot] is req and req.epoch == epoch:  # host mirror of the device length
                self.sched.inflight[slot] -= e.advance
                self.sched.sure[slot] -= e.sure
                self.sched.lens[slot] += 0 if e.kind == "prefill" else n
            if req.finished or req.epoch != epoch:
                continue  # computed after the request finished, was cancelled or preempted: dropped
            if counts is None:
                t_b, lp_b, tl_b, ti_b = (None if x is None else x[b][:n] for x in (toks, lp, top_lp, top_ids))
            else:
                t_b, lp_b, tl_b, ti_b = (None if x is None else [v for k, nk in enumerate(ns) for v in x[b][k][:nk]]
                                         for x in (toks, lp, top_lp, top_ids))
            if e.kind == "spec":
                self.gate.observe(req, counts[b], e.after_lite)
            before = len(req.token_ids)
            req.extend(t_b, lp_b, None if lp is None else [list(zip(i, v)) for i, v in zip(ti_b, tl_b)])
            if e.kind == "spec":  # the steps up to the one that finished the request (a stop string
                used = 0  # is found on the host only: the device ran on); lite steps accept no draft
                for nk in ns:
                    if used >= len(req.token_ids) - before:
                        break
                    req.accept_lens.append(nk)
                    used += nk
            self._report(req, req.token_ids[before:])
            if req.finished:
                if self.sched.slots[slot] is req:
                    self.sched.release(slot)
            elif trees is not None:
                req.tree = (trees[0][b], trees[1][b])
