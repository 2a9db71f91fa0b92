"""Continuous-batching generation loop over slots (plain decoding).

The device owns the KV cache, sequence lengths and each slot's last token; the host keeps the
request bookkeeping, the page allocator and reads each step's sampled tokens.
"""
from __future__ import annotations

import dataclasses
from collections import deque

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import decode
from specjax.kv_cache import PageAllocator, init_cache
from specjax.request import Request
from specjax.sampling import SamplingArrays


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    page_size: int = 16
    max_seq_len: int = 2048
    num_pages: int | None = None  # default: every slot can reach max_seq_len


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    max_batch: int = 8
    max_prefill_tokens: int = 8192  # rows * padded length of one prefill call
    steps_per_call: int = 8  # decode steps per dispatch; tokens past a request's stop are dropped


def _bucket(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi) if hi >= n else b


def _host(out, to_rows):
    """(tokens, logprob, top_logprobs, top_ids) of a step output as host arrays [B, K, ...]."""
    return tuple(None if x is None else to_rows(np.asarray(x))
                 for x in (out.tokens, out.logprob, out.top_logprobs, out.top_ids))


def _stochastic(reqs) -> bool:
    """Whether any row samples (static: greedy-only batches compile without the sort)."""
    return any(r is not None and r.params.temperature > 0 for r in reqs)


@dataclasses.dataclass(frozen=True)
class Draft:
    """A speculative-decoding draft: a Llama-family model with the target's vocabulary
    (info.method "draft") or an EAGLE-1 / EAGLE-3 head, with its tree configuration."""
    model: nnx.Module
    kv_cfg: object  # ModelConfig giving the draft's KV layout (num_layers, num_kv_heads, head_dim)
    info: object  # specjax.drafter.DraftInfo
    spec: object  # specjax.tree.SpecConfig


class Engine:
    def __init__(self, model: nnx.Module, cfg, cache_opts: CacheOptions, batch_opts: BatchOptions, dtype,
                 draft: Draft | None = None, mesh=None):
        """mesh: a specjax.sharding mesh for tensor parallelism (None: one device). Weights are placed
        in their shardings (a no-op when already restored so) and the device state is created
        sharded; the steps run unchanged (GSPMD)."""
        self.cfg = cfg
        self.cache_opts, self.batch_opts = cache_opts, batch_opts
        self.draft = draft
        rules = None
        if mesh is not None:
            from specjax import sharding
            tp = mesh.shape[sharding.AXIS]
            rules = sharding.resolve_rules(cfg, tp)
            sharding.shard_model(model, mesh, rules)
            if draft is not None and draft.model is not model:
                sharding.shard_model(draft.model, mesh, sharding.resolve_rules(draft.kv_cfg, tp))
        if draft is None:
            self.steps, self.weights = decode.compile_steps(*nnx.split(model))
        else:
            from specjax import step
            self.spec_steps, self.weights, self.draft_weights = step.compile_spec_steps(
                draft.info, draft.spec, *nnx.split(model), *nnx.split(draft.model))
            self.lookahead = step.lookahead(draft.spec, draft.info)
        pages_per_slot = -(-cache_opts.max_seq_len // cache_opts.page_size)
        num_pages = cache_opts.num_pages or batch_opts.max_batch * pages_per_slot + 1
        self.alloc = PageAllocator(num_pages, cache_opts.page_size, pages_per_slot, batch_opts.max_batch)

        def make_state():
            cache = init_cache(cfg, num_pages=num_pages, page_size=cache_opts.page_size,
                               max_slots=batch_opts.max_batch, max_seq_len=cache_opts.max_seq_len, dtype=dtype)
            if draft is None:
                return decode.DecodeState(cache, jnp.zeros((batch_opts.max_batch,), jnp.int32))
            from specjax.step import init_spec_state
            dkv = init_cache(draft.kv_cfg, num_pages=num_pages, page_size=cache_opts.page_size,
                             max_slots=batch_opts.max_batch, max_seq_len=cache_opts.max_seq_len, dtype=dtype).kv
            return init_spec_state(cache, dkv, draft.spec, cfg.vocab_size)

        if mesh is None:
            self.state = make_state()
        else:
            self.state = sharding.create_sharded(make_state, mesh, rules)
        self.slots: list[Request | None] = [None] * batch_opts.max_batch
        self.lens = np.zeros(batch_opts.max_batch, np.int64)  # host mirror of the device seq_lens

    # -- host helpers -------------------------------------------------------------------
    def _push_page_table(self):
        if self.alloc.dirty:
            cache = dataclasses.replace(self.state.cache, page_table=jnp.asarray(self.alloc.table))
            self.state = dataclasses.replace(self.state, cache=cache)
            self.alloc.dirty = False

    def _samp(self, reqs: list[Request | None]) -> SamplingArrays:
        p = [r.params if r is not None else None for r in reqs]
        return SamplingArrays(
            temperature=jnp.asarray([x.temperature if x else 0.0 for x in p], jnp.float32),
            top_p=jnp.asarray([x.top_p if x else 1.0 for x in p], jnp.float32),
            top_k=jnp.asarray([x.top_k if x else 0 for x in p], jnp.int32),
            seed=jnp.asarray([r.seed if r else 0 for r in reqs], jnp.uint32),
        )

    def _reserve(self, rows, ahead: int):
        """Pages for `ahead` more positions of every busy slot; then sync the device page table."""
        cap = self.alloc.pages_per_slot * self.alloc.page_size
        for i, _ in rows:
            if not self.alloc.ensure(i, min(int(self.lens[i]) + ahead, cap)):
                raise RuntimeError("out of KV pages: raise num_pages or lower max_batch")
        self._push_page_table()

    def _padded_rows(self) -> list[Request | None]:
        """The slots, padded to >= 2 rows (see decode.decode); padding rows are inactive."""
        return self.slots + [None] * (max(2, len(self.slots)) - len(self.slots))

    def _append(self, slot: int, req: Request, token: int, logprob=None, top=None) -> bool:
        """Give a token to a request; free its slot and pages when it finishes."""
        if req.append(token, logprob, top):
            self.slots[slot] = None
            self.alloc.release(slot)
            return True
        return False

    def _deliver(self, rows: list[tuple[int, int, Request]], toks, lp=None, top_lp=None, top_ids=None, counts=None):
        """Per row b of the host arrays toks [B, K] (and logprobs [B, K], [B, K, J]), give the first
        counts[b] (default K) tokens to the row's request. Tokens computed after a request finished
        are dropped."""
        for b, slot, req in rows:  # (row of the arrays, slot, request)
            for k in range(toks.shape[1] if counts is None else int(counts[b])):
                top = None if lp is None else list(zip(top_ids[b, k].tolist(), top_lp[b, k].tolist()))
                if self._append(slot, req, int(toks[b, k]), None if lp is None else float(lp[b, k]), top):
                    break

    # -- steps -----------------------------------------------------------------------------
    def _admit(self, queue: deque):
        free = [i for i, r in enumerate(self.slots) if r is None]
        group: list[tuple[int, Request]] = []
        longest = 0
        while queue and free:
            req = queue[0]
            n = len(req.prompt_ids)
            T = _bucket(max(longest, n), 16, max(16, self.cache_opts.max_seq_len))
            if group and (len(group) + 1) * T > self.batch_opts.max_prefill_tokens:
                break
            if not self.alloc.ensure(free[0], n + (1 if self.draft is None else self.lookahead)):
                break
            queue.popleft()
            slot = free.pop(0)
            self.slots[slot] = req
            self.lens[slot] = n
            group.append((slot, req))
            longest = max(longest, n)
        if not group:
            return
        self._push_page_table()
        T = _bucket(longest, 16, max(16, self.cache_opts.max_seq_len))
        B = _bucket(len(group), 1, self.batch_opts.max_batch)
        tokens = np.zeros((B, T), np.int32)
        lens = np.zeros(B, np.int32)
        slots = np.full(B, self.batch_opts.max_batch, np.int32)  # padding rows: out of range
        for b, (slot, req) in enumerate(group):
            tokens[b, : len(req.prompt_ids)] = req.prompt_ids
            lens[b], slots[b] = len(req.prompt_ids), slot
        reqs = [r for _, r in group] + [None] * (B - len(group))
        want_lp = any(r.logprobs is not None for _, r in group)
        args = (self.state, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(slots), self._samp(reqs))
        kw = dict(want_logprobs=want_lp, stochastic=_stochastic(reqs))
        if self.draft is None:
            out, self.state = self.steps.prefill(self.weights, *args, **kw)
        else:
            out, self.state = self.spec_steps.prefill(self.weights, self.draft_weights, *args, **kw)
        self._deliver([(b, slot, r) for b, (slot, r) in enumerate(group)], *_host(out, lambda x: x[:, None]))

    def _spec_decode(self):
        """One fused speculative step (verify, accept, compact, draft the next tree) for every busy slot."""
        rows = [(i, r) for i, r in enumerate(self.slots) if r is not None]
        self._reserve(rows, self.lookahead)
        reqs = self._padded_rows()
        active = np.array([r is not None for r in reqs])
        want_lp = any(r.logprobs is not None for _, r in rows)
        out, self.state = self.spec_steps.step(self.weights, self.draft_weights, self.state,
                                               jnp.arange(len(reqs), dtype=jnp.int32), jnp.asarray(active),
                                               self._samp(reqs), want_logprobs=want_lp,
                                               stochastic=_stochastic(reqs))
        n_acc = np.asarray(out.num_accepted)
        for i, req in rows:
            self.lens[i] += int(n_acc[i])
            req.accept_lens.append(int(n_acc[i]))
        toks, lp, top_lp, top_ids = _host(out, lambda x: x)
        self._deliver([(i, i, r) for i, r in rows], toks, lp, top_lp, top_ids, counts=n_acc)

    def _decode(self):
        if self.draft is not None:
            return self._spec_decode()
        rows = [(i, r) for i, r in enumerate(self.slots) if r is not None]
        remaining = max(r.max_len - len(r.token_ids) for _, r in rows)
        K = min(self.batch_opts.steps_per_call, _bucket(remaining, 1, self.batch_opts.steps_per_call))
        self._reserve(rows, K)
        reqs = self._padded_rows()
        B = len(reqs)
        active = np.array([r is not None for r in reqs])
        want_lp = any(r.logprobs is not None for _, r in rows)
        out, self.state = self.steps.decode_many(self.weights, self.state, jnp.arange(B, dtype=jnp.int32),
                                                 jnp.asarray(active), self._samp(reqs), num_steps=K,
                                                 want_logprobs=want_lp, stochastic=_stochastic(reqs))
        self.lens[active[: len(self.slots)]] += K
        self._deliver([(i, i, r) for i, r in rows], *_host(out, lambda x: np.swapaxes(x, 0, 1)))

    def run(self, requests: list[Request]) -> None:
        """Run requests to completion (continuous batching: freed slots admit queued requests)."""
        queue = deque(requests)
        while queue or any(r is not None for r in self.slots):
            self._admit(queue)
            if any(r is not None for r in self.slots):
                self._decode()
            elif queue:  # nothing runs and the next request still does not fit
                raise RuntimeError(f"request {queue[0].id} needs more KV pages than the cache has "
                                   f"({self.alloc.num_free} free pages of {self.alloc.page_size} tokens)")
