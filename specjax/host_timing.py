"""Host time of the engine loop by phase: cheap perf_counter accumulators (a few per step).

    read      waiting for and converting a step's outputs (device -> host)
    accept    delivering tokens to requests: stop conditions, detokenization, grammar matchers
    masks     grammar masks of the constrained rows (specjax.grammar_masks)
    drafts    grammar drafts of the constrained rows (specjax.grammar_drafts; speculative decoding)
    dispatch  calling the jitted programs (enqueueing them), with the copies of their host inputs
              (slots, prefill tokens, grammar masks: numpy arrays that the call transfers; this is
              cheaper than a jax.device_put of their own, so the masks' upload is counted here)

`step` is the whole of Engine.step; what the phases leave of it is the rest of the loop
(scheduling, page tables, building prefill inputs). Engine.stats() reports them in seconds.
"""
from __future__ import annotations

import time

PHASES = ("read", "accept", "masks", "drafts", "dispatch")


class HostTimes:
    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self.step_s = 0.0

    def add(self, phase: str, t0: float) -> float:
        """Count the time since t0 to `phase`; returns now (the start of the next phase)."""
        now = time.perf_counter()
        self.seconds[phase] += now - t0
        return now

    def stats(self) -> dict:
        return {"host_steps": self.steps, "host_step_s": self.step_s,
                **{f"host_{p}_s": s for p, s in self.seconds.items()}}
