"""The engine's results (specjax.engine, step 4): each dispatch is recorded with its rows (_push: their
host copies started, the scheduler's `inflight` / `sure` counts raised), its outputs read on the host one
step behind and delivered to their requests (_report: the step's updates); the host mirror of the device
lengths follows. A row's outputs computed after its request finished, was cancelled or preempted are
dropped; token ids outside the vocabulary (a device fault) fail their request alone. Part of Engine (a
mixin over its fields: sched, host, gate, cfg, kernels, _pending, _updates, _fail_running)."""
from __future__ import annotations

import logging
import time
import dataclasses

import jax
import numpy as np

from specjax.engine_options import StepUpdate
from specjax.request import Request

log = logging.getLogger("specjax")


def _as_rows(kind: str, x) -> np.ndarray:
    """A step output on the host as [B, K, ...] (prefill: one token per row; decode and spec: [K, B, ...])."""
    x = np.asarray(x)
    return x[:, None] if kind == "prefill" else np.swapaxes(x, 0, 1)


@dataclasses.dataclass
class _Dispatched:
    """A dispatched program whose outputs are on their way to the host."""
    kind: str  # "prefill" | "decode" | "spec" | "lite" | "lazy"
    out: object
    trees: tuple | None  # speculative: the rows' next trees (tokens, parents [B, N])
    rows: list[tuple[int, int, Request, int]]  # (row, slot, request, its epoch at dispatch)
    advance: int  # positions per row counted in the scheduler's `inflight`
    sure: int = 0  # tokens per row counted in the scheduler's `sure` (each step gives >= 1 or finishes)
    after_lite: bool = False  # a fused dispatch right after lite ones (its first step verifies a stale tree)
    succ_slots: frozenset = frozenset()  # rows' successors (row hand-over): no sure steps; out.slot says which ran


class ResultSteps:
    """Engine's reading and delivery of dispatched outputs (module doc)."""

    def _push(self, kind, out, trees, rows, advance, steps, succ=()) -> _Dispatched:
        """rows: (batch row, slot, request) of the rows whose outputs the host reads; advance: cache
        entries a row may gain; steps: steps run (each gives an unfinished row >= 1 token); succ: (batch
        row, slot, request) of the rows' successors (row hand-over: they may gain `advance`, no sure steps)."""
        for x in jax.tree.leaves((out, trees)):
            x.copy_to_host_async()
        entry = _Dispatched(kind, out, trees, [(b, s, r, r.epoch) for b, s, r in (*rows, *succ)], advance, steps,
                            succ_slots=frozenset(s for _, s, _ in succ))
        for _, s, _ in succ:
            self.sched.inflight[s] += advance
        if kind != "prefill":
            self.dispatches[kind] += 1
            self.dispatched_steps[kind] += steps
        for _, s, _ in rows:
            self.sched.inflight[s] += advance
            self.sched.sure[s] += steps
        self._pending.append(entry)
        return entry

    def _report(self, req: Request, tokens=()) -> None:
        upd = self._updates.get(id(req))
        if upd is None:
            self._updates[id(req)] = StepUpdate(req, list(tokens))
        else:
            upd.token_ids.extend(tokens)

    def _collect(self, keep: _Dispatched | None = None) -> None:
        """Deliver every dispatched output older than `keep` (all of them when None)."""
        while self._pending and self._pending[0] is not keep:
            e = self._pending.popleft()
            self._accept_all([(e, e.rows, self._read(e))])

    def _unread(self, newest):
        """The oldest dispatch a step leaves unread, for _collect: its decode dispatch `newest`, or with
        SchedulerOptions.unread = n the n-th newest decode dispatch (prefills between them stay unread too);
        None (read all) in the synchronous loop and after a step that dispatched nothing."""
        if not self.opts.async_loop or newest is None:
            return None
        decodes = [e for e in self._pending if e.kind != "prefill"]  # the last one is `newest`
        return decodes[max(len(decodes) - self.opts.unread, 0)]

    def _read(self, e: _Dispatched) -> tuple:
        """e's outputs on the host: (tokens, logprob, top logprobs, top ids, accepted counts, trees, the
        slot each row's steps ran: [B, K] with row hand-over, else None)."""
        t0 = time.perf_counter()
        toks, lp, top_lp, top_ids = (None if x is None else _as_rows(e.kind, x).tolist()  # nested lists, once
                                     for x in (e.out.tokens, e.out.logprob, e.out.top_logprobs, e.out.top_ids))
        counts = _as_rows(e.kind, e.out.num_accepted).tolist() if e.kind in ("spec", "lite", "lazy") else None
        trees = None if e.trees is None else tuple(np.asarray(t) for t in e.trees)
        ran = getattr(e.out, "slot", None)
        ran = None if ran is None else _as_rows(e.kind, ran).tolist()
        if ran is not None:  # rows that ran a successor inside this dispatch (row hand-over)
            self.handed_over += sum(r[0] != r[-1] for r in ran)
        self.host.add("read", t0)
        return toks, lp, top_lp, top_ids, counts, trees, ran

    def _accept_all(self, items) -> None:
        """Deliver [(dispatched, its rows, its outputs read)] (host phase "accept")."""
        t0 = time.perf_counter()
        try:
            for e, rows, read in items:
                self._accept(e, rows, *read)
        finally:
            self.host.add("accept", t0)

    def _accept(self, e: _Dispatched, rows, toks, lp, top_lp, top_ids, counts, trees, ran=None) -> None:
        """Deliver rows [(batch row, slot, request, epoch)] of e's outputs (ran: the slot of each row's
        steps [B, K], row hand-over: a row's steps that ran another slot are not this request's)."""
        for b, slot, req, epoch in rows:
            if counts is None:
                cb = ns = [len(toks[b])]
            else:  # K fused steps: row b emitted toks[b][k][:n_k]; n_k = 0 once it finished on the device
                cb = counts[b] if ran is None else [n if at == slot else 0 for n, at in zip(counts[b], ran[b])]
                ns = [n for n in cb if n > 0]
            n = sum(ns)
            if self.sched.slots[slot] is req and req.epoch == epoch:  # host mirror of the device length
                if e.kind == "lazy":  # its draft stays at the length before (specjax.engine_catchup)
                    self._note_lag(slot, req, epoch, int(self.sched.lens[slot]))
                self.sched.inflight[slot] -= e.advance
                self.sched.sure[slot] -= 0 if slot in e.succ_slots else e.sure
                self.sched.lens[slot] += 0 if e.kind == "prefill" else n
            if req.finished or req.epoch != epoch:
                continue  # computed after the request finished, was cancelled or preempted: dropped
            if counts is None:
                t_b, lp_b, tl_b, ti_b = (None if x is None else x[b][:n] for x in (toks, lp, top_lp, top_ids))
            else:
                t_b, lp_b, tl_b, ti_b = (None if x is None else [v for k, nk in enumerate(cb) if nk > 0
                                                                 for v in x[b][k][:nk]]  # by step index
                                         for x in (toks, lp, top_lp, top_ids))
            V = self.cfg.vocab_size
            if t_b and (min(t_b) < 0 or max(t_b) >= V):  # a fault on the device: this request fails, not the engine
                why = (f"the device returned token ids outside the vocabulary [0, {V}) for this request "
                       f"({[t for t in t_b if not 0 <= t < V][:4]}; {e.kind} dispatch, kernels {self.kernels})")
                log.error("engine: request %s failed: %s", req.id, why)
                self._fail_running(req, why)
                continue
            if e.kind == "spec":
                self.gate.observe(req, cb, e.after_lite)
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
            elif trees is not None and (ran is None or ran[b][-1] == slot):  # the row's tree at the end
                req.tree = (trees[0][b], trees[1][b])
