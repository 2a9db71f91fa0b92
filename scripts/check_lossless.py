"""Greedy speculative tokens against plain decoding's, engine variant by variant (the GPU's lossless check).

    python3 scripts/check_lossless.py --model DIR [--draft DIR] [--variants old,new,...] [--prompts 2]
        [--max-tokens 32] [--dtype float32] [--trace] [--json F]

Plain decoding runs first (max_batch 1); then each variant's engine decodes the same prompts greedily (EOS
ignored) and every request's first token that differs from plain's is printed with its neighbours.
Variants (batch 1 unless named):
  old           one row, no row hand-over, one dispatch unread (the batch-1 engine before session 43; its
                device state holds a spare slot since session 45: engine_handover.device_slots)
  new           row hand-over, two dispatches unread (the batch-1 default: two slots)
  old_1slot     old with a device state of one slot (the XLA defect that device_slots avoids: check it
                again on a new jax)
  old_mb2       old at max_batch 2 (two slots)
  old_nobranch  old with the tree 7/4/24 without its n-gram branch
  old_chain     old with a chain of 4
--trace: the synchronous loop, and after every prefill and fused program call the slots' seq_lens,
draft_seq_lens, done, tree tokens / parents / depths [:, :8], page table [:, :4] and the call's tokens (compare a GPU's trace with the CPU's).
Sessions 44-45 found a one-slot device state not lossless on an H100 and an H200 in float32 (docs/benchmarks.md,
"One slot without hand-over").
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("old", "new", "old_1slot", "old_mb2", "old_nobranch", "old_chain")


@contextlib.contextmanager
def one_device_slot():
    """Engines built inside hold device state for their scheduler's slots only (no spare slot for one row)."""
    import specjax.engine as eng_mod
    keep = eng_mod.device_slots
    eng_mod.device_slots = lambda num_slots, speculative: num_slots
    try:
        yield
    finally:
        eng_mod.device_slots = keep


def trace_programs(eng, log: list) -> None:
    """Record the slot state after every prefill / fused program call of a speculative engine (synchronous)."""
    progs = eng.spec_steps

    def show(tag, out, state):
        def get(a):
            return None if a is None else np.asarray(jax.device_get(a)).tolist()
        rec = {"call": tag, "seq_lens": get(state.cache.seq_lens), "draft_seq_lens": get(state.draft_seq_lens),
               "done": get(state.done), "tree": get(state.tree_tokens[:, :8]),
               "parents": get(state.tree_parents[:, :8]), "depth": get(state.tree_depth[:, :8]),
               "pages": get(state.cache.page_table[:, :4]), "tokens": get(out.tokens)}
        log.append(rec)
        print("TRACE", json.dumps(rec), flush=True)

    def prefill(*a, **k):
        r = progs.prefill(*a, **k)
        show("prefill", r[0], r[2])
        return r

    def step(*a, **k):
        r = progs.step(*a, **k)
        show(f"step K={k.get('num_steps')} lite={k.get('lite', False)}", r[0], r[2])
        return r
    eng.spec_steps = progs._replace(prefill=prefill, step=step)


def first_diffs(toks: list[list[int]], ref: list[list[int]]) -> list[int | None]:
    """Per request: the first index where toks differs from ref (a length difference counts), else None."""
    out = []
    for t, r in zip(toks, ref):
        d = next((i for i, (x, y) in enumerate(zip(t, r)) if x != y), None)
        out.append(d if d is not None or len(t) == len(r) else min(len(t), len(r)))
    return out


def variant_llm(v: str, model: str, draft: str, dtype: str, sync: bool):
    from specjax.llm import LLM
    from specjax.scheduler import SchedulerOptions
    from specjax.tree import SpecConfig
    kw = dict(model=model, draft=draft, dtype=dtype, max_batch=2 if v == "old_mb2" else 1,
              scheduler=SchedulerOptions(handover=v == "new", unread=2 if v == "new" else 1, async_loop=not sync))
    if v == "old_nobranch":
        kw["spec"] = SpecConfig(method="eagle3", num_steps=7, topk=4, num_draft_tokens=24)
    if v == "old_chain":
        kw["spec"] = SpecConfig(method="eagle3", num_steps=4)
    with one_device_slot() if v == "old_1slot" else contextlib.nullcontext():
        return LLM(**kw)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=str(ROOT / "specjax/assets/eagle3-smollm2-135m"))
    p.add_argument("--variants", default="old,new")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--trace", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    from specjax.llm import LLM
    from specjax.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Write a short note number {i} about the weather, the sea and the mountains." for i in range(a.prompts)]
    ref = [list(map(int, o.token_ids)) for o in LLM(model=a.model, dtype=a.dtype, max_batch=1).generate(prompts, sp)]
    res = {"backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""), "plain": ref, "variants": {}}
    for v in variants:
        llm = variant_llm(v, a.model, a.draft, a.dtype, a.trace)
        log: list = []
        if a.trace:
            trace_programs(llm.engine, log)
        toks = [list(map(int, o.token_ids)) for o in llm.generate(prompts, sp)]
        diffs = first_diffs(toks, ref)
        sha = hashlib.sha1(json.dumps(toks).encode()).hexdigest()[:12]
        print(f"RESULT {v} state slots {llm.engine.state.cache.seq_lens.shape[0]} match "
              f"{all(d is None for d in diffs)} first_diff {diffs} sha {sha}", flush=True)
        for t, r, d in zip(toks, ref, diffs):
            if d is not None:
                print(f"  from {max(0, d - 2)}: got {t[max(0, d - 2):d + 8]} plain {r[max(0, d - 2):d + 8]}", flush=True)
        res["variants"][v] = {"tokens": toks, "first_diff": diffs, "trace": log}
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
