"""The engine's choices made once at its start (specjax.engine): the kernels of its programs
(specjax.kernels), the attention implementation of the target and the draft (specjax.attention),
and the info line that reports them. Part of Engine (a mixin over its fields: draft, cfg,
cache_opts, batch_opts, sched, lookahead)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax import attention as attn_lib
from specjax import dispatch_plan
from specjax import kernels as kernels_lib
from specjax.kernels import KV_COMPACT_CHOICES, Kernels, choose_kv_compact, compact_shapes
from specjax.scheduler import bucket
from specjax.spec_tiers import describe as describe_tiers


class SetupChoices:
    """Engine's kernel and attention choices and its info line, made once at its start (module doc)."""

    def _choose_kernels(self, kv_compact_impl: str, draft_topk: str, num_pages: int, dtype) -> tuple[Kernels, str]:
        """The kernel implementations of this engine's programs, chosen once, here (specjax.kernels)."""
        if kv_compact_impl not in KV_COMPACT_CHOICES:
            raise ValueError(f"kv_compact_impl must be one of {KV_COMPACT_CHOICES}, got {kv_compact_impl!r}")
        spec = None if self.draft is None else self.draft.spec
        if self.draft is not None and self.draft.tiers is not None:  # the deepest tree of the tiers decides
            trees = [s for s in self.draft.tiers.specs if not s.is_chain]
            spec = max(trees, key=lambda s: s.num_steps) if trees else spec
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
            lazy = dispatch_plan.lazy_ok(self.draft, b)
            lite = ("always fused steps" if b.speculate_below is None else
                    ("lazy steps (plain decoding's program, the draft caught up when read again)" if lazy else
                     "lite steps (plain, the draft kept in sync)") + f" for batches of >= {b.speculate_below} rows")
            mode = (f"speculative ({self.draft.info.method}: num_steps={s.num_steps} topk={s.topk} "
                    f"num_draft_tokens={s.num_draft_tokens}"
                    + (f" ngram_branch={s.ngram_branch}" if s.ngram_branch else "")
                    + ("" if self.draft.tiers is None else
                       " for the largest batches; by rows: " + describe_tiers(self.draft.tiers))
                    + f", lookahead {self.lookahead}; up to "
                    f"{b.spec_steps_per_call} steps per dispatch; {lite}; "
                    + ("row hand-over (a spare slot per row)" if self.handover else "admission ahead")
                    + f", the host {self.opts.unread} dispatch(es) behind)")
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
