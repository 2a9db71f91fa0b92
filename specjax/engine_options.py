"""The engine's options and the objects it hands out (specjax.engine re-exports them): the KV cache
(`CacheOptions`), batching and dispatch (`BatchOptions`), a speculative draft (`Draft`) and what one
engine step gave a request (`StepUpdate`)."""
from __future__ import annotations

import dataclasses

from flax import nnx

from specjax.adaptive import check_min_accept, check_probe_every
from specjax.request import Request

__all__ = ["BatchOptions", "CacheOptions", "Draft", "StepUpdate", "check_speculate_below"]


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    page_size: int = 16
    max_seq_len: int = 2048
    num_pages: int | None = None  # default: every slot can reach max_seq_len (plus a speculative step)
    prefix_cache: bool = True  # share the KV pages of cached prompt prefixes between requests


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    max_batch: int = 8
    max_prefill_tokens: int = 8192  # rows * padded length of one prefill call (several prompts share one)
    prefill_chunk: int = 2048  # the longest piece of one prompt in a prefill call: longer prompts are
    #                            prefilled in chunks between decode steps (running streams keep flowing)
    steps_per_call: int = 8  # decode steps per dispatch; tokens past a request's stop are dropped
    spec_steps_per_call: int = 4  # fused speculative steps per dispatch (batches without grammars);
    #                               stop ids and length limits are checked on the device between them
    speculate_below: int | None = None  # speculative engine: fused steps for batches of fewer rows than
    #                                     this, lite steps (plain decoding, the draft kept in sync) from
    #                                     this many rows on (specjax.dispatch_plan); None: always fused
    lazy_draft: bool = True  # those lite steps are plain decoding's program and an EAGLE head's draft is
    #                          brought up to date only when the batch shrinks (specjax.lazy_draft); False:
    #                          lite steps keep the draft in sync (draft models and n-gram drafters always do)

    adaptive_steps: bool = False  # steps per dispatch halve (to a quarter) while the host waits for the
    #                               device and grow back while it does not (dispatch_plan.StepsCap): a
    #                               new request waits less for the dispatches in flight (the server's);
    #                               a level's programs compile in the background, never on the engine thread
    min_accept: float | None = None  # speculative engine: lite steps while the rows' measured tokens per
    #                                  fused step are below this (specjax.adaptive); None: off
    probe_every: int = 8  # gated by min_accept: one fused dispatch after this many lite ones
    fused_min_rows: int = 1  # fused speculative dispatches pad their rows to at least this many (1 or 2):
    #                          1 runs one request's fused steps without a padding row (the verify forward
    #                          over 17 tokens is then M = 17, not 34: SmolLM2's fused step 1 410 -> 1 296 us
    #                          and 1.98-2.06x -> 2.13-2.14x plain on an H200, docs/benchmarks.md); 2 pads
    #                          like plain decoding (an M = 1 dot became a weight-sized multiply + reduce)

    def __post_init__(self):
        for name in ("prefill_chunk", "steps_per_call", "spec_steps_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_speculate_below(self.speculate_below)
        check_min_accept(self.min_accept)
        check_probe_every(self.probe_every)
        if self.fused_min_rows not in (1, 2) or isinstance(self.fused_min_rows, bool):
            raise ValueError(f"fused_min_rows must be 1 or 2, got {self.fused_min_rows!r}")


def check_speculate_below(value) -> None:
    """speculate_below is None or an int >= 1 (ValueError naming the value otherwise)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"speculate_below must be None, 'auto' or an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Draft:
    """A speculative-decoding draft: a Llama-family model with the target's vocabulary
    (info.method "draft"), an EAGLE-1 / EAGLE-3 head, or the n-gram drafter (info.method "ngram",
    model and kv_cfg None), with its tree configuration."""
    model: nnx.Module | None
    kv_cfg: object  # ModelConfig giving the draft's KV layout (num_layers, num_kv_heads, head_dim); None: no KV
    info: object  # specjax.drafter.DraftInfo
    spec: object  # specjax.tree.SpecConfig
    tiers: object = None  # specjax.spec_tiers.SpecTiers: tree shapes by the batch's rows (None: spec alone)


@dataclasses.dataclass
class StepUpdate:
    """What one engine step gave a request: its new tokens (maybe none) and whether it is done."""
    request: Request
    token_ids: list[int]

    @property
    def finished(self) -> bool:
        return self.request.finished
