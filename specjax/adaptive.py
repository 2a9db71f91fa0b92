"""Acceptance-gated speculation: lite steps while the drafts do not repay the fused step.

A fused step costs c_spec and emits tau tokens per row (the tokens its verification accepts, plus
one); a lite step (specjax.step_lite.spec_lite_step: plain decoding that keeps the draft in sync) costs
about a plain step, c_lite, and emits one. Speculation pays iff tau > c_spec / c_lite, the
break-even acceptance (`min_accept`). Measured on an H100 for SmolLM2-135M at batch 1: an n-gram
chain step costs 1.36 ms against 1.01 ms per plain token (break-even 1.35, docs/benchmarks.md), so
on text that copies nothing (code written from scratch: tau 1.17) fused steps lose 12 %.

The gate (host only; the engine asks it before each dispatch of a batch without grammars):
  - each request keeps an estimate of its tau: an exponential average over its fused dispatches of
    the tokens per fused step (`Request.accept_ema`; None until its first fused step is read);
  - a batch runs fused steps while any row has no estimate yet, or the mean estimate of its rows is
    >= min_accept; otherwise lite steps;
  - while gated, every `probe_every + 1`-th dispatch is a fused one anyway (a probe: the text may
    start copying), whose counts refresh the estimates. A probe's first step verifies the tree
    grown before the lite steps (stale: fewer accepts), so a dispatch that follows lite steps is
    measured from its second step on when it has one.
Switching is lossless (lite and fused steps give the same tokens, tests/test_adaptive_spec.py) and
compiles nothing new once both kinds ran at a batch size. The decision uses results read one step
behind, like everything the host decides.
"""
from __future__ import annotations

__all__ = ["AcceptanceGate", "check_min_accept", "check_probe_every", "EMA_WEIGHT", "NGRAM_MIN_ACCEPT"]

EMA_WEIGHT = 0.5  # weight of a fused dispatch's measurement in a request's estimate
NGRAM_MIN_ACCEPT = 1.35  # the n-gram drafter's break-even (H100, SmolLM2-135M, batch 1; module doc)


def check_min_accept(value) -> None:
    """min_accept is None or a number >= 1 (ValueError naming the value otherwise)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1):
        raise ValueError(f"min_accept must be None, 'auto' or a number >= 1 (tokens per fused step), got {value!r}")


def check_probe_every(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"probe_every must be an int >= 1, got {value!r}")


class AcceptanceGate:
    """The engine's lite-or-fused decision for batches without grammars (module doc)."""

    def __init__(self):
        self.idle = 0  # lite dispatches since the last fused one
        self.gated = 0  # lite dispatches the gate chose
        self.probes = 0  # fused dispatches run to re-measure a gated batch

    @staticmethod
    def batch_tau(reqs) -> float | None:
        """The mean estimate of the rows; None when some row has none yet."""
        ests = [r.accept_ema for r in reqs]
        if not ests or any(e is None for e in ests):
            return None
        return sum(ests) / len(ests)

    def lite(self, reqs, min_accept: float | None, probe_every: int) -> bool:
        """Whether the next dispatch over these requests runs lite steps (counts it); min_accept
        None: never."""
        tau = None if min_accept is None else self.batch_tau(reqs)
        if tau is None or tau >= min_accept:
            self.idle = 0
            return False
        if self.idle >= probe_every:
            self.idle = 0
            self.probes += 1
            return False
        self.idle += 1
        self.gated += 1
        return True

    @staticmethod
    def observe(req, counts: list[int], after_lite: bool) -> None:
        """Fold one fused dispatch's tokens per step of a request (counts [K]; 0: the row had finished
        on the device) into its estimate; a dispatch after lite steps skips its first (stale) step
        when it has more."""
        ns = [n for n in counts if n > 0]
        if after_lite and len(ns) > 1:
            ns = ns[1:]
        if not ns:
            return
        tau = sum(ns) / len(ns)
        prev = req.accept_ema
        req.accept_ema = tau if prev is None else (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * tau

    def stats(self) -> dict:
        return {"gated_dispatches": self.gated, "gate_probes": self.probes}
