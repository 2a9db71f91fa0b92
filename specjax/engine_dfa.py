"""The device-DFA part of the engine (specjax.engine): regex / choice / JSON-schema constraints
followed on the device (specjax.device_dfa), so their rows need no host grammar work per token.

`DFASteps` is a base class of specjax.engine.Engine, on the engine's own state:

* `_attach_constraint` (add_request): with SchedulerOptions(device_dfa=True) (the default) a regex,
  choice or JSON-schema constraint is compiled to a token DFA within the static limits
  (specjax.dfa_routing; cached per constraint; built on the engine's thread unless the caller
  prepared it in its own with `prepare_dfa`, as specjax.async_llm does; a matcher attached by the
  caller, as specjax.async_llm does after validating the constraint in its time-bounded worker, is
  then dropped); the request then carries the DFA (`Request.dfa`, `constraint_path` "device_dfa")
  and no matcher: its batches run the unconstrained programs (several steps per dispatch) with the
  static flag `dfa`. Otherwise it takes the host grammar path (specjax.engine_grammar;
  `constraint_path` "host_grammar"); a regex / choice / schema that could not go to the device says
  why (`Request.dfa_fallback`, logged) and is counted (stats: dfa_fallbacks). An invalid constraint
  fails its request there, as without DFAs.
* `_admit_dfa` (prefill admissions): the tables of the admitted DFA requests are written in one
  device update (device_dfa.admit), with the state after what the admission prefills (0 for a new
  request; a preempted one walks its generated tokens, once, on the host); every other admitted slot
  gets state -1 (a reused slot is cleared). The tables (DFATables in the device state) are created
  with the first DFA request: engines that never see one carry none.
* The request finishes at an EOS of its DFA (allowed exactly where the text is a complete match),
  as the host path finishes where the grammar terminates: its EOS ids are stop ids (also for
  ignore_eos), checked on the device between fused steps too.
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np

from specjax import device_dfa as dfa_lib
from specjax import programs as prog
from specjax.request import Request
from specjax.scheduler import bucket

__all__ = ["DFASteps"]

log = logging.getLogger("specjax")
_ROUTER_LOCK = threading.Lock()


class DFASteps:
    """Device-DFA routing and admission of specjax.engine.Engine (see the module)."""

    _dfa_router = None

    def _dfa_counts(self) -> dict:
        if not hasattr(self, "_dfa_stats"):
            self._dfa_stats = dict(dfa_requests=0, host_grammar_requests=0, dfa_fallbacks=0)
        return self._dfa_stats

    def _router(self):
        from specjax.dfa_routing import DFARouter
        with _ROUTER_LOCK:  # prepare_dfa may run in a worker thread while the engine thread admits
            if self._dfa_router is None:
                self._dfa_router = DFARouter(self.cfg.vocab_size)
            return self._dfa_router

    def _route(self, req: Request, info):
        """(DeviceDFA, None) or (None, why) for the request's constraint over vocabulary info (cached)."""
        eos = tuple(req.eos_ids) or tuple(int(t) for t in info.stop_token_ids)
        return self._router().route(req.params.constraint, info, eos, self.opts.dfa_max_states,
                                    self.opts.dfa_max_classes)

    def prepare_dfa(self, req: Request) -> None:
        """Build the device DFA of a request's constraint now, in the caller's thread, so that
        add_request on the engine thread finds it in the router's cache: the lift of a JSON schema to
        tokens costs 0.1-1.4 s over SmolLM2's 49 152 tokens, a pause of every running request when
        done on the engine thread. specjax.async_llm calls this in a worker thread once the request's
        matcher is compiled (its vocabulary is the engine's); without device DFAs, a DFA kind or a
        matcher it does nothing. A failure here is left to add_request, which routes again and
        reports it as it always did."""
        from specjax.dfa_routing import DFA_KINDS
        c = req.params.constraint
        if not (self.opts.device_dfa and c is not None and c[0] in DFA_KINDS and req.grammar is not None):
            return
        try:
            self._route(req, req.grammar.tokenizer_info)
        except Exception as e:  # noqa: BLE001 - add_request routes again and reports it
            log.debug("request %s: device DFA not prepared: %s: %s", req.id, type(e).__name__, e)

    def _attach_constraint(self, req: Request) -> str | None:
        """The request's device DFA or host grammar matcher; the reason it can have neither."""
        from specjax.dfa_routing import DFA_KINDS
        counts = self._dfa_counts()
        kind = req.params.constraint[0]
        if self.opts.device_dfa and kind in DFA_KINDS:
            why = self._ensure_compiler()
            if why is not None and req.grammar is None:
                return why
            # the vocabulary: the engine's compiler's, or that of the matcher the caller attached
            dfa, why = self._route(req, self._grammar.tokenizer_info if why is None else req.grammar.tokenizer_info)
            if dfa is not None:  # a matcher the caller attached (AsyncLLM's bounded compiler) is dropped
                req.dfa, req.grammar, req.constraint_path = dfa, None, "device_dfa"
                req.stop_ids = req.stop_ids | set(dfa.eos_ids)  # the DFA's end, as the grammar's ends the host path
                counts["dfa_requests"] += 1
                return None
            req.dfa_fallback = why
            counts["dfa_fallbacks"] += 1
            log.info("request %s: %s constraint on the host grammar path: %s", req.id, kind, why)
        why = None if req.grammar is not None else self._attach_grammar(req)  # (a caller's matcher kept)
        if why is None:
            req.constraint_path = "host_grammar"
            counts["host_grammar_requests"] += 1
        return why

    def _dfa_tables(self, group) -> tuple[int, int] | None:
        """The device tables' (S_max, C_max), created (or, after a change of the limits while no other
        DFA request runs, recreated) for admitted slots [(slot, request)]; None: no tables."""
        limits = (self.opts.dfa_max_states, self.opts.dfa_max_classes)
        t = self.state.dfa
        if t is not None and tuple(t.next.shape[1:]) != limits:
            admitted = {s for s, _ in group}
            if not any(r.dfa is not None for s, r in self.sched.running() if s not in admitted):
                t = None
        if t is None:
            if not any(r.dfa is not None for _, r in group):
                return None if self.state.dfa is None else tuple(self.state.dfa.next.shape[1:])
            t = self._commit(dfa_lib.init_tables(self.device_slots, self.cfg.vocab_size, *limits))
            self.state = dataclasses.replace(self.state, dfa=t)
        return tuple(t.next.shape[1:])

    def _admit_dfa(self, group) -> None:
        """Device DFA tables of admitted slots [(slot, request)] (see the module). A DFA larger than
        the existing tables (the limits raised while DFA requests run) takes the host path instead."""
        shape = self._dfa_tables(group)
        if shape is None:
            return
        for _, r in group:
            if r.dfa is not None and not r.dfa.fits(*shape):
                r.dfa, r.constraint_path = None, None
                r.dfa_fallback = f"the DFA does not fit the device tables {shape} created under other limits"
                self._dfa_counts()["dfa_requests"] -= 1
                self._dfa_counts()["dfa_fallbacks"] += 1
                why = self._attach_grammar(r)  # compiled before: the same constraint
                if why is None:
                    r.constraint_path = "host_grammar"
                    self._dfa_counts()["host_grammar_requests"] += 1
                else:
                    raise RuntimeError(f"request {r.id}: no host grammar for a DFA fallback: {why}")
        dfa_rows = [(s, r) for s, r in group if r.dfa is not None]
        M = self.num_slots
        others = [s for s, r in group if r.dfa is None]
        if others:
            slots = np.full(bucket(len(others), 1, M), M, np.int32)
            slots[:len(others)] = others
            self.state = prog.clear_dfa(self.state, slots)
        if not dfa_rows:
            return
        B = bucket(len(dfa_rows), 1, M)
        cls = np.zeros((B, self.cfg.vocab_size), np.int16 if shape[1] <= 32767 else np.int32)  # the tables' dtype
        nxt = np.full((B,) + shape, -1, np.int32)
        start = np.full(B, -1, np.int32)
        slots = np.full(B, M, np.int32)
        for b, (s, r) in enumerate(dfa_rows):
            slots[b] = s
            cls[b], nxt[b] = r.dfa.padded(*shape)
            start[b] = r.dfa.state_after(r.token_ids)  # tokens generated before a preemption
        self.state = prog.admit_dfa(self.state, slots, cls, nxt, start)
