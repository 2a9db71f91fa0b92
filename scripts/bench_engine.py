"""Engine host-loop benchmark (GPU): the host bubble and the cost of grammar constraints.

For each batch size and scenario (speculative decoding with the fused step, async or sync loop;
grammars on with the overlap on or off; optionally plain decoding) it runs the traffic once to
compile, then again measuring:

  wall ms/step    mean wall time of engine.step() over the steady state (every row running)
  device ms/step  the same step programs timed alone, back to back on the live state (no host work)
  bubble          1 - device / wall: the share of wall time the device waits for the host
  tok/s           tokens delivered per second over the steady state (and over the whole run)

Grammars: "any" is a permissive regex (every token allowed, the tokens equal the unconstrained
run's, so the difference is pure overhead: mask computation, upload, split programs); "json" is a
nested JSON schema (real masks; acceptance differs from free text). Goals checked: bubble <= 2% of
wall time for the async scenarios; constrained >= 0.97x unconstrained tokens/s.

    python scripts/bench_engine.py                      # SmolLM2 with its shipped EAGLE-3 head
    python scripts/bench_engine.py --draft self --batch 1,32 --max-tokens 256 --json out.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specjax import LLM, SamplingParams  # noqa: E402
from specjax.scheduler import SchedulerOptions  # noqa: E402

JSON_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                   "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
                   "cast": {"type": "array", "items": {"type": "object", "properties": {
                       "name": {"type": "string"}, "role": {"type": "string"}}, "required": ["name", "role"]}},
                   "summary": {"type": "string"}},
    "required": ["title", "year", "genre", "cast", "summary"],
}
GRAMMARS = {None: {}, "any": {"regex": r"[\s\S]*"}, "json": {"json_schema": JSON_SCHEMA}}
TOPICS = ["a lighthouse keeper", "a robot chef", "a lost city", "the first moon base", "a chess prodigy",
          "a haunted library", "a desert caravan", "an ocean research ship"]
ASYNC, SYNC = SchedulerOptions(), SchedulerOptions(async_loop=False)
NO_OVERLAP = SchedulerOptions(overlap=False)


def prompts_for(llm, n):
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe a film about {TOPICS[i % len(TOPICS)]} "
                                      f"(#{i}) in detail: title, year, genre, cast and a long summary."}])
            for i in range(n)]


def device_time(eng, grammar, reps: int) -> float:
    """Seconds per step of the step programs alone, back to back on the live state, with the masks
    already on the device (the host mirror is left behind: the caller cancels the requests next)."""
    rows = eng.sched.running()
    for s, _ in rows:  # pages for the extra steps
        eng.sched.inflight[s] += eng.sched.advance * (reps + 1)
    eng.sched.reserve()
    eng._push_page_table()
    slots, active = eng.sched.row_slots(rows)
    flags = eng._flags([r for _, r in rows])
    mask = None
    if grammar is not None:
        eng._collect()  # the trees / tokens the masks are computed from
        mask = jax.device_put((eng._tree_masks if eng.draft is not None else eng._next_masks)(rows, len(slots)))

    def one():
        if eng.draft is None:
            K = 1 if mask is not None else eng.batch_opts.steps_per_call
            out, _, eng.state = eng.steps.decode_many(eng.weights, eng.state, eng.samp, slots, active, mask,
                                                      num_steps=K, **flags)
        elif mask is not None and eng.opts.overlap:
            ver, eng.state = eng.spec_steps.verify(eng.weights, eng.state, slots, active)
            out, _, eng.state = eng.spec_steps.finish(eng.weights, eng.draft_weights, eng.state, ver, eng.samp,
                                                      slots, active, mask, **flags)
        else:
            out, _, eng.state = eng.spec_steps.step(eng.weights, eng.draft_weights, eng.state, eng.samp, slots,
                                                    active, mask, **flags)
        return out

    jax.block_until_ready(one())
    t = time.perf_counter()
    for _ in range(reps):
        out = one()
    jax.block_until_ready((out, eng.state))
    return (time.perf_counter() - t) / reps


def _drop(eng, reqs):
    for r in reqs:
        eng.cancel(r.id)
    while eng.has_unfinished():
        eng.step()


def scenario(llm, name, prompts, grammar, sched, max_tokens, reps):
    eng = llm.engine
    eng.opts = sched
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **GRAMMARS[grammar])
    B = len(prompts)
    llm.generate(prompts, params)  # compile everything this traffic needs
    # measured run: per-step wall times; the steady state is where every row runs
    reqs = llm._requests(prompts, params)
    for r in reqs:
        eng.add_request(r)
    times, toks, full = [], [], []
    t_all = time.perf_counter()
    while eng.has_unfinished():
        t = time.perf_counter()
        ups = eng.step()
        times.append(time.perf_counter() - t)
        toks.append(sum(len(u.token_ids) for u in ups))
        full.append(sum(r is not None for r in eng.slots) == B)
    run_s = time.perf_counter() - t_all
    steady = [i for i in range(2, len(times)) if full[i] and full[i - 1]]
    # device time: the same traffic again, stopped a few steps into the steady state
    reqs2 = llm._requests(prompts, params)
    for r in reqs2:
        eng.add_request(r)
    dev, n_full = None, 0
    while eng.has_unfinished():
        eng.step()
        n_full = n_full + 1 if sum(r is not None for r in eng.slots) == B else 0
        if n_full == 3:
            dev = device_time(eng, grammar, reps)
            break
    _drop(eng, reqs2)
    wall = float(np.mean([times[i] for i in steady])) if steady else float("nan")
    tps = sum(toks[i] for i in steady) / sum(times[i] for i in steady) if steady else float("nan")
    taus = [np.mean(r.accept_lens) for r in reqs if r.accept_lens]
    return dict(name=name, batch=B, grammar=grammar or "none", async_loop=sched.async_loop, overlap=sched.overlap,
                steady_steps=len(steady), wall_ms=wall * 1e3, device_ms=None if dev is None else dev * 1e3,
                bubble=None if dev is None else max(0.0, 1 - dev / wall), tok_s=tps, tok_s_run=sum(toks) / run_s,
                tokens_per_step=sum(toks[i] for i in steady) / max(1, len(steady)),
                accept_len_mean=float(np.mean(taus)) if taus else float("nan"),
                finished_stop=sum(r.finish_reason == "stop" for r in reqs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="converted model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft dir or 'self' (default: the EAGLE-3 head shipped for the "
                   "default model; self with --model)")
    p.add_argument("--num-steps", type=int, default=4)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=20, help="back-to-back steps for the device time")
    p.add_argument("--no-plain", action="store_true", help="skip the plain-decoding rows")
    p.add_argument("--json", help="append the rows as JSON lines to this file")
    a = p.parse_args(argv)
    from specjax.llm import draft_method
    from specjax.tree import SpecConfig
    from specjax.assets import DEFAULT_HEAD_DIR
    draft = a.draft or (str(DEFAULT_HEAD_DIR) if a.model is None else "self")
    spec = SpecConfig(method=draft_method(draft), num_steps=a.num_steps, topk=a.topk,
                      num_draft_tokens=a.num_draft_tokens)
    batches = [int(b) for b in a.batch.split(",")]
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; draft: {draft} ({spec})", flush=True)
    llm = LLM(a.model, dtype=a.dtype, max_batch=max(batches), max_seq_len=a.max_seq_len, draft=draft, spec=spec)
    plans = [("spec fused", None, ASYNC), ("spec fused sync", None, SYNC), ("spec any overlap", "any", ASYNC),
             ("spec any no-overlap", "any", NO_OVERLAP), ("spec json overlap", "json", ASYNC),
             ("spec json no-overlap", "json", NO_OVERLAP)]
    for B in batches:
        for name, grammar, sched in plans:
            rows.append(scenario(llm, name, prompts_for(llm, B), grammar, sched, a.max_tokens, a.reps))
            print(json.dumps(rows[-1]), flush=True)
    if not a.no_plain:
        llm = LLM(a.model, dtype=a.dtype, max_batch=max(batches), max_seq_len=a.max_seq_len)
        for B in batches:
            for name, grammar in (("plain", None), ("plain any", "any"), ("plain json", "json")):
                rows.append(scenario(llm, name, prompts_for(llm, B), grammar, ASYNC, a.max_tokens, a.reps))
                print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    print(f"\n{'scenario':22} {'B':>3} {'wall ms':>8} {'dev ms':>8} {'bubble':>7} {'tok/s':>9} {'tok/step':>8} "
          f"{'tau':>5} {'steps':>5}")
    for r in rows:
        dev = "-" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
        bub = "-" if r["bubble"] is None else f"{100 * r['bubble']:.1f}%"
        print(f"{r['name']:22} {r['batch']:>3} {r['wall_ms']:>8.3f} {dev:>8} {bub:>7} {r['tok_s']:>9.1f} "
              f"{r['tokens_per_step']:>8.2f} {r['accept_len_mean']:>5.2f} {r['steady_steps']:>5}")
    ok = True
    for B in batches:
        by = {r["name"]: r for r in rows if r["batch"] == B}
        for name in ("spec fused", "spec any overlap", "spec json overlap"):
            b = by[name]["bubble"]
            good = b is not None and b <= 0.02
            ok &= good
            print(f"goal B={B} {name}: bubble {100 * (b or 0):.1f}% <= 2%: {'PASS' if good else 'FAIL'}")
        for name in ("spec any overlap", "spec json overlap"):
            ratio = by[name]["tok_s"] / by["spec fused"]["tok_s"]
            good = ratio >= 0.97
            ok &= good
            print(f"goal B={B} {name}: {ratio:.3f}x unconstrained tok/s >= 0.97x: {'PASS' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
