"""The grammar part of the engine's step (specjax.engine): batches with grammar-constrained rows.

`GrammarSteps` is a base class of specjax.engine.Engine: these methods run on the engine's own
state (scheduler, device state, programs, options, pending outputs); the engine calls them from its
step (`_constrained_step`), its prefill (`_prefill_grammar`), its reference-order dispatch
(`_step_grammar`) and `add_request` (`_attach_grammar`).

Rows whose regex / choice constraint runs on the device DFA (specjax.engine_dfa) are no grammar
rows here: like unconstrained rows they need no host work; the programs mask them by their DFA
state (the static flag `dfa`, set by Engine._flags).

Batches with grammar-constrained rows need step t's tokens (and next tree) before step t+1's masks.
Overlap (SchedulerOptions(overlap=True), the default) hides that behind the target forward:

    dispatch forward(t+1)      speculative: the verify forward over the next trees; plain: the
       |                       decode forward (logits [B, V]); both depend on the device state only
    read step t, accept        tokens -> the constrained requests and their matchers (the wait for t
                               is device time); the unconstrained rows' tokens wait until after the
                               next dispatch, off the critical path
    masks(t+1)                 the constrained rows only, in parallel (specjax.grammar_masks):
                               RowMasks, bits [R, W] / [R, N, W] + row indices [R], R bucketed
    grammar drafts(t+1)        speculative with a draft model / head (below), from those masks
    dispatch finish(t+1)       speculative: acceptance + drafting; plain: sampling (programs.sample);
                               the masks go with the call as numpy arrays (the jit's own transfer:
                               cheaper than a jax.device_put of their own)

so the host works while the device runs the forward. SchedulerOptions(overlap=False) is the
reference order: read t, masks, then one program with them (a fused speculative step, or decode_many
with num_steps=1); the outputs are the same. The device applies the masks to the listed rows only
(specjax.token_mask); unconstrained rows of the batch are not masked and cost no mask work. In a
batch with any constrained row every row advances one step per dispatch (plain decoding: one token,
not steps_per_call): a step's device time per token is that of the scanned steps, and with the host
hidden behind the forward the unconstrained rows keep their speed. A grammar that raises while its
masks are computed or its tokens accepted fails only its request (finish_reason "error", the reason
given); its slot and pages are freed at once. Batches without grammars run the fused programs
(several steps per dispatch: specjax.engine); a batch with a grammar row always runs fused
speculative steps, never lite ones (specjax.dispatch_plan). The phases' host times go to
`Engine.host` (specjax.host_timing): read, accept, masks, drafts, dispatch.

Grammar drafts (specjax.grammar_drafts; SchedulerOptions(grammar_drafts=True), a draft model or head):
with the tree masks the host also computes the grammar's continuation after each node of each
constrained row's tree ([B, N, S + 1] int32, -1 for unconstrained rows), and after the prompt for a
prefill ([B, 1, S + 1]); the accept + draft program puts the continuation after the accepted node
into the next tree. Unconstrained batches compile and run without it; with grammar drafts off the
arrays are all -1 (the same programs, the draft's own trees). The continuations start from the
rows' masks just computed (no second fill of the same state).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from specjax.grammar_masks import HostMasks
from specjax.request import Request
from specjax.token_mask import RowMasks

if TYPE_CHECKING:
    from specjax.engine_results import _Dispatched

__all__ = ["GrammarSteps"]

log = logging.getLogger("specjax")


class GrammarSteps:
    """Constrained decoding steps of specjax.engine.Engine (see the module's data flow). They use the
    engine's opts, draft, cfg, sched, masks (grammar_masks.MaskBuilder), host (host_timing.HostTimes),
    programs and device state, and its _collect / _read / _accept_all / _dispatch / _push / _report."""

    def _ensure_compiler(self) -> str | None:
        """Build the grammar compiler on first use; the reason there is none."""
        from specjax.grammar import GrammarCompiler
        if self._grammar is None:
            return "constrained decoding needs a grammar compiler (Engine(grammar=...))"
        if not isinstance(self._grammar, GrammarCompiler):
            try:
                self._grammar = self._grammar()  # built on first use
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer xgrammar cannot read: fail the request
                return f"cannot build the grammar compiler: {type(e).__name__}: {e}"
        return None

    def _attach_grammar(self, req: Request) -> str | None:
        """The request's grammar matcher (the compiler built on first use); the reason it cannot have one."""
        why = self._ensure_compiler()
        if why is not None:
            return why
        try:
            req.grammar = self._grammar.matcher(req.params.constraint, list(req.eos_ids) or None)
        except ValueError as e:  # GrammarError, or stop ids outside the vocabulary
            return str(e)
        return None

    def _constrained_step(self, rows) -> _Dispatched | None:
        """A step of a batch with grammar rows. Overlap: dispatch the target forward (the verify
        forward over the next trees, or plain decoding's forward), read step t and compute the
        masks (and grammar drafts) while it runs, then dispatch the rest with them (acceptance +
        drafting, or sampling). Every row of the batch advances one step; unconstrained rows are
        not masked."""
        if not self.opts.overlap:
            self._collect()
            rows = self.sched.stepping()  # (every step read: = decoding())
            return self._dispatch(rows, grammar=True) if rows else None
        kind = "spec" if self.draft is not None else "decode"
        slots, active = self.sched.row_slots(rows, min_rows=self._min_rows(kind))
        flags = self._flags([r for _, r in rows])
        t0 = time.perf_counter()
        what = lambda: f"{'verify' if self.draft is not None else 'forward'} rows={len(slots)}"  # noqa: E731
        if self.draft is not None:
            verified, self.state = self.compiles.call(what, self.spec_steps.verify, self.weights, self.state, slots,
                                                      active)
        else:
            logits, self.state = self.compiles.call(what, self.steps.forward, self.weights, self.state, slots, active)
        self.host.add("dispatch", t0)
        later = self._collect_constrained()  # step t (and prefills) of the constrained rows: matchers, trees
        mask, drafts = self._step_grammar(rows, len(slots))
        indexed = [(b, s, r) for b, (s, r) in enumerate(rows)]
        if self.draft is not None:
            t0 = time.perf_counter()
            out, trees, self.state = self.compiles.call(
                lambda: f"finish rows={len(slots)} {flags}", self.spec_steps.finish, self.weights, self.draft_weights,
                self.state, verified, self.samp, slots, active, mask, drafts, **flags)
            self.host.add("dispatch", t0)
            entry = self._push("spec", out, trees, indexed, self.spec.num_steps + 1, 1)
        else:
            t0 = time.perf_counter()
            out, _, self.state = self.compiles.call(lambda: f"sample rows={len(slots)} {flags}", self.steps.sample,
                                                    self.state, logits, self.samp, slots, active, mask, **flags)
            self.host.add("dispatch", t0)
            entry = self._push("decode", out, None, indexed, 1, 1)
        self._accept_all(later)  # the unconstrained rows of step t, while step t+1 runs
        return entry

    def _collect_constrained(self) -> list:
        """Deliver every dispatched output to its constrained rows now (their matchers make the next
        masks); returns the other rows' deliveries [(dispatched, rows, outputs read)], to be run
        (Engine._accept_all) once the next program is dispatched."""
        later = []
        while self._pending:
            e = self._pending.popleft()
            read = self._read(e)
            now = [x for x in e.rows if x[2].grammar is not None]
            later.append((e, [x for x in e.rows if x[2].grammar is None], read))
            self._accept_all([(e, now, read)])
        return later

    def _step_grammar(self, rows, B: int) -> tuple[RowMasks | None, np.ndarray | None]:
        """The masks (RowMasks; None: no live constrained row) and grammar drafts ([B, N, S + 1];
        None without a draft model or head) of a decode / speculative step over rows [(slot, request)]
        of a batch of B rows."""
        batch = list(enumerate(r for _, r in rows))
        mask, host = self._grammar_masks(batch, B, tree=self.draft is not None)
        return mask, self._grammar_drafts(batch, B, masks=host)

    def _prefill_grammar(self, samplers, B: int) -> tuple[RowMasks | None, np.ndarray | None]:
        """The first token's masks and grammar drafts ([B, 1, S + 1]) of a prefill's rows
        [(batch row, request)] whose sample is used: one mask row per prefill row (no extra bucket:
        prefill shapes are many already)."""
        mask, host = self._grammar_masks(samplers, B, pad=B)
        return mask, None if mask is None else self._grammar_drafts(samplers, B, tree=False, masks=host)

    def _grammar_masks(self, rows, B: int, tree: bool = False, pad: int | None = None
                       ) -> tuple[RowMasks | None, dict]:
        """The masks of the constrained rows among rows [(batch row, request or None)] of a batch of
        B rows (None: no such row): of the next token, or (tree) of the token after each node of the
        row's next draft tree; and each such request's host masks by id (for its grammar drafts). A
        request whose grammar raises fails here alone. pad: the mask rows (default: bucketed,
        token_mask.rows_bucket)."""
        rows = [(b, r) for b, r in rows if r is not None and r.grammar is not None and not r.finished]
        if not rows:
            return None, {}
        t0 = time.perf_counter()
        if tree:
            host: HostMasks = self.masks.tree_masks([(b, r.grammar, r.tree) for b, r in rows], B)
        else:
            host = self.masks.next_masks([(b, r.grammar) for b, r in rows], B, pad)
        for i, why in host.failures:
            self._fail_running(rows[i][1], why)
        self.host.add("masks", t0)
        by_req = {id(r): host.bits[i] for i, (_, r) in enumerate(rows) if not r.finished}
        # numpy: the program call copies them to the device (uncommitted: replicated under a mesh)
        return RowMasks(host.bits, host.rows), by_req

    def _fail_running(self, req: Request, why: str) -> None:
        """Fail a running request (its slot and pages are freed; what is in flight for it is dropped)."""
        req.fail(why)
        if req.slot is not None and self.sched.slots[req.slot] is req:
            self.sched.release(req.slot)
        self._report(req)

    def _grammar_drafts(self, rows, B: int, tree: bool = True, masks: dict | None = None) -> np.ndarray | None:
        """The grammar's continuations (specjax.grammar_drafts) for rows [(batch row, request or None)]
        of a batch of B rows: after each node of the row's next tree ([B, N, S + 1]), or (tree False)
        after its sequence, for a prefill ([B, 1, S + 1]); -1 where there is none. masks: the rows'
        masks by request id (_grammar_masks), where the continuations start. None without a draft
        model or head (the n-gram drafter takes none). SchedulerOptions(grammar_drafts=False): all -1
        (the same programs run, the trees are the draft's own). A request whose tree drafts found
        nothing lately skips them for a while (specjax.grammar_drafts.Pause)."""
        if self.draft is None or not self.draft.info.has_model:
            return None
        from specjax.grammar_drafts import continuation, pause_of, tree_drafts
        S = self.spec.num_steps
        out = np.full((B, self.spec.num_nodes if tree else 1, S + 1), -1, np.int32)
        if not self.opts.grammar_drafts:
            return out
        t0 = time.perf_counter()
        masks = masks or {}
        for b, req in rows:
            if req is None or req.grammar is None or req.finished:
                continue
            m = masks.get(id(req))
            try:
                if tree:
                    pause = pause_of(req.grammar)
                    if not pause.wanted():  # a grammar that fixed nothing lately (grammar_drafts.Pause)
                        continue
                    out[b] = tree_drafts(req.grammar, *req.tree, S + 1, masks=m)
                    pause.record(bool((out[b] >= 0).any()))
                else:
                    continuation(req.grammar, S + 1, mask=m, out=out[b, 0])
            except Exception as e:  # noqa: BLE001 - drafts are optional: the row's trees stay the draft's
                out[b] = -1
                log.warning("grammar drafts of request %s skipped this step: %s: %s", req.id, type(e).__name__, e)
        self.host.add("drafts", t0)
        return out

    def _width(self) -> int:
        return (self.cfg.vocab_size + 31) // 32
