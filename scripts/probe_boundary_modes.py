"""Request boundaries at batch 1: plain decoding and the speculative engine's boundary modes, timed in
rounds on one machine (runs anywhere; meant for a GPU).

    python3 scripts/probe_boundary_modes.py --model DIR [--draft DIR] [--prompts 16]
        [--max-tokens 256] [--rounds 3] [--modes plain base handover ...] [--json F]

Each mode is an LLM (one slot, greedy, EOS ignored) over the same prompts:
  plain         no draft;
  base          SchedulerOptions(handover=False, unread=1): admission ahead, one dispatch unread (the
                batch-1 default until session 43);
  handover      SchedulerOptions(handover=True, unread=1): row hand-over (specjax.engine_handover);
  unread2       SchedulerOptions(handover=False, unread=2): the host reads two dispatches behind;
  handover2     both (the batch-1 default since session 43: SchedulerOptions() at max_batch 1).
Every mode is compiled first (two untimed `generate` calls, the second for the prefix cache's shapes); then
each round times one `generate` per mode, the modes' order rotated from round to round, so that a slow
spell of the machine touches every mode. Reported per mode: the median wall of its rounds, tokens/s, τ
(the eval's: tokens over the requests' fused steps) and tokens per dispatched fused step (past-end steps
count), the speculative modes' ratio to plain's tokens/s and the batch-1 bar τ / 1.3 (issue 13), the
engine's boundary counters and a hash of the tokens (bf16: the modes' programs may differ in rounding, so
the hashes may too).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"plain": None, "base": {"handover": False, "unread": 1}, "handover": {"handover": True, "unread": 1},
         "unread2": {"handover": False, "unread": 2}, "handover2": {"handover": True, "unread": 2}}
COUNTERS = ("spec_dispatch_steps", "spec_dispatches", "handed_over", "handover_no_pages", "admitted_ahead",
            "admit_ahead_misses", "held_back_steps")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None, help="a head dir (default: the shipped one)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.rounds < 1 or a.prompts < 1:
        p.error("--rounds and --prompts must be >= 1")
    import jax

    from specjax.llm import LLM
    from specjax.sampling_params import SamplingParams
    from specjax.scheduler import SchedulerOptions

    draft = a.draft or str(Path(__file__).resolve().parents[1] / "specjax/assets/eagle3-smollm2-135m")
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Write a short note number {i} about the weather, the sea and the mountains."
               for i in range(a.prompts)]
    llms, res = {}, {"backend": jax.default_backend(), "prompts": a.prompts, "max_tokens": a.max_tokens, "modes": {}}
    for m in a.modes:
        t = time.perf_counter()
        opts = MODES[m]
        llms[m] = LLM(model=a.model, draft=None if opts is None else draft, dtype=a.dtype, max_batch=1,
                      scheduler=SchedulerOptions(**(opts or {})))
        llms[m].generate(prompts, sp)
        llms[m].generate(prompts, sp)
        res["modes"][m] = {"walls": [], "compile_s": round(time.perf_counter() - t, 1)}
        print(f"[probe] {m} compiled in {res['modes'][m]['compile_s']} s", flush=True)
    before = {m: llms[m].engine.stats() for m in a.modes}
    for r in range(a.rounds):
        order = a.modes[r % len(a.modes):] + a.modes[: r % len(a.modes)]
        for m in order:
            t = time.perf_counter()
            outs = llms[m].generate(prompts, sp)
            res["modes"][m]["walls"].append(round(time.perf_counter() - t, 4))
            print(f"[probe] round {r} {m} {res['modes'][m]['walls'][-1]} s", flush=True)
            ids = json.dumps([list(o.token_ids) for o in outs]).encode()
            res["modes"][m]["tokens_sha1"] = hashlib.sha1(ids).hexdigest()[:12]
            res["modes"][m]["tokens"] = sum(len(o.token_ids) for o in outs)
            if MODES[m] is not None:  # tau as the eval counts it: tokens / the requests' fused steps
                steps = sum(len(o.token_ids) / o.accept_len_mean for o in outs if o.accept_len_mean)
                res["modes"][m]["tau"] = round(res["modes"][m]["tokens"] / steps, 3)
    plain = res["modes"].get("plain")
    for m in a.modes:
        e = res["modes"][m]
        st = llms[m].engine.stats()
        e["wall_s"] = statistics.median(e["walls"])
        e["tok_s"] = round(e["tokens"] / e["wall_s"], 1)
        e.update({k: st.get(k, 0) - before[m].get(k, 0) for k in COUNTERS})
        if MODES[m] is not None:  # and tokens per dispatched fused step (steps past a request's end count)
            e["tok_per_fused"] = round(a.rounds * e["tokens"] / max(e["spec_dispatch_steps"], 1), 3)
            if plain is not None:
                e["x_plain"] = round(e["tok_s"] / plain["tok_s"], 3)
                e["bar"] = round(e["tau"] / 1.3, 3)
        print(f"[probe] {m:10s} wall {e['wall_s']:.4f} s {e['tok_s']:9.1f} tok/s"
              + (f" tau {e['tau']:.3f} tok/fused {e['tok_per_fused']:.3f} x{e.get('x_plain', 0):.3f}"
                 f" (bar {e.get('bar', 0):.3f})" if "tau" in e else "")
              + f" walls {e['walls']} sha {e['tokens_sha1']} "
              + " ".join(f"{k}={e[k]}" for k in COUNTERS if e.get(k)), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
